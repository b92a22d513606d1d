"""The retry policy: failures classified by exception type, one rule per class, and for each class
what the driver then does (retried or not, an attempt charged or not, the group reused or replaced),
first one decision at a time, then through the driver with the fault raised on the worker."""

from __future__ import annotations

import errno
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray.exceptions
import torch
import torch.distributed
from runner_helpers import RecordingExecutor, job_name, render, spec, sqlite_disk_full

from pan2render.jobs.disk import DiskFullError
from pan2render.jobs.ledger import JobRecord, JobState, Stage
from pan2render.jobs.spec import JobSpec
from pan2render.runner.cluster.executor import Call, Group, GroupDied
from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.failures import (
    ArtifactCheckError,
    BatchStopped,
    DeviceError,
    Failure,
    FailureKind,
    JobInputError,
    classify_exception,
    classify_group_death,
)
from pan2render.runner.protocol.messages import CollectCall, SampleCall, WorkerCall, WorkerConfig
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver
from pan2render.runner.serve.retry import Action, OnGroup, RetryPolicy, keeps_group
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY
from pan2render.runner.worker.render_worker import RenderWorker


def _job(retries_left: int = 2) -> JobRecord:
    spec = JobSpec(name="j", model="tiny", prompt="p", negative_prompt="", image=None, image_sha256=None, seed=0,
                   steps=2, guidance=1.0, height=32, width=32, frames=5, fps=8.0, flow_shift=5.0, sampler="unipc",
                   gpus=1, crf=18, preset="tiny-preview")
    return JobRecord(id=spec.job_id, name="j", spec=spec, spec_hash=spec.spec_hash, state=JobState.RUNNING,
                     attempts=1, retries_left=retries_left, error=None, error_stage=None, position=0,
                     created_at=time.time(), updated_at=time.time())


# ------------------------------------------------------------------------------ classification
@pytest.mark.parametrize("raised, kind", [
    (OSError(errno.ENOSPC, "No space left on device"), FailureKind.STORAGE),
    (DiskFullError(Path("/x"), needed=2, free=1, what="a"), FailureKind.STORAGE),
    (sqlite_disk_full(), FailureKind.STORAGE),
    (PermissionError(errno.EACCES, "Permission denied"), FailureKind.STORAGE),
    (JobInputError("image gone"), FailureKind.INPUT),
    (ArtifactCheckError("failed its check 3 times"), FailureKind.INPUT),
    (artifacts.NonFiniteError("NaN"), FailureKind.INPUT),
    (artifacts.UnsafePathError("DIR/job is a symlink"), FailureKind.INPUT),
    (MemoryError(), FailureKind.OUT_OF_MEMORY),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.60 GiB"), FailureKind.OUT_OF_MEMORY),
    (DeviceError("the device fails after RuntimeError"), FailureKind.WORKER_DEATH),
    (torch.distributed.DistBackendError("NCCL communicator was aborted"), FailureKind.WORKER_DEATH),
    # Not ours: a library's ValueError or FileNotFoundError is not known to be deterministic.
    (ValueError("bad size 33x48x9"), FailureKind.UNKNOWN),
    (FileNotFoundError(errno.ENOENT, "gone"), FailureKind.UNKNOWN),
    (RuntimeError("CUDA error: out of memory (only the text says so)"), FailureKind.UNKNOWN),
])
def test_driver_exceptions_are_classified_by_type(raised: BaseException, kind: FailureKind) -> None:
    assert classify_exception(raised) is kind


def test_torch_device_faults_are_classified_by_type() -> None:
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is None:
        pytest.skip(f"torch {torch.__version__} has no AcceleratorError")
    assert classify_exception(accelerator("CUDA error: an illegal memory access"), on_worker=True) \
        is FailureKind.WORKER_DEATH


def test_a_worker_disk_error_is_not_the_output_folders() -> None:
    """Only the driver writes the output folder: a full temp disk on a worker must not stop the batch."""
    full = OSError(errno.ENOSPC, "No space left on device")
    assert classify_exception(full, on_worker=True) is FailureKind.UNKNOWN
    assert classify_exception(full) is FailureKind.STORAGE


