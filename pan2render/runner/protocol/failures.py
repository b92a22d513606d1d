"""What a failure is: its class, decided by the TYPE of what was raised (on a worker, in Ray, or in
the driver), never by its message, and the one record of it (:class:`Failure`) built where it
happened and passed whole to the retry policy (``serve/retry.py``) and the ledger.

The classes (what each costs a job is the policy's):

| class          | what it is                                                                        |
|----------------|-----------------------------------------------------------------------------------|
| worker-death   | a worker process died or stopped answering, or its device faulted (DeviceError,   |
|                | torch's AcceleratorError, a torch.distributed error)                              |
| out-of-memory  | torch's OutOfMemoryError, MemoryError, or Ray's memory monitor killed the worker  |
| input          | JobInputError and its kinds: bad input detected by our code (an image that does   |
|                | not decode, NaN output, an artifact that keeps failing its check); and a cached   |
|                | job's model without a MagCache calibration (lanes.CalibrationMissing)            |
| unknown        | anything else, a library's ValueError included                                    |
| cluster-lost   | the job's node left the cluster, or the cluster lost the GPUs the job needs, or   |
|                | its GCS stopped answering                                                         |
| storage        | the output folder refused a driver write: disk full, quota, read-only filesystem, |
|                | permission denied                                                                 |
| dependency     | a job it runs after (``after``) failed: it never started (the scheduler's record, |
|                | not something raised)                                                             |
"""

from __future__ import annotations

import enum
import errno
import sys
from dataclasses import dataclass, field, replace

from pan2render.jobs.disk import is_disk_full
from pan2render.jobs.ledger import Stage
from pan2render.lanes import CalibrationMissing


class FailureKind(str, enum.Enum):
    WORKER_DEATH = "worker-death"
    OUT_OF_MEMORY = "out-of-memory"
    INPUT = "input"
    UNKNOWN = "unknown"
    CLUSTER_LOST = "cluster-lost"
    STORAGE = "storage"
    DEPENDENCY = "dependency"


# ---------------------------------------------------------------------- our exception types
class JobInputError(RuntimeError):
    """A job's input is bad in a way that fails the same on any worker (its first-frame image is
    missing, changed or does not decode; its weights changed): retrying cannot help. Raise it (or
    a subclass) where our code finds such input; nothing else counts as deterministic."""


class ArtifactCheckError(JobInputError):
    """An artifact kept failing its check after being redone: the job fails with the check's reason."""


class DeviceError(RuntimeError):
    """The worker's device faulted and may be unusable (a sticky CUDA error): the worker raises it
    where it catches a failure after which the device no longer answers."""


class ClusterLostError(RuntimeError):
    """The cluster lost the GPUs the batch needs and they did not come back in time."""


class BatchStopped(RuntimeError):
    """A failure under the whole batch (the output folder refused a write) stopped it; its jobs
    are pending, uncharged. ``cause`` is what was raised."""

    def __init__(self, cause: BaseException):
        self.cause = cause
        super().__init__(str(cause))


# ---------------------------------------------------------------------- classification
def _is_a(e: BaseException, module: str, name: str) -> bool:
    """``isinstance(e, module.name)`` without importing ``module`` (torch, ray: seconds to import):
    an exception of one of its types exists only once the module is loaded. A name the installed
    version lacks (torch.AcceleratorError is recent) matches nothing."""
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return isinstance(cls, type) and isinstance(e, cls)


def _out_of_memory(e: BaseException) -> bool:
    return (isinstance(e, MemoryError) or _is_a(e, "torch.cuda", "OutOfMemoryError")
            or _is_a(e, "ray.exceptions", "OutOfMemoryError"))


def _device_fault(e: BaseException) -> bool:
    """The device or the group's communicator failed: the worker is as good as dead."""
    return (isinstance(e, DeviceError) or _is_a(e, "torch", "AcceleratorError")
            or _is_a(e, "torch.distributed", "DistError"))


def classify_exception(e: BaseException, *, on_worker: bool = False) -> FailureKind:
    """The class of ``e``, raised in the driver or (``on_worker``) in a worker call. Storage is a
    driver class: the driver alone writes the output folder, so a full disk on a worker (its temp
    folder) is that worker's unknown failure, not a reason to stop the batch."""
    if _device_fault(e):
        return FailureKind.WORKER_DEATH
    if _out_of_memory(e):
        return FailureKind.OUT_OF_MEMORY
    if isinstance(e, (JobInputError, CalibrationMissing)):  # the same on any worker: not retried
        return FailureKind.INPUT
    if not on_worker and (is_disk_full(e) or (isinstance(e, OSError)
                                              and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS))):
        return FailureKind.STORAGE
    return FailureKind.UNKNOWN


def classify_group_death(cause: BaseException | None) -> FailureKind:
    """A group whose worker process is gone (``cause``: what Ray raised, None when the call ran
    past its deadline or the in-process worker died): out of memory when Ray's memory monitor
    killed it, else a worker death."""
    return FailureKind.OUT_OF_MEMORY if cause is not None and _out_of_memory(cause) else FailureKind.WORKER_DEATH


# ---------------------------------------------------------------------- a failure
@dataclass(frozen=True)
class Failure:
    """One failure of a job, built once where it happened (a worker's call, a group that died, the
    driver's own check or write) and passed whole to the policy and the ledger.

    ``kind`` is decided there and never rewritten: a worker classifies what it raised, the
    executor what became of a group (cluster-lost when its node or its GPUs are gone)."""

    stage: Stage | str  # the stage it is charged to
    kind: FailureKind
    error: str  # "ExcType: message", or what happened to the group
    traceback: str | None = None
    rank: int | None = None  # the worker's rank, for a failure inside a call
    # What the driver caught (not sent between processes; a stopped batch re-raises it).
    cause: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def message(self) -> str:
        """The error as the ledger and the terminal show it."""
        return self.error if self.rank is None else f"rank {self.rank}: {self.error}"

    def without_cause(self) -> Failure:
        return self if self.cause is None else replace(self, cause=None)
