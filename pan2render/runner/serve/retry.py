"""What the driver does about a failure: one place for every retry decision.

A failure's class (``protocol/failures.py``) is decided where it happened; one rule per class
decides whether the job is retried, whether that costs it an attempt, and whether the group it ran
on may take the next job:

| class          | what it is                                           | rule                                 |
|----------------|------------------------------------------------------|--------------------------------------|
| worker-death   | a worker process died or stopped answering, or its   | retry on a new group (attempt        |
|                | device faulted (DeviceError, torch's                 | charged); the group is torn down     |
|                | AcceleratorError, a torch.distributed error)         |                                      |
| out-of-memory  | torch's OutOfMemoryError, MemoryError, or Ray's      | retry on a new group (charged): the  |
|                | memory monitor killed the worker                     | device may hold fragments            |
| input          | JobInputError and its kinds: bad input detected by   | fail now: retrying gives the same    |
|                | our code (an image that does not decode, NaN output, | result; the group stays              |
|                | an artifact that keeps failing its check)            |                                      |
| unknown        | anything else, a library's ValueError included       | retry (charged); the group stays     |
| cluster-lost   | the job's node left the cluster, or the cluster lost | back to pending, NOT charged; the    |
|                | the GPUs the job needs, or its GCS stopped answering | batch waits for GPUs (bounded)       |
| storage        | the output folder refused a driver write: disk full, | back to pending, NOT charged; the    |
|                | quota, read-only filesystem, permission denied       | batch stops scheduling and exits     |
| dependency     | a job it runs after (`after`) failed                 | fail now, never started (NOT         |
|                |                                                      | charged); `retry`/`resume` revive it |

Across classes: the same error twice in a row on the same stage of a job stops retrying it (the
backstop for a deterministic failure we did not recognise by type), as does a spent retry budget.
And whatever the class, a group of more than one rank that failed on its GPU lane is torn down: its
ranks may have stopped at different collectives. A failure on the I/O lane (rank 0's encode, CPU
work) leaves the group as it was unless its worker died.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from pan2render.jobs.ledger import JobRecord, Stage
from pan2render.runner.protocol.failures import Failure, FailureKind


class Action(str, enum.Enum):
    RETRY = "retry"  # back to pending, one retry of the budget spent
    REQUEUE = "requeue"  # back to pending, nothing charged: the environment failed, not the job
    FAIL = "fail"


# ---------------------------------------------------------------------- the policy
@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str  # why, for the ledger's event and the log line
    stop_batch: bool = False  # stop starting jobs (storage): the run exits once running ones stop
    keep_group: bool = True  # the group the job failed on may take the next job


@dataclass(frozen=True)
class OnGroup:
    """Where on a group a failure happened, for the group's half of the decision."""

    size: int  # the group's ranks
    io_lane: bool = False  # the I/O lane (rank 0's encode), not the GPU lane


def keeps_group(kind: FailureKind, where: OnGroup | None) -> bool:
    """May the group take the next job after this failure?"""
    if where is None:
        return True  # the failure was not the group's (a driver write, a group that never formed)
    if kind in (FailureKind.WORKER_DEATH, FailureKind.CLUSTER_LOST):
        return False  # gone, or its device is
    if where.io_lane:
        return True  # CPU work on rank 0 alone: the GPU lane and the collectives are untouched
    if kind is FailureKind.OUT_OF_MEMORY:
        return False  # the allocator may be fragmented or the device left in a bad state
    # One rank's GPU-lane error may leave the others waiting in a collective it never reached.
    return where.size == 1


def _signature(stage: Stage | str, error: str) -> str:
    """An error with its varying parts (group ids, pids, addresses, counts) blanked, so that the
    same failure twice compares equal."""
    first = error.strip().splitlines()[0] if error.strip() else ""
    return f"{stage}:{re.sub(r'0x[0-9a-f]+|[0-9]+', '#', first)}"


def _name(stage: Stage | str) -> str:
    return stage.value if isinstance(stage, Stage) else stage


class RetryPolicy:
    """Decides every failure of a run; remembers each job's last failure for the twice-in-a-row rule."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}  # job id -> signature of its last failure in this run

    def decide(self, job: JobRecord, failure: Failure, *, on_group: OnGroup | None = None) -> Decision:
        """What becomes of ``job`` after ``failure`` (``on_group``: where on a group it happened;
        None when it was not the group's)."""
        kind, stage, error = failure.kind, failure.stage, failure.message
        keep = keeps_group(kind, on_group)
        if kind is FailureKind.STORAGE:
            return Decision(Action.REQUEUE, "the output folder refused a write (not charged to the job); "
                                            "stopping the batch", stop_batch=True, keep_group=keep)
        if kind is FailureKind.CLUSTER_LOST:
            return Decision(Action.REQUEUE, "the cluster lost the GPUs this job ran on (not charged to the "
                                            "job); waiting for GPUs to return", keep_group=keep)
        if kind is FailureKind.INPUT:
            return Decision(Action.FAIL, "not retryable: deterministic for this job's inputs", keep_group=keep)
        if kind is FailureKind.DEPENDENCY:  # (the scheduler ends such jobs itself: serve/waits.py)
            return Decision(Action.FAIL, "not started: a job it runs after failed", keep_group=keep)
        signature = _signature(stage, error)
        repeated = self._last.get(job.id) == signature
        self._last[job.id] = signature
        if repeated:
            return Decision(Action.FAIL, f"the same {kind.value} error twice in a row in {_name(stage)}: "
                                         "retrying again would repeat it", keep_group=keep)
        if job.retries_left <= 0:
            return Decision(Action.FAIL, "retry budget spent", keep_group=keep)
        what = "out of memory: retrying on a fresh group" if kind is FailureKind.OUT_OF_MEMORY else kind.value
        return Decision(Action.RETRY, f"{what}; {job.retries_left - 1} retries left after this one",
                        keep_group=keep)
