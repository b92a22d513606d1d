"""The group pool's decisions, on groups of an executor that only counts them and a clock the test
moves: which idle group a job takes (its model, then its LoRA files, then the most recently used;
for another model, the least recently used), which idle groups go when GPUs are needed (the least
recently used), when an idle group is released (its idle time counted from its release), and when
a faulting group is held out (faults in a row)."""

from __future__ import annotations

from collections.abc import Callable

from fake_clock import FakeClock

from pan2render.runner.cluster.executor import Group, GroupStartError
from pan2render.runner.serve.pool import GroupPool


class _Groups:
    """The executor's group calls, on GPUs it only counts."""

    starts_in_background = False

    def __init__(self, gpus: int):
        self.free = gpus
        self.made = 0
        self.destroyed: list[str] = []
        self.held_out: list[str] = []

    def create_group(self, size: int, *, timeout_s: float, on_wait: Callable[[str], None] | None = None) -> Group:
        if self.free < size:
            raise GroupStartError(f"{size} GPU(s) asked, {self.free} free")
        self.free -= size
        self.made += 1
        return Group(id=f"g{self.made}", size=size, handle=None)

    def destroy_group(self, group: Group) -> None:
        self.destroyed.append(group.id)
        self.free += group.size

    def restart_group(self, group: Group, *, timeout_s: float) -> Group:
        return Group(id=group.id, size=group.size, handle=None, faults=group.faults)

    def hold_out(self, group: Group) -> None:
        self.held_out.append(group.id)


def _pool(gpus: int, clock: FakeClock, **kw: object) -> tuple[GroupPool, _Groups]:
    groups = _Groups(gpus)
    return GroupPool(groups, total_gpus=gpus, start_timeout_s=1, clock=clock, **kw), groups  # type: ignore[arg-type]


def _idle(pool: GroupPool, clock: FakeClock, n: int, size: int = 1) -> list[Group]:
    """``n`` groups made and released one second apart (the first released is the least recently used)."""
    made = [pool.try_acquire(size) for _ in range(n)]
    assert all(g is not None for g in made)
    for g in made:
        clock.advance(1)
        pool.release(g)  # type: ignore[arg-type]
    return made  # type: ignore[return-value]


def test_a_job_takes_the_idle_group_holding_its_model_and_loras_the_most_recently_used_of_them() -> None:
    clock = FakeClock()
    pool, _ = _pool(4, clock)
    a, b, c, d = _idle(pool, clock, 4)
    for g in (a, b, c, d):
        g.loads = {"wan": None}  # type: ignore[dict-item]
    b.loads = {"other": None}  # type: ignore[dict-item]
    c.adapters = frozenset({"lora-1"})
    assert pool.try_acquire(1, model="wan", adapters=frozenset({"lora-1"})) is c  # its LoRA, though not the newest
    assert pool.try_acquire(1, model="other") is b  # its model, though the oldest
    # Equal for the job: the one released last, so the others age toward their idle release.
    assert pool.try_acquire(1, model="wan") is d
    assert pool.try_acquire(1, model="wan") is a


def test_a_job_of_another_model_unloads_the_least_recently_used_idle_group() -> None:
    """The model a new one evicts is the one used longest ago (a group holding none goes first)."""
    clock = FakeClock()
    pool, _ = _pool(4, clock)
    a, b, c, d = _idle(pool, clock, 4)
    for g, model in ((a, "m-a"), (b, "m-b"), (c, "m-c")):
        g.loads = {model: None}  # type: ignore[dict-item]
    assert pool.try_acquire(1, model="new") is d  # nothing loaded: nothing evicted
    assert pool.try_acquire(1, model="new") is a
    assert pool.try_acquire(1, model="newer") is b


def test_the_least_recently_used_idle_groups_are_torn_down_for_a_larger_group() -> None:
    clock = FakeClock()
    pool, groups = _pool(3, clock)
    a, b, c = _idle(pool, clock, 3)
    a.loads = {"wan": None}  # type: ignore[dict-item]
    assert pool.try_acquire(1, model="wan") is a
    clock.advance(1)
    pool.release(a)  # used last now: b, then c, were used longest ago
    big = pool.try_acquire(2)
    assert big is not None and big.size == 2
    assert groups.destroyed == [b.id, c.id]
    assert [g.id for g, state, _ in pool.describe() if state == "idle"] == [a.id]


def test_an_idle_groups_time_counts_from_its_release_not_from_when_it_was_taken() -> None:
    """A job of an hour, then its group released: it is not released at once as idle for an hour."""
    clock = FakeClock()
    pool, groups = _pool(1, clock)
    group = pool.try_acquire(1)
    assert group is not None
    clock.advance(3600)  # the job runs
    pool.release(group)
    clock.advance(1)
    assert pool.release_idle(60) == [] and groups.destroyed == []
    clock.advance(60)
    assert pool.release_idle(60) == [group] and groups.destroyed == [group.id]


def test_a_group_is_held_out_only_after_its_device_faults_in_a_row() -> None:
    clock = FakeClock()
    pool, groups = _pool(1, clock, fault_limit=2)
    group = pool.try_acquire(1)
    assert group is not None
    fresh = pool.device_fault(group)  # one fault: the same GPUs, new workers
    assert fresh is not None and fresh.faults == 1
    fresh = pool.try_acquire(1)
    assert fresh is not None
    pool.succeeded(fresh)  # a job done on it: the fault before is no longer in a row
    again = pool.device_fault(fresh)
    assert again is not None and again.faults == 1 and groups.held_out == []
    again = pool.try_acquire(1)
    assert again is not None and pool.device_fault(again) is None  # the second in a row
    assert groups.held_out == [again.id]


def test_a_job_waits_for_another_group_rather_than_take_or_replace_the_one_it_failed_on() -> None:
    clock = FakeClock()
    pool, groups = _pool(2, clock)
    failed_on, other = pool.try_acquire(1), pool.try_acquire(1)
    assert failed_on is not None and other is not None
    pool.release(failed_on)
    avoid = frozenset({failed_on.id})
    assert pool.try_acquire(1, avoid=avoid) is None and groups.destroyed == []  # the other is busy: it waits
    pool.release(other)
    assert pool.try_acquire(1, avoid=avoid) is other
    pool.discard(other)  # the only other group gone: nothing else to wait for
    assert pool.try_acquire(1, avoid=avoid) is not None  # (a new one on the GPUs it freed, or the one it failed on)