def test_a_dead_group_is_out_of_memory_only_when_ray_says_so_by_type() -> None:
    assert classify_group_death(ray.exceptions.OutOfMemoryError("Task was killed due to memory pressure")) \
        is FailureKind.OUT_OF_MEMORY
    assert classify_group_death(ray.exceptions.ActorDiedError()) is FailureKind.WORKER_DEATH
    assert classify_group_death(RuntimeError("... out of memory ...")) is FailureKind.WORKER_DEATH
    assert classify_group_death(None) is FailureKind.WORKER_DEATH  # past its deadline


@dataclass(frozen=True)
class _Boom(WorkerCall):
    """A GPU-lane call whose handler fails with a plain RuntimeError, as a failed CUDA kernel may."""


class _BoomWorker(RenderWorker):
    def _boom(self, call: _Boom) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


_BoomWorker.handlers = {**RenderWorker.handlers, _Boom: _BoomWorker._boom}


@pytest.mark.parametrize("device_works", [True, False])
def test_the_worker_tells_a_poisoned_device_by_probing_it_not_by_the_text(
        monkeypatch: pytest.MonkeyPatch, device_works: bool) -> None:
    w = _BoomWorker(rank=0, world_size=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    w.device = "cuda"  # as on a GPU, where the probe is a synchronize

    def synchronize() -> None:
        if not device_works:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    reply = w.execute(_Boom(), 0)
    assert reply.failure is not None
    print(device_works, reply.failure.kind, reply.failure.error)
    if device_works:  # the same "CUDA error" text, but the device still answers: the group may go on
        assert reply.failure.kind is FailureKind.UNKNOWN and reply.failure.error.startswith("RuntimeError")
    else:
        assert reply.failure.kind is FailureKind.WORKER_DEATH and reply.failure.error.startswith("DeviceError")


# ------------------------------------------------------------------------------ one decision at a time
def test_each_class_has_its_rule() -> None:
    policy = RetryPolicy()
    decide = lambda kind, job=None: policy.decide(job or _job(), Failure(Stage.SAMPLING, kind, f"{kind.value} #1"))  # noqa: E731
    assert decide(FailureKind.INPUT).action is Action.FAIL
    storage = decide(FailureKind.STORAGE)
    assert storage.action is Action.REQUEUE and storage.stop_batch
    lost = decide(FailureKind.CLUSTER_LOST)
    assert lost.action is Action.REQUEUE and not lost.stop_batch
    assert decide(FailureKind.UNKNOWN).action is Action.RETRY
    assert decide(FailureKind.WORKER_DEATH, _job(retries_left=0)).action is Action.FAIL  # budget spent
    assert RetryPolicy().decide(_job(), Failure(Stage.SAMPLING, FailureKind.OUT_OF_MEMORY, "x")).action is Action.RETRY


def test_the_same_error_twice_in_a_row_stops_retrying() -> None:
    policy, job = RetryPolicy(), _job(retries_left=5)
    def bad_thing(stage: Stage, group: str) -> Failure:
        return Failure(stage, FailureKind.UNKNOWN, f"rank 0: RuntimeError: bad thing in group {group}")

    first = policy.decide(job, bad_thing(Stage.DECODE, "g3x1"))
    other = policy.decide(job, bad_thing(Stage.ENCODE, "g4x1"))
    again = policy.decide(job, bad_thing(Stage.ENCODE, "g5x1"))
    assert (first.action, other.action) == (Action.RETRY, Action.RETRY)  # another stage: not "the same"
    assert again.action is Action.FAIL and "twice in a row in encode" in again.reason  # group ids differ only


@pytest.mark.parametrize("kind, where, keep", [
    (FailureKind.WORKER_DEATH, OnGroup(size=1), False),
    (FailureKind.CLUSTER_LOST, OnGroup(size=1), False),
    (FailureKind.OUT_OF_MEMORY, OnGroup(size=1), False),
    (FailureKind.OUT_OF_MEMORY, OnGroup(size=1, io_lane=True), True),  # host memory, in rank 0's encode
    (FailureKind.INPUT, OnGroup(size=1), True),
    (FailureKind.UNKNOWN, OnGroup(size=1), True),
    (FailureKind.INPUT, OnGroup(size=2), False),  # the other rank may wait in a collective
    (FailureKind.UNKNOWN, OnGroup(size=2), False),
    (FailureKind.UNKNOWN, OnGroup(size=2, io_lane=True), True),
    (FailureKind.STORAGE, None, True),  # a driver write: not the group's failure
])
def test_whether_the_group_takes_the_next_job(kind: FailureKind, where: OnGroup | None, keep: bool) -> None:
    assert keeps_group(kind, where) is keep
    assert RetryPolicy().decide(_job(), Failure(Stage.SAMPLING, kind, "x"), on_group=where).keep_group is keep


# ------------------------------------------------------------------------------ through the driver
_FAULTS = [
    # what the worker raises, its class, the victim's attempts, where its second sample ran
    ("RuntimeError", FailureKind.UNKNOWN, 2, "same group"),
    ("ValueError", FailureKind.UNKNOWN, 2, "same group"),  # a library's ValueError: retried
    ("JobInputError", FailureKind.INPUT, 1, None),  # failed at once
    ("OutOfMemoryError", FailureKind.OUT_OF_MEMORY, 2, "new group"),
    ("DeviceError", FailureKind.WORKER_DEATH, 2, "new group"),
] + ([("AcceleratorError", FailureKind.WORKER_DEATH, 2, "new group")] if hasattr(torch, "AcceleratorError") else [])


@pytest.mark.parametrize("raised, kind, attempts, second", _FAULTS, ids=[f[0] for f in _FAULTS])
def test_each_failure_class_through_the_driver(tmp_path: Path, raised: str, kind: FailureKind, attempts: int,
                                               second: str | None) -> None:
    jobs = [spec("victim"), spec("after")]
    summary, ex, led = render(tmp_path, jobs, retries=2,
                              faults={"fail": {"job": "victim", "stage": "sampling", "raise": raised}})
    victim = led.job(jobs[0].job_id)
    samples = [(name, gid) for t, name, gid in ex.on_group if t is SampleCall]
    print(raised, victim.state.value, victim.attempts, victim.error, "| samples:", samples)
    assert summary.done == [jobs[1].job_id] and victim.state is JobState.FAILED
    assert f"[{kind.value}" in (victim.error or "") and f"{raised}: injected failure" in victim.error
    assert victim.attempts == attempts  # each attempt charged; an input error gets no second one
    victim_groups = [gid for name, gid in samples if name == "victim"]
    after_group = next(gid for name, gid in samples if name == "after")
    if second is None:  # the group stayed: the next job ran on it
        assert victim_groups == [after_group] and ex.groups_created == 1
    elif second == "same group":
        assert len(set(victim_groups)) == 1 and len(victim_groups) == 2 and ex.groups_created == 1
    else:
        # (and a third when "after" was still encoding on the second one as it was torn down)
        assert len(set(victim_groups)) == 2 and after_group != victim_groups[0] and ex.groups_created >= 2
        assert any(e.label == "group-discarded" for e in led.events(victim.id))


def test_a_worker_death_is_retried_on_a_new_group_and_charged(tmp_path: Path) -> None:
    marker = tmp_path / "crashed"
    jobs = [spec("victim"), spec("after")]
    summary, ex, led = render(tmp_path / "out", jobs, retries=2,
                              faults={"crash": {"job": "victim", "step": 1, "marker": str(marker)}})
    victim = led.job(jobs[0].job_id)
    groups = [gid for t, name, gid in ex.on_group if t is SampleCall and name == "victim"]
    print(victim.attempts, victim.retries_left, groups)
    assert len(summary.done) == 2 and marker.exists()
    assert victim.attempts == 2 and victim.retries_left == 1 and len(set(groups)) == 2


@pytest.mark.parametrize("gpus, stage, same", [(2, "sampling", False), (2, "encode", True)])
def test_a_group_of_two_is_replaced_after_a_gpu_lane_failure_only(tmp_path: Path, gpus: int, stage: str,
                                                                   same: bool) -> None:
    jobs = [spec("victim", gpus=gpus), spec("after", gpus=gpus)]
    summary, ex, led = render(tmp_path, jobs, gpus=gpus, retries=2,
                              faults={"fail": {"job": "victim", "stage": stage}})
    first = {"sampling": SampleCall}.get(stage)
    groups = [gid for t, name, gid in ex.on_group if name == "victim" and (t is first or first is None)]
    print(stage, groups, ex.groups_created)
    assert summary.done == [jobs[1].job_id]
    assert (ex.groups_created == 1) is same and (len(set(groups)) == 1) is same


class _LosesItsGpus(RecordingExecutor):
    """The victim's first sample meets a dead node; the cluster then reports no GPUs, twice."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.gone, self.struck = 0, False

    def total_gpus(self) -> int:
        if self.gone:
            self.gone -= 1
            return 0
        return super().total_gpus()

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        if isinstance(message, SampleCall) and message.spec.name == "victim" and not self.struck:
            self.gone, self.struck = 2, True
            self.calls.append((SampleCall, "victim"))
            self.on_group.append((SampleCall, "victim", group.id))
            return Call(group=group, message=message, started=time.monotonic(), timeout_s=timeout_s,
                        handle=GroupDied("ActorDiedError: the node running this actor died"))
        return super().call(group, message, timeout_s=timeout_s)


def test_a_lost_cluster_requeues_uncharged_on_a_new_group(tmp_path: Path) -> None:
    from pan2render.jobs.ledger import Ledger

    jobs = [spec("victim")]
    led = Ledger.open(tmp_path)
    led.add_jobs(jobs, retries=2)
    ex = _LosesItsGpus(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    summary = Driver(out_dir=tmp_path, ledger=led, executor=ex,
                     config=ServingConfig(retries=2, progress=False, poll_s=0.01, cluster_wait_s=30)).run(
        [jobs[0].job_id])
    victim = led.job(jobs[0].job_id)
    groups = [gid for t, name, gid in ex.on_group if t is SampleCall]
    print(victim.attempts, victim.retries_left, groups)
    assert summary.done == [victim.id] and victim.retries_left == 2 and len(set(groups)) == 2
    assert any("the cluster lost the GPUs" in e.detail for e in led.events(victim.id))


def test_a_full_output_disk_requeues_uncharged_and_stops_the_batch(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from pan2render.jobs.ledger import Ledger

    real_write = artifacts.write_artifact

    def write(out_dir: Path, relpath: str, data: bytes) -> None:
        if relpath.endswith(artifacts.LATENTS_NAME):
            raise DiskFullError(Path(out_dir), needed=len(data), free=0, what=relpath)
        real_write(out_dir, relpath, data)

    monkeypatch.setattr(artifacts, "write_artifact", write)
    jobs = [spec("victim"), spec("after")]
    led = Ledger.open(tmp_path)
    led.add_jobs(jobs, retries=2)
    ex = RecordingExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    with pytest.raises(BatchStopped):
        Driver(out_dir=tmp_path, ledger=led, executor=ex,
               config=ServingConfig(retries=2, progress=False, poll_s=0.01)).run([j.job_id for j in jobs])
    victim = led.job(jobs[0].job_id)
    print(victim.state, victim.retries_left, [e.label for e in led.events(victim.id)])
    assert victim.state is JobState.PENDING and victim.retries_left == 2
    assert not any(e.label in ("group-discarded", "group-died") for e in led.events(victim.id))
    assert (SampleCall, "after") not in ex.calls  # nothing more was started


def test_a_retried_job_waits_for_another_gpus_group_rather_than_run_where_it_failed(tmp_path: Path) -> None:
    """An unknown error leaves its group fit for the next job, but the job itself is offered another
    group: with two GPUs its retry runs on the other one's group once that is free, neither on the
    group it failed on nor on one made anew on the same GPU in its place."""
    jobs = [spec("victim"), spec("after")]
    summary, ex, led = render(tmp_path, jobs, gpus=2, retries=1,
                              faults={"fail": {"job": "victim", "stage": "sampling"}})
    samples = [(name, gid) for t, name, gid in ex.on_group if t is SampleCall]
    print(samples, ex.groups_created)
    first, second = [gid for name, gid in samples if name == "victim"]
    (after,) = [gid for name, gid in samples if name == "after"]
    assert led.job(jobs[0].job_id).attempts == 2 and summary.done == [jobs[1].job_id]
    assert second != first and second == after and ex.groups_created == 2


class _StrikesBesideAnEncode(RecordingExecutor):
    """The victim's first sampling never answers (its deadline already past when sent) or, with
    ``dies``, its worker dies under it, on the group whose other job, the bystander, is encoding: the
    bystander's encode is held until the group is torn down, so it is in flight when the victim's
    sampling is found overdue or dead."""

    def __init__(self, *, dies: bool = False, **kw: Any):
        super().__init__(**kw)
        self.dies, self.struck = dies, False
        self.torn_down = threading.Event()

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        if isinstance(message, SampleCall) and job_name(message) == "victim" and not self.struck:
            self.struck = True
            self.on_group.append((SampleCall, "victim", group.id))
            if self.dies:
                return Call(group=group, message=message, started=time.monotonic(), timeout_s=timeout_s,
                            handle=GroupDied(f"worker rank 0 of group {group.id} died in SampleCall"))
            return Call(group=group, message=message, started=time.monotonic() - 2 * timeout_s, timeout_s=timeout_s,
                        handle=futures.Future())
        if isinstance(message, CollectCall) and job_name(message) == "bystander" and not self.torn_down.is_set():
            def after_tear_down() -> Any:
                self.torn_down.wait(timeout=60)
                return self._execute(group, message, None)

            return Call(group=group, message=message, started=time.monotonic(), timeout_s=timeout_s,
                        handle=self._io.submit(after_tear_down))
        return super().call(group, message, timeout_s=timeout_s)

    def destroy_group(self, group: Group) -> None:
        super().destroy_group(group)
        self.torn_down.set()


def test_a_job_whose_group_is_torn_down_for_another_jobs_hang_is_not_charged(tmp_path: Path) -> None:
    """The hung sampling's job is charged an attempt; the job encoding beside it on the same group,
    whose own call was answering, goes back to pending uncharged and renders on the next group."""
    from pan2render.jobs.ledger import Ledger

    jobs = [spec("bystander"), spec("victim")]
    led = Ledger.open(tmp_path)
    led.add_jobs(jobs, retries=2)
    ex = _StrikesBesideAnEncode(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    summary = Driver(out_dir=tmp_path, ledger=led, executor=ex,
                     config=ServingConfig(retries=2, progress=False, poll_s=0.01)).run([j.job_id for j in jobs])
    bystander, victim = (led.job(j.job_id) for j in jobs)
    print(bystander.retries_left, victim.retries_left, [(e.label, e.detail[:120]) for e in led.events(bystander.id)])
    assert ex.torn_down.is_set() and sorted(summary.done) == sorted(j.job_id for j in jobs)
    assert victim.retries_left == 1  # its sampling hung: charged
    assert bystander.retries_left == 2  # torn down with it: not charged
    assert any("not charged" in e.detail for e in led.events(bystander.id))


def test_a_job_beside_a_worker_that_died_is_charged_as_its_killer_may_be(tmp_path: Path) -> None:
    """The worker died while both jobs had a call on it: either may have killed it, so both are
    charged an attempt (a job that kills its worker from the I/O lane is not retried for free)."""
    from pan2render.jobs.ledger import Ledger

    jobs = [spec("bystander"), spec("victim")]
    led = Ledger.open(tmp_path)
    led.add_jobs(jobs, retries=2)
    ex = _StrikesBesideAnEncode(dies=True, gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    summary = Driver(out_dir=tmp_path, ledger=led, executor=ex,
                     config=ServingConfig(retries=2, progress=False, poll_s=0.01)).run([j.job_id for j in jobs])
    bystander, victim = (led.job(j.job_id) for j in jobs)
    print(bystander.retries_left, victim.retries_left, [(e.label, e.detail[:120]) for e in led.events(bystander.id)])
    assert ex.torn_down.is_set() and sorted(summary.done) == sorted(j.job_id for j in jobs)
    assert (victim.retries_left, bystander.retries_left) == (1, 1)
    assert not any("not charged" in e.detail for e in led.events(bystander.id))
