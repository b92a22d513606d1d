"""The farm's ETAs: each batch's planned again about every ETA_EVERY_S while planning is cheap; when
it is not, planning keeps to ETA_SHARE of the time, the oldest ETA first, so no batch's goes stale
for good."""

from __future__ import annotations

import pytest

from pan2render.runner.farm.etas import ETA_BURST_S, ETA_SHARE, Etas
from pan2render.runner.serve.progress import ETA_EVERY_S


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _farm(cost_s: float, batches: int) -> tuple[_Clock, Etas, dict[str, list[float]]]:
    """``batches`` batches whose plan takes ``cost_s`` of the clock; each batch's plan times kept."""
    clock, planned = _Clock(), {}
    etas = Etas(clock=clock)

    def plan_of(batch_id: str):
        def plan() -> float:
            planned[batch_id].append(clock.t)
            clock.t += cost_s
            return 100.0 - clock.t
        return plan

    for b in range(batches):
        planned[f"b{b}"] = []
        etas.add(f"b{b}", plan_of(f"b{b}"))
    return clock, etas, planned


def test_cheap_etas_are_planned_again_each_second_and_no_more() -> None:
    clock, etas, planned = _farm(0.0, 5)
    for _ in range(40):  # 20 s of snapshots, every 0.5 s
        clock.t += 0.5
        etas.refresh()
    for times in planned.values():
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert len(times) >= 20 / (ETA_EVERY_S + 0.5) and min(gaps) >= ETA_EVERY_S, times
    assert etas.seconds("b0") == 100.0 - planned["b0"][-1] and etas.seconds("gone") is None


def test_costly_etas_keep_to_their_share_of_the_time_the_oldest_first() -> None:
    clock, etas, planned = _farm(0.05, 100)  # a plan of 50 ms a batch: 5 s a round of every batch
    start = clock.t  # (after the first plans, at add: each batch's own, whatever the credit)
    for _ in range(1200):  # 600 s of snapshots (the scheduler's pass between them: 0.5 s)
        clock.t += 0.5
        etas.refresh()
    plans = sum(len(t) for t in planned.values()) - 100
    spent = plans * 0.05
    assert spent <= ETA_SHARE * (clock.t - start - spent) + ETA_BURST_S + 0.05, (spent, clock.t)
    assert spent >= 0.8 * ETA_SHARE * (clock.t - start - spent), "the share is used, not left idle"
    counts = [len(t) - 1 for t in planned.values()]
    assert max(counts) - min(counts) <= 1, counts  # round-robin: the oldest first


def test_asked_on_a_quiet_farm_it_is_planned_now_on_a_busy_one_at_the_next_refresh() -> None:
    """A quiet farm says what `status` would at that moment; a busy one the last figure, the next
    refresh planning it again (when its credit allows)."""
    clock, etas, planned = _farm(0.001, 2)
    clock.t += 0.1
    asked_at = clock.t
    assert etas.seconds("b0") == pytest.approx(100.0 - asked_at - 0.001) and planned["b0"] == [0.0, asked_at]
    clock, etas, planned = _farm(0.2, 2)  # two plans of 0.2 s each: the credit is overdrawn
    clock.t += 0.1
    assert etas.seconds("b0") == pytest.approx(100.0 - 0.2) and len(planned["b0"]) == 1  # its plan at add, 0.2 s long
    while len(planned["b0"]) == 1:
        clock.t += 0.5
        etas.refresh()
    assert clock.t - planned["b0"][1] < 0.2 + 1e-9 and etas.seconds("b1") is not None
