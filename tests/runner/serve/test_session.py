"""Recording a batch in its folder (what `run` and a farm's `submit` do before any job starts) and
serving it again from its ledger (what a farm does for each batch when it starts again) cost work
in proportion to the batch, counted at n and 4n jobs (tests/op_count.py); and a batch edited and
run again names every job it supersedes."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

from op_count import assert_linear
from runner_helpers import write_batch

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import EventKind, JobEvent, JobState, Ledger
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import Batch, JobSpec
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.protocol.messages import WorkerConfig
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.jobflow import BatchFlow
from pan2render.runner.serve.progress import RunProgress
from pan2render.runner.serve.scheduler import Scheduler, ServedBatch
from pan2render.runner.serve.session import SUPERSEDED_SHOWN, BatchRequest, BatchSession
from pan2render.runner.serve.steps import PAN2_FLOW
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def _batch(tmp_path: Path, n: int, *, steps: int | None = None) -> Batch:
    """``n`` jobs, one per seed, as a sweep over seed makes them (``steps``: an edited batch)."""
    base = load_batch(write_batch(tmp_path / "one.yaml", [{"name": "fox", "prompt": "a fox"}])).jobs[0]
    specs: list[JobSpec] = [dataclasses.replace(base, seed=i, sweep={"seed": i}, steps=steps or base.steps)
                            for i in range(n)]
    return Batch(path=str(tmp_path / "b.yaml"), model=base.model, preset=base.preset, jobs=specs, text="jobs: []\n")


def _record(out: Path, batch: Batch) -> BatchSession:
    request = BatchRequest(out_dir=out, batch=batch, overrides=Overrides())
    return BatchSession.record(request, stream=None, title="test")


def test_recording_a_batch_grows_linearly_in_its_jobs(tmp_path: Path) -> None:
    folders = itertools.count()

    def make(n: int) -> Callable[[], object]:
        batch, out = _batch(tmp_path, n), tmp_path / f"out{next(folders)}"
        return lambda: _record(out, batch).close()

    assert_linear(make, 50, "recording a batch")


def test_serving_a_batch_again_grows_linearly_in_its_jobs(tmp_path: Path) -> None:
    """A farm killed mid-batch: 2 jobs left running, 2 failed, the rest pending. Served again: the
    running ones interrupted, the failed ones revived, every one queued."""
    folders = itertools.count()
    executor = LocalExecutor(gpus=2, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))

    def make(n: int) -> Callable[[], object]:
        out = tmp_path / f"out{next(folders)}"
        with _record(out, _batch(tmp_path, n)) as session:
            for job_id in session.job_ids[:2]:
                session.ledger.transition(job_id, JobEvent.START, reason="test")
            for job_id in session.job_ids[2:4]:
                session.ledger.transition(job_id, JobEvent.FAIL, reason="test")

        def serve_again() -> None:
            with BatchSession.reopen(out, stream=None, title="again ({batch})") as session:
                session.prepare(retries=1, revive_cancelled=False)
                scheduler = Scheduler(executor=executor, config=ServingConfig())
                flow = BatchFlow(out_dir=out, ledger=session.ledger, flow=PAN2_FLOW, say=session.log.line)
                batch = ServedBatch(flow=flow, progress=RunProgress(log=session.log, live=False))
                scheduler.serve(batch, session.job_ids)
                assert len(scheduler.pending(batch)) == n and session.counts()["pending"] == n

        return serve_again

    try:
        assert_linear(make, 50, "serving a batch again")
    finally:
        executor.shutdown()


def test_a_batch_edited_and_run_again_names_each_job_it_supersedes(tmp_path: Path) -> None:
    out, n = tmp_path / "out", SUPERSEDED_SHOWN + 5
    _record(out, _batch(tmp_path, n)).close()
    with _record(out, _batch(tmp_path, n, steps=4)) as session:
        assert session.counts() == {"pending": n, "running": 0, "done": 0, "failed": 0, "cancelled": 0,
                                    "total": n}
    log = (out / "run.log").read_text()
    assert log.count("is superseded by") == SUPERSEDED_SHOWN and "... and 5 more superseded job(s)" in log
    assert "steps 8 -> 4" in log
    ledger = Ledger.open_readonly(out)
    try:
        superseded = [e for e in ledger.events() if e.kind is EventKind.SUPERSEDED]
        old = [j for j in ledger.jobs() if j.spec.steps == 8]
        assert [e.job_id for e in superseded] == [j.id for j in old] and len(old) == n
        assert all(j.state is JobState.PENDING for j in ledger.jobs())
    finally:
        ledger.close()
