"""A clock that moves only when the test moves it: what a sampling's hooks, the pool's idle times
and the farm read as time, so a test's timing holds whatever the machine's load."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
