"""The served batches' ETAs (``views/eta.py``), planned on the farm's main thread within a share of
its time.

A batch's ETA is planned from its ledger: its jobs, its folder's history, a plan of the jobs left,
milliseconds for a batch of a few hundred jobs. ``run`` plans its one batch at each job's start,
stage and end; the farm serving a hundred batches on a thousand GPUs did the same for every batch
at every snapshot (twice a second), and planning took a quarter of the scheduler's thread, the
GPUs waiting for it (docs/performance.md, "The scheduler at scale"). Here each batch's ETA is
planned again at most every ETA_EVERY_S, the oldest first, and only while planning has taken at most
ETA_SHARE of the time: on a busy farm an ETA is older (the snapshot says the same figure a few
seconds longer), never the loop slower.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pan2render.runner.serve.progress import ETA_EVERY_S

ETA_SHARE = 0.05  # of the main thread's time, at most, spent planning ETAs
ETA_BURST_S = 0.25  # planning time saved up while the farm is quiet, at most


@dataclass
class _Eta:
    plan: Callable[[], float | None]
    seconds: float | None = None
    planned_at: float = float("-inf")
    asked: bool = False  # asked for since it was planned: due at the next refresh


class Etas:
    """The ETA of each served batch, by batch id; ``refresh`` plans the due ones again."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._etas: dict[str, _Eta] = {}
        self._credit = ETA_BURST_S  # seconds of planning allowed now (below 0: a first plan overdrew it)
        self._credited_at = clock()

    def add(self, batch_id: str, plan: Callable[[], float | None]) -> None:
        """Serve ``batch_id``'s ETA, planned once now (the snapshot shows one from its first)."""
        self._etas[batch_id] = eta = _Eta(plan)
        self._plan(eta, self._accrue())

    def remove(self, batch_id: str) -> None:
        self._etas.pop(batch_id, None)

    def seconds(self, batch_id: str) -> float | None:
        """The batch's ETA: planned now while the credit is more than half full, else the last one
        (planned again at the next refresh)."""
        eta = self._etas.get(batch_id)
        if eta is None:
            return None
        now = self._accrue()
        if self._credit >= ETA_BURST_S / 2:
            self._plan(eta, now)
        else:
            eta.asked = True
        return eta.seconds

    def refresh(self) -> None:
        """Plan the ETAs asked for or older than ETA_EVERY_S again, the oldest first, while the credit lasts."""
        now = self._accrue()
        for eta in sorted(self._etas.values(), key=lambda e: e.planned_at):
            if self._credit <= 0:
                break
            if eta.asked or now - eta.planned_at >= ETA_EVERY_S:
                self._plan(eta, now)

    def _accrue(self) -> float:
        """The credit grows by ETA_SHARE of the time passed, up to ETA_BURST_S; returns now."""
        now = self._clock()
        self._credit = min(ETA_BURST_S, self._credit + ETA_SHARE * (now - self._credited_at))
        self._credited_at = now
        return now

    def _plan(self, eta: _Eta, now: float) -> None:
        start = self._clock()
        eta.seconds, eta.planned_at, eta.asked = eta.plan(), now, False
        self._credit -= self._clock() - start
