"""What a Ray executor puts in Ray and around it: the actor class each GPU's worker runs in, the
workers' progress sink, and the guards of this process while Ray starts and ends (a Ctrl-C
deferred during ``ray.init``, the processes it started)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from pan2render.runner.cluster.node import NodeError, started_by
from pan2render.runner.protocol.messages import Reply, WorkerCall


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """A Ctrl-C while ray.init runs takes effect once it returns (a second one at once). Ray
    interrupted while it builds its core worker leaves one that no ray.shutdown() reaches, and
    whose thread crashes the process at exit (SIGSEGV after the "interrupted" line). Where this is
    not the main thread, signals are not ours to handle: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def later(signum: int, _frame: object) -> None:
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)
        print("interrupt: stopping once Ray has started (Ctrl-C again to stop now)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, later)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def own_children() -> set[int]:
    """This process's children (none known where there is no /proc)."""
    try:
        return started_by(os.getpid())
    except NodeError:
        return set()


class RayWorkerProcess:
    """The Ray actor: a `RenderWorker` built in the actor's own process. The driver creates actors
    of this class without importing the worker (torch), and the actor times that import, which the
    first load reports (``LoadReply.worker``)."""

    def __init__(self, **kwargs: Any):
        t0 = time.perf_counter()
        import ray  # in the actor: the GPUs Ray gave it (a fault hook names one)

        from pan2render.runner.worker.render_worker import RenderWorker  # torch, in the actor's process

        gpu_ids = tuple(int(g) for g in ray.get_gpu_ids())
        self._worker = RenderWorker(**kwargs, imports_s=time.perf_counter() - t0, gpu_ids=gpu_ids)

    def execute(self, call: WorkerCall, seq: int | None = None) -> Reply[Any]:
        """`RenderWorker.execute` (the one entry point)."""
        return self._worker.execute(call, seq)


class RayProgress:
    """The workers' progress sink: step reports pushed fire-and-forget to the run's StepClock
    actor, which stamps them as they arrive."""

    def __init__(self, actor: Any):
        self._actor = actor

    def report(self, job_id: str, done: int, total: int, at: float | None = None) -> None:
        self._actor.report.remote(job_id, done, total, at)

