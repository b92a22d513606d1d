"""The retry policy's classes and rules, one decision at a time (no driver, no I/O)."""

from __future__ import annotations

import errno
import sqlite3
import time
from pathlib import Path

import pytest

from pan2render.jobs.disk import DiskFullError
from pan2render.jobs.ledger import JobRecord, JobState, Stage
from pan2render.jobs.spec import JobSpec
from pan2render.runner.retry import (
    Action,
    FailureKind,
    RetryPolicy,
    classify_error_type,
    classify_exception,
    classify_group_death,
)


def _job(retries_left: int = 2) -> JobRecord:
    spec = JobSpec(name="j", model="tiny", prompt="p", negative_prompt="", image=None, image_sha256=None, seed=0,
                   steps=2, guidance=1.0, height=32, width=32, frames=5, fps=8.0, flow_shift=5.0, sampler="unipc",
                   gpus=1, crf=18, preset="tiny-preview")
    return JobRecord(id=spec.job_id, name="j", spec=spec, spec_hash=spec.spec_hash, state=JobState.RUNNING,
                     attempts=1, retries_left=retries_left, error=None, error_stage=None, position=0,
                     created_at=time.time(), updated_at=time.time())


@pytest.mark.parametrize("raised, kind", [
    (OSError(errno.ENOSPC, "No space left on device"), FailureKind.STORAGE),
    (DiskFullError(Path("/x"), needed=2, free=1, what="a"), FailureKind.STORAGE),
    (sqlite3.OperationalError("database or disk is full"), FailureKind.STORAGE),
    (PermissionError(errno.EACCES, "Permission denied"), FailureKind.STORAGE),
    (FileNotFoundError(errno.ENOENT, "gone"), FailureKind.INPUT),
    (MemoryError(), FailureKind.OUT_OF_MEMORY),
    (RuntimeError("something else"), FailureKind.UNKNOWN),
])
def test_driver_exceptions_are_classified_by_type(raised: BaseException, kind: FailureKind) -> None:
    assert classify_exception(raised) is kind


def test_worker_and_ray_errors_are_classified() -> None:
    assert classify_error_type("OutOfMemoryError", "CUDA out of memory") is FailureKind.OUT_OF_MEMORY
    assert classify_error_type("NonFiniteError") is FailureKind.INPUT
    assert classify_error_type("RuntimeError", "NCCL timeout") is FailureKind.UNKNOWN
    assert classify_group_death("group g1x1 failed in sample: OutOfMemoryError: Task was killed") \
        is FailureKind.OUT_OF_MEMORY
    assert classify_group_death("ActorDiedError: the actor died unexpectedly") is FailureKind.WORKER_DEATH


def test_each_class_has_its_rule() -> None:
    policy = RetryPolicy()
    decide = lambda kind, job=None: policy.decide(job or _job(), kind, Stage.SAMPLING, f"{kind.value} #1")  # noqa: E731
    assert decide(FailureKind.INPUT).action is Action.FAIL
    storage = decide(FailureKind.STORAGE)
    assert storage.action is Action.REQUEUE and storage.stop_batch
    lost = decide(FailureKind.CLUSTER_LOST)
    assert lost.action is Action.REQUEUE and not lost.stop_batch
    assert decide(FailureKind.WORKER_DEATH, _job(retries_left=0)).action is Action.FAIL  # budget spent
    assert RetryPolicy().decide(_job(), FailureKind.OUT_OF_MEMORY, Stage.SAMPLING, "x").action is Action.RETRY


def test_the_same_error_twice_in_a_row_stops_retrying() -> None:
    policy, job = RetryPolicy(), _job(retries_left=5)
    first = policy.decide(job, FailureKind.UNKNOWN, Stage.DECODE, "rank 0: RuntimeError: bad thing in group g3x1")
    other = policy.decide(job, FailureKind.UNKNOWN, Stage.ENCODE, "rank 0: RuntimeError: bad thing in group g4x1")
    again = policy.decide(job, FailureKind.UNKNOWN, Stage.ENCODE, "rank 0: RuntimeError: bad thing in group g5x1")
    assert (first.action, other.action) == (Action.RETRY, Action.RETRY)  # another stage: not "the same"
    assert again.action is Action.FAIL and "twice in a row in encode" in again.reason  # group ids differ only
