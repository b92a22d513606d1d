"""How a test shows that some work grows linearly in the jobs: by counting what runs, never by
timing it (time on a shared machine is noise; a count is exact).

The count is of Python's trace events while the work runs: every function call (a dataclass's
``__eq__`` too), every line executed, every return. Work done per pair of jobs (``x in a_list``
of dataclasses, a re-sort per insert with a key function, a loop probing names) then shows up as
n**2 events. Loops inside C over plain values (``list.count`` of ints) do not: a test of those
compares values whose ``__eq__`` is Python's (``Counted``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

# At 4x the jobs, the count may be this much above 4x: a sort's n log n, a table's widest cell.
SLACK = 1.15


def trace_events(fn: Callable[[], object], *, within: str | None = None) -> int:
    """Trace events (calls, lines, returns) of ``fn()`` on this thread; ``within``: only those of
    code in files whose path ends so (one module's own work, apart from what it calls)."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if within is None or frame.f_code.co_filename.endswith(within):
            count += 1
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(old)
    return count


def counts_at(make: Callable[[int], Callable[[], object]], n: int, *, within: str | None = None) -> tuple[int, int]:
    """The counts of ``make(n)()`` and ``make(4 * n)()``; ``make(size)`` prepares the inputs (not
    counted) and returns the work to count. A first run at ``n`` warms what is done once per
    process (imports, compiled patterns), out of both counts."""
    make(n)()
    return trace_events(make(n), within=within), trace_events(make(4 * n), within=within)


def grows_linearly(small: int, large: int, *, slack: float = SLACK) -> bool:
    """Does a count of ``small`` at n and ``large`` at 4n grow at most linearly (with ``slack``)?"""
    return large <= 4 * small * slack


def assert_linear(make: Callable[[int], Callable[[], object]], n: int, what: str, *,
                  within: str | None = None, slack: float = SLACK) -> None:
    """``slack`` 1: none (work of a constant part and a part per job is at most 4x at 4x the jobs;
    where no sort's comparisons are counted, n log n parts included, that is exact)."""
    small, large = counts_at(make, n, within=within)
    assert grows_linearly(small, large, slack=slack), (
        f"{what}: {small:,} trace events at {n} jobs, {large:,} at {4 * n} ({large / small:.2f}x for 4x the jobs): "
        f"it grows faster than the jobs")


class Counted:
    """A value whose comparisons and hashes are Python calls, counted: C loops over plain values
    (``list.count``, ``x in list``) are invisible to a trace, loops over these are not."""

    def __init__(self, value: object):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Counted) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return repr(self.value)
