"""The one narrow interface the driver uses to reach worker groups, and which one a run gets.

An :class:`Executor` makes groups of N workers (one per GPU) and runs *collective calls* on them:
``call(group, message)`` runs ``RenderWorker.execute(message)`` on every rank (``message``: one of
the typed calls of ``messages.py``) and ``result(call)`` returns rank 0's
:class:`~pan2render.runner.protocol.messages.Reply` (or the first failing rank's), or raises
:class:`GroupDied` when a worker process is gone. Two implementations:

- ``RayExecutor`` (``ray_executor.py``): one actor per GPU, the group's actors in one STRICT_PACK
  placement group, joined into a torch.distributed group (NCCL on GPUs, gloo on CPU).
- ``LocalExecutor`` (``local_executor.py``): the same calls on in-process workers, for fast unit
  tests of the driver.

:func:`make_executor` picks one for a run (the node kept up on this machine, a cluster named by
``--address``, or a local cluster of the run's own). ``GroupPool`` (``pool.py``) keeps groups
between jobs.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pan2render.runner.protocol.messages import Lane, LoadReply, Reply, WorkerCall, WorkerConfig
from pan2render.runner.serve.progress import StepReport
from pan2render.runner.serve.retry import FailureKind

if TYPE_CHECKING:
    from pan2render.runner.cluster.ray_executor import RayExecutor

# The worker (``worker.py``) imports torch and, on its first load, the model code: seconds that the
# driver never needs. Only the processes that run workers import it: Ray's actors through
# `RayWorkerProcess`, the in-process executor when it makes its first group.


class GroupDied(RuntimeError):
    """A worker of the group died or stopped answering; the group must be torn down. ``kind``:
    its failure class, from the type of what Ray raised (retry.classify_group_death), or
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


# ====================================================================== which executor a run gets
def _joined(executor: RayExecutor, say: Callable[[str], None]) -> RayExecutor:
    """Say which cluster a run joined and whose it is (another user's `ray start` is joined as
    readily as one's own), and how many GPUs it has free."""
    from pan2render.runner.cluster.node import read_record
    from pan2render.runner.cluster.ray_cluster import whose

    gcs = executor.gcs_address
    if gcs:
        record = read_record()
        owner = whose(gcs, kept_up_here=record.gcs_address if record is not None else None)
        say(f"joined {executor.cluster}: {owner}; {executor.total_gpus()} GPU(s), {executor.free_gpus()} free now "
            f"(`--address local` runs on a cluster of this run's own)")
    return executor



LOCAL_ADDRESS = "local"  # --address local: a cluster of this run's own, even with a node kept up here


def local_gpus(cpu_gpus: int | None, *, max_gpus: int) -> tuple[int, int, str | None]:
    """(GPUs a local cluster gets, CUDA devices found, a note for the user when they are logical).
    The devices are counted through NVML, without importing torch (`runner/cluster/devices.py`)."""
    from pan2render.runner.cluster.devices import cuda_gpu_count

    cuda = cuda_gpu_count()
    if cpu_gpus is not None:
        return cpu_gpus, cuda, None
    if cuda:
        return cuda, cuda, None
    # A CPU-only machine: logical GPUs, enough for the largest group.
    return max_gpus, 0, (f"no CUDA GPU found: running on CPU with {max_gpus} logical GPU(s) "
                         f"(set --cpu-gpus N to change)")


def make_executor(*, address: str | None, cpu_gpus: int | None, max_gpus: int,
                  say: Callable[[str], None], note: Callable[[str], None] | None = None) -> Executor:
    """The executor for a run: ``address`` (a cluster to join, ``local`` for a cluster of the
    run's own, None for the node kept up on this machine if one runs, else a local cluster),
    ``cpu_gpus`` logical GPUs on a CPU-only machine, ``max_gpus`` the largest group the batch
    needs; ``note``: where lines for the run log alone go (default ``say``). The test hooks of the
    environment (``PAN2_RENDER_EXECUTOR``, ``PAN2_RENDER_PIPELINE``, ``PAN2_RENDER_FAULTS``: see
    ``cli.py``) are read here."""
    import json

    from pan2render.runner.protocol.messages import DEFAULT_PIPELINE_FACTORY

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # no uv-run runtime env probing
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    faults = json.loads(os.environ.get("PAN2_RENDER_FAULTS", "{}"))
    factory = os.environ.get("PAN2_RENDER_PIPELINE", DEFAULT_PIPELINE_FACTORY)
    config = WorkerConfig(pipeline_factory=factory, faults=faults)
    if os.environ.get("PAN2_RENDER_EXECUTOR") == "local":
        from pan2render.runner.cluster.local_executor import LocalExecutor

        return LocalExecutor(gpus=cpu_gpus or max_gpus, config=config)
    import ray  # ~1 s; only a run that renders gets here

    from pan2render.runner.cluster.ray_cluster import ray_banner_to, running_local_node
    from pan2render.runner.cluster.ray_executor import RayExecutor

    ray_banner_to(note or say)
    node, node_note = running_local_node() if address is None and not ray.is_initialized() else (None, None)

    if address not in (None, LOCAL_ADDRESS):
        return _joined(RayExecutor(address=address, gpus=None, cpus=None, config=config), say)
    if address is None and not ray.is_initialized():
        if node_note:
            say(node_note)
        if node is not None:
            if cpu_gpus is not None:
                say(f"--cpu-gpus {cpu_gpus} is not used: the Ray node running on this machine has its own "
                    f"GPUs (`--address local` runs on a cluster of this run's own)")
            return _joined(RayExecutor(address=node, gpus=None, cpus=None, local_node=True, config=config), say)
    gpus, cuda, why = local_gpus(cpu_gpus, max_gpus=max_gpus)
    if ray.is_initialized():  # embedded in a process already connected to a cluster (tests)
        gpus = int(ray.cluster_resources().get("GPU", 0)) or 1
    elif why:
        say(why)
    cpus = os.cpu_count() or 1
    threads = None if cuda and cpu_gpus is None else max(1, cpus // gpus)
    return RayExecutor(address=None, gpus=gpus, cpus=cpus,
                       config=WorkerConfig(pipeline_factory=factory, faults=faults, threads=threads))

