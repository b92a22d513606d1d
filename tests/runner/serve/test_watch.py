"""What the watch decides. Which step report belongs to which sampling: a job id recurs (the same
job in another batch of a farm, the same batch file submitted into a second folder, or a later
attempt), and the step a sampling shows, records in its ledger and is watched by must be its own:
another sampling's last report ("50/50") would pass for this one's progress, and the watchdog would
time it from that report. A stall timeout of 0 watches nothing; a deadline passed on a node the
cluster lost is the cluster's failure, not the job's."""

from __future__ import annotations

import json
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import RecordingExecutor, ThreadedExecutor, job_name, spec

from pan2render.jobs.ledger import Ledger
from pan2render.runner.cluster.executor import Call, Group
from pan2render.runner.protocol.artifacts import SAMPLING_STEP_DOC
from pan2render.runner.protocol.messages import LoadCall, SampleCall, WorkerCall, WorkerConfig
from pan2render.runner.protocol.steps import StepClock
from pan2render.runner.serve.attempt import JobRun
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver
from pan2render.runner.serve.watch import StepRecorder, current_steps, hung, started_sampling
from pan2render.runner.worker import packing
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY, FakePipeline
from pan2render.runner.worker.render_worker import RenderWorker


def _sampling_run(ledger: Ledger, job_id: str) -> JobRun:
    run = JobRun(job=ledger.job(job_id), group=Group(id="g0x1", size=1, handle=None))
    message = SampleCall(model="tiny", job_id=job_id, spec=None, prompt_embeds=b"", negative_embeds=b"",
                         progress_key=run.progress_key)
    run.sent(message, Call(group=run.group, message=message, started=time.monotonic(), timeout_s=60.0, handle=None))
    started_sampling(run)
    return run


def test_a_sampling_sees_only_its_own_step_reports(tmp_path: Path) -> None:
    job = spec("same")
    ledgers = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        ledgers.append(led := Ledger.open(tmp_path / name))
        led.add_jobs([job], retries=2)
    first, second = (_sampling_run(led, job.job_id) for led in ledgers)
    assert first.progress_key != second.progress_key
    clock = StepClock()
    for step in range(1, 51):  # the first batch's sampling ran to its end
        clock.report(first.progress_key, step, 50)
    second.sample_started_at -= 120.0  # the second's sampling went out two minutes ago, no step yet

    steps = current_steps([(1, first), (2, second)], clock.snapshot())
    assert list(steps) == [1] and steps[1].done == 50
    # The second's ledger records no step, and the watchdog times it from its own start.
    StepRecorder().record([(2, second, ledgers[1])], current_steps([(2, second)], clock.snapshot()))
    assert ledgers[1].document(job.job_id, SAMPLING_STEP_DOC) is None
    (found,) = hung([(2, second)], current_steps([(2, second)], clock.snapshot()), limit_s=60.0)
    assert "no step yet" in found[2].error
    clock.report(second.progress_key, 3, 50)
    StepRecorder().record([(2, second, ledgers[1])], current_steps([(2, second)], clock.snapshot()))
    assert json.loads(ledgers[1].document(job.job_id, SAMPLING_STEP_DOC))["step"] == 3
    assert hung([(2, second)], current_steps([(2, second)], clock.snapshot()), limit_s=60.0) == []
    for led in ledgers:
        led.close()


def test_the_steps_due_in_one_ledger_are_one_commit(tmp_path: Path) -> None:
    """Three samplings of one batch and one of another: one transaction per ledger for their steps
    (one each made a commit, four fsyncs, per sampling every few seconds)."""
    jobs = [spec(f"j{i}") for i in range(3)]
    ledgers = []
    for name, specs in (("one", jobs), ("two", [spec("k")])):
        (tmp_path / name).mkdir()
        ledgers.append(led := Ledger.open(tmp_path / name))
        led.add_jobs(specs, retries=2)
    runs = [(i, _sampling_run(ledgers[0], j.job_id), ledgers[0]) for i, j in enumerate(jobs)]
    runs.append((9, _sampling_run(ledgers[1], spec("k").job_id), ledgers[1]))
    clock = StepClock()
    for _, run, _ in runs:
        clock.report(run.progress_key, 2, 50)
    commits: list[str] = []
    for led in ledgers:
        led._conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    StepRecorder().record(runs, current_steps([(k, r) for k, r, _ in runs], clock.snapshot()))
    assert len(commits) == 2
    for _, run, led in runs:
        assert json.loads(led.document(run.job.id, SAMPLING_STEP_DOC))["step"] == 2
    for led in ledgers:
        led.close()


