"""Named, timed steps of a long operation (loading a model), reported in the order they ran.

Model code marks its steps with :func:`phase` and knows nothing of who listens: outside a
:func:`recording` block a phase costs a clock read and nothing is kept (no device sync either), so a
library user pays nothing. The runner's worker wraps a model load in ``recording()`` and sends the
phases to the driver, which writes them into the run log. Torch-free and shared by ``models`` and
``runner``, like ``sampling.py``.

Phases are flat: one opened while another is open on the same thread counts as part of the outer
one and is not listed, so the listed phases never overlap and their sum never exceeds the time the
recording covered. Two in a row with the same name are listed as one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Phase:
    """One step and the seconds it took (wall clock, the device synchronized at its end where the
    step queued device work)."""

    name: str
    seconds: float


@dataclass
class PhaseRecord:
    """The phases recorded so far, in the order they ended."""

    phases: list[Phase] = field(default_factory=list)
    _open: int = 0  # phases open now (only the outermost is recorded)

    def add(self, p: Phase) -> None:
        """Append ``p``; right after a phase of the same name it extends that one (one step timed in
        two places, e.g. imports by the caller and by the callee, is listed once)."""
        if self.phases and self.phases[-1].name == p.name:
            p = Phase(p.name, self.phases[-1].seconds + p.seconds)
            self.phases[-1] = p
        else:
            self.phases.append(p)

    def total(self) -> float:
        return sum(p.seconds for p in self.phases)


_local = threading.local()  # .record: the PhaseRecord of this thread's innermost recording()


@contextmanager
def recording() -> Iterator[PhaseRecord]:
    """Collect the phases that run on this thread inside the block (a nested ``recording`` keeps its
    own and hides them from the outer one)."""
    outer = getattr(_local, "record", None)
    _local.record = record = PhaseRecord()
    try:
        yield record
    finally:
        _local.record = outer


@contextmanager
def phase(name: str, *, sync: Callable[[], None] | None = None) -> Iterator[None]:
    """Time the block as the phase ``name`` when a :func:`recording` is active on this thread.
    ``sync`` (e.g. ``torch.cuda.synchronize``) is called at the block's end, only while recording,
    so that work the block queued on a device counts in it rather than in whatever waits next."""
    record: PhaseRecord | None = getattr(_local, "record", None)
    if record is None:
        yield
        return
    record._open += 1
    t0 = time.perf_counter()
    try:
        yield
        if sync is not None:
            sync()
    finally:
        record._open -= 1
        if record._open == 0:
            record.add(Phase(name, time.perf_counter() - t0))


def describe(phases: list[Phase] | tuple[Phase, ...], *, total: float | None = None) -> str:
    """``"imports 2.1 s, DiT 6.3 s, ..."``, in order; with ``total``, what no phase covered is added
    as ``other`` when it is at least 0.05 s."""
    parts = [f"{p.name} {p.seconds:.1f} s" for p in phases]
    if total is not None:
        rest = total - sum(p.seconds for p in phases)
        if rest >= 0.05:
            parts.append(f"other {rest:.1f} s")
    return ", ".join(parts)
