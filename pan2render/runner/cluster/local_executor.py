"""The in-process executor: the executor interface on workers in this process, for fast unit
tests of the driver. It does not form a torch.distributed group (a group of N is one
world-size-1 worker). GPU-lane calls run at ``call`` time; an I/O-lane call (the collect) runs on
a thread and is ready when that job's background encode is, so the driver's tests see the same two
lanes as on Ray."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any

from pan2render.runner.cluster.executor import Call, Group, GroupDied, GroupStartError, next_group_number
from pan2render.runner.protocol.failures import FailureKind
from pan2render.runner.protocol.messages import IO_CONCURRENCY, Lane, Reply, WorkerCall, WorkerConfig
from pan2render.runner.protocol.steps import StepClock, StepReport

if TYPE_CHECKING:  # the worker imports torch: only once a group is made
    from pan2render.runner.worker.render_worker import RenderWorker


class LocalExecutor:
    """Runs each GPU-lane call synchronously at ``call`` time, in this process; an I/O-lane call
    on a thread (it waits for the worker's encode thread)."""

    starts_in_background = False  # a group is one in-process object: nothing to wait for
    worker_logs = None  # the workers log where this process does
    cluster = "the in-process cluster"

    def __init__(self, *, gpus: int, config: WorkerConfig, worker_class: type[RenderWorker] | None = None):
        """``worker_class``: a RenderWorker subclass with handlers of its own (a test's extra stage)."""
        self._gpus = gpus
        self._config = config
        self._worker_class = worker_class
        self._free = set(range(gpus))  # the GPU numbers no group holds (a fault hook names one)
        self._progress = StepClock()
        self._io = futures.ThreadPoolExecutor(max_workers=4 * IO_CONCURRENCY, thread_name_prefix="local-io")
        self.groups_created = 0

    def total_gpus(self) -> int:
        return self._gpus

    def max_group_size(self) -> int:
        return self._gpus

    def create_group(self, size: int, *, timeout_s: float, on_wait: Callable[[str], None] | None = None) -> Group:
        # (an in-process group never waits: it is made at once or refused)
        if len(self._free) < size:
            raise GroupStartError(f"{size} GPU(s) asked of the in-process cluster, {len(self._free)} free")
        gpus = sorted(self._free)[:size]
        self._free -= set(gpus)
        return self._group(f"local-{next_group_number()}", size, gpus)

    def _group(self, gid: str, size: int, gpus: list[int]) -> Group:
        from pan2render.runner.worker.render_worker import RenderWorker, SimulatedWorkerDeath  # torch

        def die() -> None:
            raise SimulatedWorkerDeath()

        asked = time.time()
        worker = (self._worker_class or RenderWorker)(rank=0, world_size=1, config=self._config,
                                                      progress=self._progress, die=die, gpu_ids=tuple(gpus))
        self.groups_created += 1
        return Group(id=gid, size=size, handle={"worker": worker, "dead": False, "gpus": gpus},
                     asked_at=asked, placed_at=time.time())

    def destroy_group(self, group: Group) -> None:
        group.handle["dead"] = True
        if not group.handle.get("gpus_freed"):  # (a worker that died is destroyed after)
            group.handle["gpus_freed"] = True
            self._free |= set(group.handle["gpus"])

    def restart_group(self, group: Group, *, timeout_s: float) -> Group:
        group.handle["dead"] = True
        group.handle["gpus_freed"] = True  # they pass to the new workers
        fresh = self._group(group.id, group.size, group.handle["gpus"])
        fresh.faults = group.faults
        return fresh

    def hold_out(self, group: Group) -> None:
        group.handle["dead"] = True  # its GPUs stay taken until the pool closes (destroy_group)

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        seq = group.take_seq(message)
        started = time.monotonic()
        if message.lane is Lane.IO:
            handle: Any = self._io.submit(self._execute, group, message, seq)
        else:
            handle = self._execute(group, message, seq)
        return Call(group=group, message=message, started=started, timeout_s=timeout_s, handle=handle)

    @staticmethod
    def _execute(group: Group, message: WorkerCall, seq: int | None) -> Reply[Any] | GroupDied:
        from pan2render.runner.worker.render_worker import SimulatedWorkerDeath  # imported by create_group

        if group.handle["dead"]:
            return GroupDied(f"group {group.id} was torn down")
        try:
            return group.handle["worker"].execute(message, seq)
        except SimulatedWorkerDeath:
            group.handle["dead"] = True
            return GroupDied(f"worker rank 0 of group {group.id} died in {type(message).__name__}")

    def wait(self, calls: Sequence[Call], *, timeout_s: float) -> list[Call]:
        """The finished calls; waits up to ``timeout_s`` for one when only collects are running."""
        pending = [c.handle for c in calls if isinstance(c.handle, futures.Future)]
        if pending and len(pending) == len(calls):
            futures.wait(pending, timeout=timeout_s, return_when=futures.FIRST_COMPLETED)
        return [c for c in calls if not isinstance(c.handle, futures.Future) or c.handle.done()]

    def result(self, call: Call) -> Reply[Any]:
        outcome = call.handle.result() if isinstance(call.handle, futures.Future) else call.handle
        if isinstance(outcome, GroupDied):
            if outcome.kind is not FailureKind.CLUSTER_LOST and self.lacks_gpus_for(call.group.size):
                raise GroupDied(f"{outcome} (the cluster lost the GPUs it needs)",
                                kind=FailureKind.CLUSTER_LOST) from outcome
            raise outcome
        if call.group.handle["dead"]:  # torn down while this call ran: its answer is void
            raise GroupDied(f"group {call.group.id} was torn down")
        return outcome

    def progress(self) -> dict[str, StepReport]:
        return self._progress.snapshot()

    def check_cluster(self) -> None:
        """An in-process cluster cannot be lost."""

    def unreachable(self) -> str | None:
        return None  # (in this process: it answers while the process does)

    def lacks_gpus_for(self, size: int) -> bool:
        return self.total_gpus() < size

    def shutdown(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)

