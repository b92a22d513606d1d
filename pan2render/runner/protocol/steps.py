"""A sampling's progress as it crosses from the workers to the driver: :class:`StepReport` (``k/N``
and the latest steps' stamps) and the :class:`StepClock` that keeps them.

Step rates are measured where the steps happen: the worker stamps each step it reports, and a
:class:`StepClock` (in the worker's process for the in-process executor, in a small Ray actor
otherwise) keeps the latest few per sampling, so the rate is the latest steps over their own
seconds, however seldom the driver polls and however Ray batches the reports.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

RATE_WINDOW_STEPS = 8  # the step rate is measured over this many latest steps
# Samplings a StepClock remembers: far more than run at once on any cluster (one per group).
STEP_CLOCK_KEYS = 512


@dataclass(frozen=True)
class StepReport:
    """Sampling progress of one job: ``done`` of ``total`` steps; ``window``: (step, wall-clock
    time) of the latest steps, oldest first, stamped by the worker that ran them."""

    done: int
    total: int
    window: tuple[tuple[int, float], ...]
    # When the clock received the latest step (its own clock: the scheduler's watchdog compares it
    # with its own time, which a worker's stamp on another node need not agree with).
    received_at: float = 0.0

    @property
    def first_at(self) -> float:
        return self.window[0][1]

    @property
    def last_at(self) -> float:
        return self.window[-1][1]

    @property
    def rate(self) -> float | None:
        """Steps per second over the window (the latest RATE_WINDOW_STEPS steps: a first step that
        compiled, or a slower stretch long past, does not weigh on it); None before two steps."""
        (k0, t0), (k1, t1) = self.window[0], self.window[-1]
        if k1 <= k0 or t1 <= t0:
            return None
        return (k1 - k0) / (t1 - t0)


class StepClock:
    """Receives ``report(key, done, total, at)`` from rank 0 of each group as sampling steps
    finish (``key``: the sampling's own, see ``SampleCall.progress_key``; ``at``: when, stamped by
    the worker, so reports delivered in a burst keep their spacing; None: on arrival) and keeps the
    latest :class:`StepReport` per key, for the newest STEP_CLOCK_KEYS keys (a farm's clock lives
    as long as the farm). A report of step 1 (or of fewer steps than before) restarts a key's
    window."""

    def __init__(self) -> None:
        self._state: OrderedDict[str, StepReport] = OrderedDict()

    def report(self, key: str, done: int, total: int, at: float | None = None) -> None:
        stamp = time.time() if at is None else at
        prev = self._state.get(key)
        kept = () if prev is None or done <= 1 or done < prev.done else prev.window
        window = (*kept, (done, stamp))[-(RATE_WINDOW_STEPS + 1):]
        self._state[key] = StepReport(done=done, total=total, window=window, received_at=time.time())
        self._state.move_to_end(key)
        while len(self._state) > STEP_CLOCK_KEYS:
            self._state.popitem(last=False)

    def snapshot(self) -> dict[str, StepReport]:
        return dict(self._state)
