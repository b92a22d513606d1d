"""Groups kept between jobs: idle groups by size, so models stay loaded; idle groups of other sizes
torn down when a job needs their GPUs.

Where the executor says so (``starts_in_background``: Ray, where a start waits for a placement
group, up to the start timeout on a busy shared cluster, and then for the actors' processes and
their process group) the pool creates a group on a background thread, so the driver keeps serving
the running jobs meanwhile.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pan2render.runner.executor import Executor, Group, GroupStartError


class _BackgroundStart:
    """One ``create_group`` running on a daemon thread (daemon: a start stuck waiting for a
    placement group never keeps the process alive after the driver is done)."""

    def __init__(self, size: int, create: Any, destroy: Any) -> None:
        self.size = size
        self.group: Group | None = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._destroy = destroy
        self._lock = threading.Lock()
        self._abandoned = False
        threading.Thread(target=self._run, args=(create,), name=f"group-start-{size}", daemon=True).start()

    def _run(self, create: Any) -> None:
        try:
            group = create()
        except BaseException as e:  # noqa: BLE001 - handed to the driver thread
            self.error = e
        else:
            with self._lock:
                keep = not self._abandoned
                if keep:
                    self.group = group
            if not keep:  # the pool closed while this group was starting
                self._destroy(group)
        self.finished.set()

    def abandon(self) -> None:
        """The pool is closing: whatever this start makes is torn down, now or when it finishes."""
        with self._lock:
            self._abandoned = True
            group, self.group = self.group, None
        if group is not None:
            self._destroy(group)


class GroupPool:
    """Idle groups by size; creates groups while GPUs are free, frees idle ones of other sizes.

    With an executor that ``starts_in_background``, at most one group starts at a time, on a
    thread: ``try_acquire`` returns None while it starts and the group (or its GroupStartError) on
    the first call after. The driver dispatches strictly in order, so that call comes for the same
    job that asked.
    """

    def __init__(self, executor: Executor, *, total_gpus: int, start_timeout_s: float):
        self._ex = executor
        self.total_gpus = total_gpus
        self._start_timeout_s = start_timeout_s
        self._idle: list[Group] = []
        self._busy: dict[str, Group] = {}
        self._starting: _BackgroundStart | None = None
        self.created = 0

    def _used(self) -> int:
        starting = self._starting.size if self._starting is not None else 0
        return sum(g.size for g in self._idle) + sum(g.size for g in self._busy.values()) + starting

    @property
    def starting(self) -> bool:
        return self._starting is not None

    def wait_for_start(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, waking early when a background start finishes."""
        if self._starting is not None:
            self._starting.finished.wait(timeout_s)
        else:
            time.sleep(timeout_s)

    def try_acquire(self, size: int) -> Group | None:
        """An idle group of ``size``, a new one, or None when the GPUs are all busy or a group is
        still starting. Raises GroupStartError when a new group cannot form."""
        if self._starting is not None:
            if not self._starting.finished.is_set():
                return None
            self._collect_start()
        for g in self._idle:
            if g.size == size:
                self._idle.remove(g)
                self._busy[g.id] = g
                return g
        free = self.total_gpus - self._used()
        reclaimable = sum(g.size for g in self._idle)
        if free + reclaimable < size:
            return None
        for g in sorted(self._idle, key=lambda g: g.size):  # smallest first: lose fewest models
            if free >= size:
                break
            self._idle.remove(g)
            self._ex.destroy_group(g)
            free += g.size
        if getattr(self._ex, "starts_in_background", False):
            self._starting = _BackgroundStart(
                size, lambda: self._ex.create_group(size, timeout_s=self._start_timeout_s), self._ex.destroy_group)
            return None
        group = self._ex.create_group(size, timeout_s=self._start_timeout_s)
        self.created += 1
        self._busy[group.id] = group
        return group

    def _collect_start(self) -> None:
        """A finished background start: its group joins the idle ones, or its error is raised."""
        start, self._starting = self._starting, None
        if start.error is not None:
            if isinstance(start.error, GroupStartError):
                raise start.error
            raise GroupStartError(f"starting a group of {start.size} failed: "
                                  f"{type(start.error).__name__}: {start.error}") from start.error
        self.created += 1
        self._idle.append(start.group)

    def release(self, group: Group) -> None:
        self._busy.pop(group.id)
        self._idle.append(group)

    def discard(self, group: Group) -> None:
        """Tear a (dead or suspect) group down: actors killed, placement group removed."""
        self._busy.pop(group.id, None)
        if group in self._idle:
            self._idle.remove(group)
        self._ex.destroy_group(group)

    def close(self) -> None:
        if self._starting is not None:
            self._starting.abandon()
            self._starting = None
        for g in list(self._idle) + list(self._busy.values()):
            self.discard(g)

