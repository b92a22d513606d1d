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
from collections.abc import Callable
from typing import Any

from pan2render.runner.cluster.executor import Executor, Group, GroupStartError
from pan2render.runner.protocol.timeline import stamp


class _BackgroundStart:
    """One ``create_group`` running on a daemon thread (daemon: a start stuck waiting for a
    placement group never keeps the process alive after the driver is done). ``create`` is called
    with the callable that keeps what the start says while it waits (``note``)."""

    def __init__(self, size: int, create: Any, destroy: Any) -> None:
        self.size = size
        self.group: Group | None = None
        self.error: BaseException | None = None
        self.note: str | None = None  # the latest word from the start while it waits (create's on_wait)
        self.finished = threading.Event()
        self._destroy = destroy
        self._lock = threading.Lock()
        self._abandoned = False
        threading.Thread(target=self._run, args=(create,), name=f"group-start-{size}", daemon=True).start()

    def _run(self, create: Any) -> None:
        try:
            group = create(self._note)
        except BaseException as e:  # handed to the driver thread
            self.error = e
        else:
            with self._lock:
                keep = not self._abandoned
                if keep:
                    self.group = group
            if not keep:  # the pool closed while this group was starting
                self._destroy(group)
        self.finished.set()

    def _note(self, text: str) -> None:
        """create_group's on_wait, on this start's thread; the scheduler's loop takes the note."""
        self.note = text

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
    the first call after. The scheduler dispatches strictly in order, so that call comes for the
    same job that asked.

    ``fault_limit`` (the farm's): a group whose jobs fail with device faults that many times in a
    row is held out of service (its GPUs stay reserved, so nothing lands on them again) instead of
    started again on the same GPUs. None: a faulted group is torn down and a new one made anywhere.

    ``clock``: what the pool's times (a group idle since, busy since) are read from, in seconds
    (``time.time``; a test passes its own, so an idle time passes only when the test says so).
    """

    def __init__(self, executor: Executor, *, total_gpus: int, start_timeout_s: float,
                 fault_limit: int | None = None, clock: Callable[[], float] = time.time):
        self._ex = executor
        self.total_gpus = total_gpus
        self._start_timeout_s = start_timeout_s
        self.fault_limit = fault_limit
        self._clock = clock
        self._idle: list[Group] = []
        self._busy: dict[str, Group] = {}
        self._out: list[Group] = []  # held out of service
        self._since: dict[str, float] = {}  # group id -> when it went idle / busy / out (clock())
        self._starting: _BackgroundStart | None = None
        self._told: set[str] = set()  # groups whose placement the run log has told
        self._held: dict[str, int] = {}  # group id -> its GPUs, for every group it holds
        self._held_gpus = 0
        self.created = 0

    def _used(self) -> int:
        """GPUs of the groups it holds (idle, busy, out of service) and of the one starting: kept as
        groups come and go, not summed over every group on each job's start."""
        return self._held_gpus + (self._starting.size if self._starting is not None else 0)

    def _hold(self, group: Group) -> None:
        self._held[group.id] = group.size
        self._held_gpus += group.size

    @property
    def starting(self) -> bool:
        return self._starting is not None

    def take_start_note(self) -> str | None:
        """What a group start waiting for GPUs last said, once (None: nothing new)."""
        start = self._starting
        if start is None or start.note is None:
            return None
        note, start.note = start.note, None
        return note

    def wait_for_start(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, waking early when a background start finishes."""
        if self._starting is not None:
            self._starting.finished.wait(timeout_s)
        else:
            time.sleep(timeout_s)

    def try_acquire(self, size: int, *, model: str | None = None, adapters: frozenset[str] = frozenset(),
                    avoid: frozenset[str] = frozenset()) -> Group | None:
        """An idle group of ``size``, a new one, or None when the GPUs are all busy or a group is
        still starting. Among idle groups the best for the job: one holding its ``model`` (and most
        of its LoRA ``adapters``), the most recently used of those, so that the others age toward
        their idle release; else one holding no model; else the least recently used, whose model
        the job's load unloads (eviction is LRU, as when GPUs must be freed: the least recently
        used idle groups are torn down first). A group in ``avoid`` (the job failed on it) is taken
        only when no other group of that size exists: while one does, the job waits for it. Raises
        GroupStartError when a new group cannot form."""
        if self._starting is not None:
            if not self._starting.finished.is_set():
                return None
            self._collect_start()
        fits = [g for g in self._idle if g.size == size]
        kept: list[Group] = []  # idle groups the job avoids: neither taken nor torn down to make one in their place
        if avoid and any(g.id in avoid for g in fits):
            others = [g for g in [*self._idle, *self._busy.values()] if g.size == size and g.id not in avoid]
            if others or self.total_gpus - self._used() >= size:  # another group, or room to make one
                kept = [g for g in fits if g.id in avoid]
                fits = [g for g in fits if g.id not in avoid]
        if fits:
            def fit(g: Group) -> tuple[bool, int, bool, float]:
                holds = model is not None and model in g.loads
                used = self._since.get(g.id, 0.0)
                return holds, len(adapters & g.adapters), not g.loads, used if holds else -used
            return self._take(max(fits, key=fit))
        free = self.total_gpus - self._used()
        reclaimable = [g for g in self._idle if g not in kept]
        if free + sum(g.size for g in reclaimable) < size:
            return None
        for g in sorted(reclaimable, key=lambda g: self._since.get(g.id, 0.0)):  # least recently used first
            if free >= size:
                break
            self._drop(g)
            free += g.size
        if getattr(self._ex, "starts_in_background", False):
            self._starting = _BackgroundStart(
                size, lambda on_wait: self._ex.create_group(size, timeout_s=self._start_timeout_s, on_wait=on_wait),
                self._ex.destroy_group)
            return None
        group = self._ex.create_group(size, timeout_s=self._start_timeout_s)
        self.created += 1
        self._hold(group)
        self._busy[group.id] = group
        self._since[group.id] = self._clock()
        return group

    def _take(self, group: Group) -> Group:
        self._idle.remove(group)
        self._busy[group.id] = group
        self._since[group.id] = self._clock()
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
        self._hold(start.group)
        self._idle.append(start.group)
        self._since[start.group.id] = self._clock()

    def release(self, group: Group) -> None:
        self._busy.pop(group.id)
        self._idle.append(group)
        self._since[group.id] = self._clock()

    def release_idle(self, max_idle_s: float) -> list[Group]:
        """Tear down the groups idle for longer than ``max_idle_s`` (their GPUs go back to the
        cluster); returns them."""
        now = self._clock()
        old = [g for g in self._idle if now - self._since.get(g.id, now) > max_idle_s]
        for g in old:
            self._drop(g)
        return old

    def discard(self, group: Group) -> None:
        """Tear a (dead or suspect) group down: actors killed, placement group removed."""
        self._busy.pop(group.id, None)
        self._drop(group)

    def device_fault(self, group: Group) -> Group | None:
        """A job on ``group`` failed with a device fault or its worker died. With a ``fault_limit``
        the group starts again on the same GPUs (returned, idle), until its ``fault_limit``-th fault
        in a row holds it out of service (None); without one it is torn down (None)."""
        group.faults += 1
        if self.fault_limit is None:
            self.discard(group)
            return None
        self._busy.pop(group.id, None)
        if group in self._idle:
            self._idle.remove(group)
        if group.faults >= self.fault_limit:
            self._ex.hold_out(group)
            self._out.append(group)
            self._since[group.id] = self._clock()
            return None
        fresh = self._ex.restart_group(group, timeout_s=self._start_timeout_s)
        self.created += 1
        self._idle.append(fresh)
        self._since[fresh.id] = self._clock()
        return fresh

    def succeeded(self, group: Group) -> None:
        """A job finished on ``group``: its faults are no longer in a row."""
        group.faults = 0

    def placement_line(self, group: Group) -> str | None:
        """The run log's start-up line of a group the first time it takes a job (stamps: seconds
        since the command started); None after, or when its placement was not timed."""
        if group.id in self._told or not group.placed_at:
            return None
        self._told.add(group.id)
        joined = ", its processes joined" if group.size > 1 else ""
        return (f"start-up: group {group.id} ({group.size} GPU{'s' if group.size > 1 else ''}) placed at "
                f"{stamp(group.placed_at)}{joined} (asked for at {stamp(group.asked_at)})")

    def describe(self) -> list[tuple[Group, str, float]]:
        """Every group the pool holds: (group, "busy" | "idle" | "out of service", since when)."""
        rows = [(g, "busy", self._since.get(g.id, 0.0)) for g in self._busy.values()]
        rows += [(g, "idle", self._since.get(g.id, 0.0)) for g in self._idle]
        return rows + [(g, "out of service", self._since.get(g.id, 0.0)) for g in self._out]

    def _drop(self, group: Group) -> None:
        if group in self._idle:
            self._idle.remove(group)
        if (size := self._held.pop(group.id, None)) is not None:
            self._held_gpus -= size
        self._since.pop(group.id, None)
        self._ex.destroy_group(group)

    def close(self) -> None:
        if self._starting is not None:
            self._starting.abandon()
            self._starting = None
        for g in list(self._idle) + list(self._busy.values()) + self._out:
            self.discard(g)
        self._out.clear()
