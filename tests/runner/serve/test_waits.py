"""The scheduler and `after`: a job starts only once the jobs it runs after are done (their video
written), however many GPUs are free, and does not hold back the jobs behind it; a failed
dependency fails the jobs after it (and theirs) without any work and with its reason; running the
folder again brings them back, in order. On 2 logical GPUs of the in-process executor with the
fake pipeline; the order is read from the ledger's events, never from clocks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from runner_helpers import RecordingExecutor, render, spec

from pan2render.jobs.ledger import Event, JobEvent, JobState, Ledger, StageState
from pan2render.media.video import png_bytes
from pan2render.runner.protocol.messages import SampleCall, WorkerConfig
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def _after(job: str, *names: str, **kw: object) -> object:
    return dataclasses.replace(spec(job, **kw), after=names)  # type: ignore[arg-type]


def _order(ledger: Ledger) -> list[tuple[str, str]]:
    """(job name, "start" | "done" | "failed" | ...) in the ledger's order of events."""
    names = {j.id: j.name for j in ledger.jobs()}
    out = []
    for e in ledger.events():
        if e.started:
            out.append((names[e.job_id], "start"))
        elif (ended := _ended(e)) is not None:
            out.append((names[e.job_id], ended))
    return out


def _ended(e: Event) -> str | None:
    if e.transition is None or e.transition[1] not in (JobState.DONE, JobState.FAILED, JobState.CANCELLED):
        return None
    return e.transition[1].value


def test_a_job_starts_only_once_the_jobs_it_runs_after_are_done_with_two_gpus_free(tmp_path: Path) -> None:
    jobs = [spec("a"), _after("b", "a"), spec("c"), _after("d", "a", "b")]
    summary, ex, ledger = render(tmp_path / "out", jobs, gpus=2)  # type: ignore[arg-type]
    order = _order(ledger)
    print(order)
    assert summary.exit_code == 0 and len(summary.done) == 4
    # b waited for a's video, d for a's and b's; c (waiting for nothing) did not wait behind b:
    # it started on the second GPU before a was done.
    assert order.index(("b", "start")) > order.index(("a", "done"))
    assert order.index(("d", "start")) > order.index(("b", "done"))
    assert order.index(("c", "start")) < order.index(("a", "done"))
    assert len({g for _, _, g in ex.on_group}) == 2  # both GPUs worked


def test_a_failed_dependency_fails_the_jobs_after_it_without_work_and_a_rerun_brings_them_back(
        tmp_path: Path) -> None:
    image = tmp_path / "first.png"
    image.write_bytes(png_bytes(np.full((32, 48, 3), 90, np.uint8)))
    jobs = [spec("a", image=image), _after("b", "a"), _after("d", "b"), spec("c")]
    image.rename(tmp_path / "moved.png")  # a's input is gone: it fails at once (not retryable)
    out = tmp_path / "out"
    summary, ex, ledger = render(out, jobs, gpus=2)  # type: ignore[arg-type]
    got = {j.name: j for j in ledger.jobs()}
    for name, job in got.items():
        print(name, job.state.value, job.attempts, job.error)
    assert summary.exit_code == 1
    assert got["c"].state is JobState.DONE
    assert got["a"].state is JobState.FAILED and "image" in (got["a"].error or "")
    assert got["b"].state is JobState.FAILED and got["d"].state is JobState.FAILED
    # Its reason: a's error as the ledger holds it, after the stage it failed in.
    assert got["b"].error == f"dependency a failed: sampling: {got['a'].error}"
    assert got["d"].error == f"dependency b failed: {got['b'].error}"
    # No work for them: never started (no attempt), no stage touched, no call made for them.
    for name in ("b", "d"):
        assert got[name].attempts == 0 and got[name].error_stage is None
        assert all(r.state is StageState.PENDING for r in ledger.stages(got[name].id).values())
        assert all(job != name for _, job in ex.calls)
    ledger.close()

    # The input back, the folder served again (as `resume` does): a, then b, then d, each done.
    (tmp_path / "moved.png").rename(image)
    summary, ex, ledger = render(out, jobs, gpus=2)  # type: ignore[arg-type]
    order = _order(ledger)
    print(order)
    assert summary.exit_code == 0 and len(summary.done) == 4
    again = order[order.index(("d", "failed")) + 1:]  # this run's events
    assert again.index(("b", "start")) > again.index(("a", "done"))
    assert again.index(("d", "start")) > again.index(("b", "done"))
    assert ("c", "start") not in again  # done before: not rendered again
    assert [job for kind, job in ex.calls if kind is SampleCall] == ["a", "b", "d"]


def test_jobs_after_one_cancelled_before_the_run_are_cancelled_and_a_cycle_of_two_batches_fails_at_once(
        tmp_path: Path) -> None:
    """What a folder can hold that one batch cannot: a job cancelled in an earlier run (`resume`
    without --cancelled keeps it so), and a cycle made by two batches recorded into the folder (each
    checked alone). The jobs after the cancelled one are cancelled, the cycle's jobs fail at once,
    the rest render, and the run ends."""
    out = tmp_path / "out"
    out.mkdir()
    ledger = Ledger.open(out)
    jobs = [spec("a"), _after("b", "a"), _after("x", "y"), _after("y", "x"), spec("c")]
    ledger.add_jobs(jobs, retries=1)  # (as two batches would leave it; no batch check here)
    ledger.transition(jobs[0].job_id, JobEvent.CANCEL, reason="cancelled by a client")
    ex = RecordingExecutor(gpus=2, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    driver = Driver(out_dir=out, ledger=ledger, executor=ex, config=ServingConfig(progress=False, poll_s=0.01))
    summary = driver.run([j.job_id for j in jobs])
    got = {j.name: j for j in ledger.jobs()}
    print({n: (j.state.value, j.error) for n, j in got.items()})
    assert summary.exit_code == 1 and got["c"].state is JobState.DONE
    assert got["b"].state is JobState.CANCELLED
    assert [e.detail for e in ledger.events(got["b"].id) if e.label == "pending->cancelled"] == [
        "dependency a was cancelled: in an earlier run"]
    assert got["x"].state is got["y"].state is JobState.FAILED
    assert "its `after` jobs wait for each other in a cycle (x -> y -> x): none can start" in got["x"].error
    assert {job for _, job in ex.calls} - {None} == {"c"}  # no call for any other job
