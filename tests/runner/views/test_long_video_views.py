"""`status`, `status --json`, `show` and the report show a chained job's segments (k of N done, the
current one's sampling step) and its video's length."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from runner_helpers import render, spec

from pan2render.jobs.ledger import FolderLock, JobEvent, Stage, StageEvent
from pan2render.runner.protocol.artifacts import SAMPLING_STEP_DOC
from pan2render.runner.views.report import batch_view
from pan2render.runner.views.status import format_show, format_status, status_document


def test_a_chained_jobs_segments_and_length_in_every_view(tmp_path: Path) -> None:
    job = dataclasses.replace(spec("story", steps=3), segments=3)  # 9 frames at 8 fps a segment
    out = tmp_path / "out"
    _, _, ledger = render(out, [job])
    text, _ = format_status(out, ledger)
    print(text)
    assert "(3 segments, 25 frames at 8 fps = 3.1 s)" in text
    # The job as it stood while its third segment sampled: two segments done (their records on disk).
    (out / job.job_id / "segments" / "3" / "segment.json").unlink()
    ledger.reset_stages(job.job_id, Stage.SAMPLING, reason="test: back to its third segment")
    ledger.transition(job.job_id, JobEvent.INVALIDATE, reason="test")
    ledger.transition(job.job_id, JobEvent.START, reason="test")
    ledger.set_stage(job.job_id, Stage.SAMPLING, StageEvent.START)
    ledger.set_document(job.job_id, SAMPLING_STEP_DOC, json.dumps({"step": 2, "steps": 3, "rate": 1.5, "at": 0}))
    with FolderLock(out):  # a live run holds the folder
        text, _ = format_status(out, ledger)
        doc, _ = status_document(out, ledger)
        show = format_show(out, ledger, ledger.job(job.job_id))
    print(text, show, sep="\n")
    assert "sampling segment 3/3 2/3" in text and "(3 segments (2 done), 25 frames at 8 fps = 3.1 s)" in text
    row = doc["jobs"][0]
    assert row["long_video"] == {"segments": 3, "segments_done": 2, "frames": 25, "fps": 8.0, "seconds": 3.125,
                                 "interpolate": 1}
    assert row["progress"]["segment"] == 3 and row["progress"]["step"] == 2
    assert "progress sampling segment 3/3 2/3" in show and "video    3 segments (2 done), 25 frames" in show
    ledger.close()
    tile = batch_view(out, say=lambda _: None).tiles[job.job_id]
    assert tile.long_video == "3 segments (2 done), 25 frames at 8 fps = 3.1 s"


def test_a_chained_jobs_estimate_counts_each_segment() -> None:
    """Each segment is a sampling and two decodes (its own, for the next one's first frame, and the
    video's); the encode is of the joined video."""
    from pan2render.runner.views.estimates import CPU, History, plan

    one = spec("one", steps=3)
    three = dataclasses.replace(one, segments=3)
    a, b = plan([one, three], gpus=1, history=History(), device=CPU).estimates
    assert a.times is not None and b.times is not None
    assert b.times.sampling == 3 * a.times.sampling and b.times.decode == 6 * a.times.decode
    assert b.times.encode > a.times.encode and b.times.conditioning == a.times.conditioning