def test_the_worker_reports_steps_under_the_calls_progress_key(tmp_path: Path) -> None:
    clock = StepClock()
    worker = RenderWorker(rank=0, world_size=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY), progress=clock)
    job = spec("same", steps=4)
    emb = packing.pack_embedding(FakePipeline("tiny").encode_prompt("x"), key="k", text_encoder_id="fake-text-v1")
    worker.execute(LoadCall(model=job.model))
    for key in ("same#1", "same#2"):
        reply = worker.execute(SampleCall(model=job.model, job_id=job.job_id, spec=job, prompt_embeds=emb,
                                          negative_embeds=emb, progress_key=key))
        assert reply.ok, reply.failure
    snap = clock.snapshot()
    assert set(snap) == {"same#1", "same#2"} and snap["same#2"].done == 4


def test_a_sampling_redone_by_the_same_attempt_does_not_take_the_first_ones_last_step(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    led = Ledger.open(tmp_path / "out")
    job = spec("redo")
    led.add_jobs([job], retries=2)
    run = _sampling_run(led, job.job_id)
    clock = StepClock()
    for step in range(1, 51):  # its first sampling ended; its latents failed their check
        clock.report(run.progress_key, step, 50)
    time.sleep(0.01)
    started_sampling(run)  # the same attempt samples again
    assert current_steps([(1, run)], clock.snapshot()) == {}
    clock.report(run.progress_key, 1, 50)
    assert current_steps([(1, run)], clock.snapshot())[1].done == 1
    led.close()


def test_a_stall_timeout_of_0_finds_no_sampling_hung(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--stall-timeout 0` turns the watchdog off: a sampling quiet for an hour is not hung, and a
    run whose samplings take their time (steps of 0.05 s, beside the driver's loop) renders each job
    once, none torn down."""
    (tmp_path / "unit").mkdir()
    led = Ledger.open(tmp_path / "unit")
    job = spec("quiet")
    led.add_jobs([job], retries=2)
    run = _sampling_run(led, job.job_id)
    run.sample_started_at -= 3600.0
    assert hung([(1, run)], {}, limit_s=0) == []
    assert len(hung([(1, run)], {}, limit_s=600.0)) == 1  # the same sampling, watched
    led.close()

    monkeypatch.setenv("PAN2_FAKE_STEP_SECONDS", "0.05")
    out = tmp_path / "out"
    out.mkdir()
    led = Ledger.open(out)
    jobs = [spec("a", steps=8), spec("b", steps=8)]
    led.add_jobs(jobs, retries=2)
    ex = ThreadedExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    summary = Driver(out_dir=out, ledger=led, executor=ex,
                     config=ServingConfig(retries=2, progress=False, poll_s=0.01, stall_timeout_s=0)).run(
        [j.job_id for j in jobs])
    assert len(summary.done) == 2 and [led.job(j.job_id).attempts for j in jobs] == [1, 1]
    assert ex.groups_created == 1
    led.close()


class _LosesTheNodeOfAStuckCall(RecordingExecutor):
    """The victim's first sampling never answers, and by the time its deadline passes (already, when
    it is sent) the cluster has lost the GPUs its group needs; they are back two looks later."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.struck, self.lost, self.looks = False, False, 0

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        if isinstance(message, SampleCall) and job_name(message) == "victim" and not self.struck:
            self.struck = self.lost = True
            return Call(group=group, message=message, started=time.monotonic() - 2 * timeout_s, timeout_s=timeout_s,
                        handle=futures.Future())
        return super().call(group, message, timeout_s=timeout_s)

    def lacks_gpus_for(self, size: int) -> bool:
        return self.lost or super().lacks_gpus_for(size)

    def total_gpus(self) -> int:
        if self.lost:
            self.looks += 1
            self.lost = self.looks < 2
            return 0
        return super().total_gpus()


def test_a_deadline_passed_on_a_lost_node_is_not_charged_to_the_job(tmp_path: Path) -> None:
    led = Ledger.open(tmp_path)
    jobs = [spec("victim")]
    led.add_jobs(jobs, retries=2)
    ex = _LosesTheNodeOfAStuckCall(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    summary = Driver(out_dir=tmp_path, ledger=led, executor=ex,
                     config=ServingConfig(retries=2, progress=False, poll_s=0.01, cluster_wait_s=60)).run(
        [jobs[0].job_id])
    victim = led.job(jobs[0].job_id)
    print(victim.retries_left, [(e.label, e.detail[:100]) for e in led.events(victim.id)])
    assert ex.struck and summary.done == [victim.id] and victim.retries_left == 2
    assert any("the cluster lost the GPUs" in e.detail for e in led.events(victim.id))
    led.close()
