"""The report's thumbnail of a job's input image: made from the image the job started from, and
never a wait on a path that has become a FIFO (the farm writes its reports on a thread it joins)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from runner_helpers import spec

from pan2render.jobs.ledger import JobRecord, JobState
from pan2render.media.video import png_bytes
from pan2render.runner.views.posters import input_thumbnail

pytestmark = pytest.mark.timeout(60)


def _record(image: Path) -> JobRecord:
    job = spec("still", image=image)
    return JobRecord(id=job.job_id, name=job.name, spec=job, spec_hash=job.job_id, state=JobState.DONE, attempts=1,
                     retries_left=2, error=None, error_stage=None, position=0, created_at=0.0, updated_at=0.0)


def _thumbnail_within(seconds: float, out: Path, job: JobRecord) -> str | None:
    made: list[str | None] = []
    thread = threading.Thread(target=lambda: made.append(input_thumbnail(out, job, print)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the report is still blocked after {seconds} s"
    return made[0]


def test_a_thumbnail_is_made_from_the_image_the_job_started_from(tmp_path: Path) -> None:
    image = tmp_path / "harbour.png"
    image.write_bytes(png_bytes(np.full((64, 96, 3), 200, np.uint8)))
    job = _record(image)
    out = tmp_path / "out"
    out.mkdir()
    rel = _thumbnail_within(10, out, job)
    assert rel is not None and (out / rel).read_bytes().startswith(b"\x89PNG")
    (out / rel).unlink()
    image.write_bytes(png_bytes(np.full((64, 96, 3), 10, np.uint8)))  # another picture under the same name
    assert _thumbnail_within(10, out, job) is None  # not shown as the one the job started from


def test_an_image_that_became_a_fifo_gets_no_thumbnail_and_the_report_goes_on(tmp_path: Path) -> None:
    image = tmp_path / "harbour.png"
    image.write_bytes(png_bytes(np.full((64, 96, 3), 200, np.uint8)))
    job = _record(image)
    image.unlink()
    os.mkfifo(image)  # nobody ever writes to it
    (tmp_path / "out").mkdir()
    try:
        assert _thumbnail_within(10, tmp_path / "out", job) is None
    finally:  # let a stuck reader go: a writer that opens and closes gives it end-of-file
        try:
            os.close(os.open(image, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # nobody reading it
            pass
