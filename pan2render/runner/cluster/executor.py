"""The one narrow interface the driver uses to reach worker groups.

An :class:`Executor` makes groups of N workers (one per GPU) and runs *collective calls* on them:
``call(group, message)`` runs ``RenderWorker.execute(message)`` on every rank (``message``: one of
the typed calls of ``protocol/messages.py``) and ``result(call)`` returns rank 0's
:class:`~pan2render.runner.protocol.messages.Reply` (or the first failing rank's), or raises
:class:`GroupDied` when a worker process is gone. Three implementations:

- ``RayExecutor`` (``ray_executor.py``): one actor per GPU, the group's actors in one STRICT_PACK
  placement group, joined into a torch.distributed group (NCCL on GPUs, gloo on CPU).
- ``LocalExecutor`` (``local_executor.py``): the same calls on in-process workers, for fast unit
  tests of the driver.
- ``SimulatedExecutor`` (``simulated.py``): virtual GPUs on virtual nodes answering after the time
  a cost model gives each call, with injected faults, on a virtual clock or real time: the scheduler
  measured and tested at any size (``scripts/bench_scale.py``).

:func:`~pan2render.runner.cluster.choose.make_executor` picks one for a run (the node kept up on
this machine, a cluster named by ``--address``, or a local cluster of the run's own).
``GroupPool`` (``serve/pool.py``) keeps groups between jobs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pan2render.runner.protocol.failures import FailureKind
from pan2render.runner.protocol.messages import Lane, LoadReply, Reply, WorkerCall
from pan2render.runner.protocol.steps import StepReport

# The worker (``worker/render_worker.py``) imports torch and, on its first load, the model code: seconds that the
# driver never needs. Only the processes that run workers import it: Ray's actors through
# `RayWorkerProcess`, the in-process executor when it makes its first group.


class GroupDied(RuntimeError):
    """A worker of the group died or stopped answering; the group must be torn down. ``kind``:
    its failure class, from the type of what Ray raised (failures.classify_group_death), or
    cluster-lost when the group's node left the cluster (the failure is then not the job's)."""

    def __init__(self, message: str, *, kind: FailureKind = FailureKind.WORKER_DEATH):
        super().__init__(message)
        self.kind = kind


class GroupStartError(RuntimeError):
    """A group could not be formed (placement group not ready, rendezvous failed)."""


@dataclass
class Group:
    id: str
    size: int
    handle: Any  # executor-specific: actors + placement group, or local workers
    loads: dict[str, LoadReply] = field(default_factory=dict)  # model -> its load's reply (loaded on every rank)
    worker_told: bool = False  # the run log has told how its worker process came up
    adapters: frozenset[str] = frozenset()  # digests of the LoRA files its workers keep
    faults: int = 0  # its jobs' device faults (or worker deaths) in a row: the pool's fault_limit
    next_seq: int = 0  # number of the next GPU-lane call (the workers run them in this order)
    # When the executor was asked for it and when it was placed (its GPUs granted, its actors
    # created, a group of several joined into its process group), as time.time(): the run log's
    # start-up lines. 0.0: not known.
    asked_at: float = 0.0
    placed_at: float = 0.0

    def take_seq(self, message: WorkerCall) -> int | None:
        """The GPU-lane number for ``message`` (None off the GPU lane)."""
        if message.lane is not Lane.GPU:
            return None
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq


@dataclass
class Call:
    """A message in flight to a group."""

    group: Group
    message: WorkerCall
    started: float
    timeout_s: float
    handle: Any  # executor-specific: object refs, or the finished reply


class Executor(Protocol):
    starts_in_background: bool  # GroupPool runs create_group on a thread (it blocks for long)
    worker_logs: str | None  # where the workers' own logs are, to tell the user once
    cluster: str  # how messages name the cluster ("the Ray cluster at HOST:PORT")

    def total_gpus(self) -> int: ...
    def max_group_size(self) -> int: ...  # most GPUs on one node (a group is STRICT_PACK)
    # ``on_wait``: told, every few seconds from the thread that starts the group, while its GPUs
    # are not granted (what it waits for, how many the cluster has free).
    def create_group(self, size: int, *, timeout_s: float, on_wait: Callable[[str], None] | None = None) -> Group: ...
    def destroy_group(self, group: Group) -> None: ...
    # New workers on the same GPUs (the group's id and fault count kept), and: the workers ended but
    # the GPUs kept, so that no group is placed on them again (a GPU held out of service).
    def restart_group(self, group: Group, *, timeout_s: float) -> Group: ...
    def hold_out(self, group: Group) -> None: ...
    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call: ...
    def wait(self, calls: Sequence[Call], *, timeout_s: float) -> list[Call]: ...
    def result(self, call: Call) -> Reply[Any]: ...
    def progress(self) -> dict[str, StepReport]: ...
    def check_cluster(self) -> None: ...  # raises ClusterLostError when the cluster is gone
    # Why the cluster does not answer now (None: it does); from any thread, never blocking longer
    # than a connection's probe (a readiness check asks it).
    def unreachable(self) -> str | None: ...
    # Has the cluster lost the GPUs a group of this size needs (a node died)? A failure of such a
    # group is then the cluster's, not its job's.
    def lacks_gpus_for(self, size: int) -> bool: ...
    def shutdown(self) -> None: ...


_ids = itertools.count()


def next_group_number() -> int:
    """Group ids are unique in the process, whichever executor made them."""
    return next(_ids)


def first_failure(replies: list[Reply[Any]]) -> Reply[Any]:
    """The first failing rank's reply, else rank 0's."""
    for r in replies:
        if not r.ok:
            return r
    return replies[0]
