"""What a failure is, and what the driver does about it: one place for every retry decision.

A failure is classified by the type of what was raised (on the worker, in Ray, or in the driver),
then one rule per class decides:

| class          | what it is                                          | rule                                  |
|----------------|-----------------------------------------------------|---------------------------------------|
| worker-death   | a worker process died or stopped answering          | retry on a new group (attempt charged) |
| out-of-memory  | CUDA/host OOM, or Ray's memory monitor killed it    | retry on a new group (charged)        |
| input          | deterministic for this spec (bad image, NaN output, | fail now: retrying gives the same     |
|                | an artifact that keeps failing its check)           | result                                |
| unknown        | anything else                                       | retry (charged)                       |
| cluster-lost   | the cluster lost the GPUs the job needs             | back to pending, NOT charged; the     |
|                |                                                     | batch waits for GPUs (bounded)        |
| storage        | the output folder refused a write: disk full, quota,| back to pending, NOT charged; the     |
|                | read-only filesystem, permission denied             | batch stops scheduling and exits      |

And across classes: the same error twice in a row on the same stage of a job stops retrying it
(a deterministic failure we did not recognise by type), as does a spent retry budget.
"""

from __future__ import annotations

import enum
import errno
import re
from dataclasses import dataclass

from pan2render.jobs.disk import is_disk_full
from pan2render.jobs.ledger import JobRecord, Stage


class FailureKind(str, enum.Enum):
    WORKER_DEATH = "worker-death"
    OUT_OF_MEMORY = "out-of-memory"
    INPUT = "input"
    UNKNOWN = "unknown"
    CLUSTER_LOST = "cluster-lost"
    STORAGE = "storage"


class Action(str, enum.Enum):
    RETRY = "retry"  # back to pending, one retry of the budget spent
    REQUEUE = "requeue"  # back to pending, nothing charged: the environment failed, not the job
    FAIL = "fail"


# Exception type names (as a worker reply or a Ray error spells them) that say the device or the
# host ran out of memory.
_OOM_TYPES = ("OutOfMemoryError", "MemoryError")
# Deterministic for a job's spec: the same inputs fail the same way on any worker.
_INPUT_TYPES = ("NonFiniteError", "FloatingPointError", "ValueError", "ArtifactCheckError", "JobInputError",
                "FileNotFoundError", "IsADirectoryError", "UnsafePathError")


class ClusterLostError(RuntimeError):
    """The cluster lost the GPUs the batch needs and they did not come back in time."""


class BatchStopped(RuntimeError):
    """A failure under the whole batch (the output folder refused a write) stopped it; its jobs
    are pending, uncharged. ``cause`` is what was raised."""

    def __init__(self, cause: BaseException):
        self.cause = cause
        super().__init__(str(cause))


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str  # why, for the ledger's event and the log line
    stop_batch: bool = False  # stop starting jobs (storage): the run exits once running ones stop


def classify_error_type(type_name: str, message: str = "") -> FailureKind:
    """The class of an error known by its exception type name (a worker reply's ``error`` starts
    with it; a Ray error's is in the group-death message)."""
    if any(t in type_name for t in _OOM_TYPES) or "out of memory" in message.lower():
        return FailureKind.OUT_OF_MEMORY
    if type_name in _INPUT_TYPES:
        return FailureKind.INPUT
    return FailureKind.UNKNOWN


def classify_exception(e: BaseException) -> FailureKind:
    """A failure raised in the driver itself (writing an artifact, reading an input)."""
    if is_disk_full(e) or (isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)):
        return FailureKind.STORAGE
    return classify_error_type(type(e).__name__, str(e))


def classify_group_death(message: str) -> FailureKind:
    """A worker process that died: Ray names an OOM kill (its memory monitor) in the message."""
    if any(t in message for t in _OOM_TYPES) or "out of memory" in message.lower():
        return FailureKind.OUT_OF_MEMORY
    return FailureKind.WORKER_DEATH


def _signature(stage: Stage, error: str) -> str:
    """An error with its varying parts (group ids, pids, addresses, counts) blanked, so that the
    same failure twice compares equal."""
    first = error.strip().splitlines()[0] if error.strip() else ""
    return f"{stage.value}:{re.sub(r'0x[0-9a-f]+|[0-9]+', '#', first)}"


class RetryPolicy:
    """Decides every failure of a run; remembers each job's last failure for the twice-in-a-row rule."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}  # job id -> signature of its last failure in this run

    def decide(self, job: JobRecord, kind: FailureKind, stage: Stage, error: str) -> Decision:
        if kind is FailureKind.STORAGE:
            return Decision(Action.REQUEUE, "the output folder refused a write (not charged to the job); "
                                            "stopping the batch", stop_batch=True)
        if kind is FailureKind.CLUSTER_LOST:
            return Decision(Action.REQUEUE, "the cluster lost the GPUs this job ran on (not charged to the "
                                            "job); waiting for GPUs to return")
        if kind is FailureKind.INPUT:
            return Decision(Action.FAIL, "not retryable: deterministic for this job's inputs")
        signature = _signature(stage, error)
        repeated = self._last.get(job.id) == signature
        self._last[job.id] = signature
        if repeated:
            return Decision(Action.FAIL, f"the same {kind.value} error twice in a row in {stage.value}: "
                                         "retrying again would repeat it")
        if job.retries_left <= 0:
            return Decision(Action.FAIL, "retry budget spent")
        what = "out of memory: retrying on a fresh group" if kind is FailureKind.OUT_OF_MEMORY else kind.value
        return Decision(Action.RETRY, f"{what}; {job.retries_left - 1} retries left after this one")
