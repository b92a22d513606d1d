"""One ETA per batch, from the ledger alone: a farm's batch served on groups another batch loaded
gets its ETA from its own done jobs (not the reference table's guess), and the farm (`queue`, the
monitor) and `status` say the same ETA, reading after reading, at the same moment."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from runner_helpers import RecordingExecutor, farm_config, spec

from pan2render.jobs.ledger import EventKind, Ledger
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import Batch, JobSpec
from pan2render.runner.farm.service import Farm
from pan2render.runner.protocol.messages import WorkerConfig
from pan2render.runner.serve.session import BatchRequest
from pan2render.runner.views.eta import BatchEta
from pan2render.runner.views.status import status_document
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def _request(out: Path, jobs: list[JobSpec]) -> BatchRequest:
    return BatchRequest(out_dir=out, batch=Batch(path="b.yaml", model="tiny", preset="tiny-preview", jobs=jobs),
                        overrides=Overrides())


def _step_until(farm: Farm, *, check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        farm.step()
        assert time.monotonic() < deadline, what


def test_a_farm_batch_on_warm_groups_has_one_measured_eta_in_the_farm_and_in_status(tmp_path: Path) -> None:
    root = tmp_path / "farm"
    root.mkdir()
    farm = Farm(farm_config(root), RecordingExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY)),
                log=lambda text: None)
    try:
        warm = farm.actions.submit(_request(tmp_path / "first", [spec("w")]), owner="ann")
        _step_until(farm, check=lambda: farm.describe(warm["id"])["state"] == "done", what="the first batch")
        out = tmp_path / "out"
        b = farm.actions.submit(_request(out, [spec(n, seed=i) for i, n in enumerate("abcde")]), owner="ann")
        _step_until(farm, check=lambda: farm.describe(b["id"])["counts"]["done"] >= 2, what="two jobs done")
        farm.actions.pause(b["id"], paused=True)
        _step_until(farm, check=lambda: not farm.describe(b["id"])["running"], what="its running job's end")

        first, left = farm.describe(b["id"])["eta_s"], 5 - farm.describe(b["id"])["counts"]["done"]
        for _ in range(5):
            farm.step()
        again = farm.describe(b["id"])["eta_s"]
        ledger = Ledger.open_readonly(out)
        try:
            assert not [e for e in ledger.events() if e.kind is EventKind.GROUP_LOAD]  # (loaded for `first`)
            doc, _ = status_document(out, ledger)
            the_plan = BatchEta(out, None, gpus=1).plan(ledger)
        finally:
            ledger.close()
    finally:
        farm.close()
    print(f"farm: {first} then {again}; status: {doc['run']['eta_s']} from {doc['run']['eta_from']}")
    assert first is not None and first > 0
    assert again == first and doc["run"]["eta_s"] == pytest.approx(first, abs=1e-3)
    assert left > 0 and doc["run"]["eta_from"].startswith(f"{left} job(s) from this machine's runs")
    assert "reference table" not in doc["run"]["eta_from"]
    assert the_plan is not None and len(the_plan.estimates) == left


def test_a_running_job_counts_only_what_is_left_of_it(tmp_path: Path) -> None:
    """Conditioning done and sampling at its recorded step 25 of 50: the ETA counts no conditioning
    and half the sampling of it, and the rest whole."""
    import json

    from pan2render.jobs.ledger import JobEvent, Stage, StageEvent
    from pan2render.runner.protocol.artifacts import SAMPLING_STEP_DOC

    out = tmp_path / "out"
    out.mkdir()
    ledger = Ledger.open(out)
    jobs = [spec("a", steps=50), spec("b", steps=50)]
    ledger.add_jobs(jobs, retries=1)
    a = jobs[0].job_id
    ledger.transition(a, JobEvent.START, reason="test")
    ledger.set_stage(a, Stage.CONDITIONING, StageEvent.FINISH, seconds=0.1)
    ledger.set_stage(a, Stage.SAMPLING, StageEvent.START)
    ledger.set_document(a, SAMPLING_STEP_DOC, json.dumps({"step": 25, "steps": 50, "rate": 1.0, "at": 0.0}))
    the_plan = BatchEta(out, None, gpus=1).plan(ledger)
    ledger.close()
    assert the_plan is not None
    running, pending = the_plan.estimates
    assert running.times is not None and pending.times is not None
    assert running.times.conditioning == 0 and running.times.sampling == pytest.approx(pending.times.sampling / 2)
    assert (running.times.decode, running.times.encode) == (pending.times.decode, pending.times.encode)


def test_a_chained_jobs_sampling_counts_its_done_segments(tmp_path: Path) -> None:
    """3 segments, segments 1 and 2 done and segment 3 at step 25 of 50: a sixth of the job's
    sampling is left (its step alone would say half)."""
    import dataclasses
    import json

    from pan2render.jobs.ledger import JobEvent, Stage, StageEvent
    from pan2render.runner.protocol.artifacts import SAMPLING_STEP_DOC, SEGMENT_RECORD_NAME, segment_relpath

    out = tmp_path / "out"
    out.mkdir()
    ledger = Ledger.open(out)
    story, later = (dataclasses.replace(spec(name, steps=50), segments=3) for name in ("story", "later"))
    ledger.add_jobs([story, later], retries=1)
    job = story.job_id
    ledger.transition(job, JobEvent.START, reason="test")
    ledger.set_stage(job, Stage.CONDITIONING, StageEvent.FINISH, seconds=0.1)
    ledger.set_stage(job, Stage.SAMPLING, StageEvent.START)
    for k in (1, 2):  # (the ETA counts the records, as status does; it does not check them)
        record = out / segment_relpath(job, k, SEGMENT_RECORD_NAME)
        record.parent.mkdir(parents=True)
        record.write_text("{}")
    ledger.set_document(job, SAMPLING_STEP_DOC, json.dumps({"step": 25, "steps": 50, "rate": 1.0, "at": 0.0}))
    the_plan = BatchEta(out, None, gpus=1).plan(ledger)
    ledger.close()
    assert the_plan is not None
    running, pending = the_plan.estimates
    assert running.times is not None and pending.times is not None
    print(f"sampling left: {running.times.sampling:.2f} s of {pending.times.sampling:.2f} s")
    assert running.times.sampling == pytest.approx(pending.times.sampling / 6)
