"""When this process started, and run-log stamps relative to it.

The start-up lines of a run (Ray ready, a group placed, its worker up, its model loaded) say when
each happened in seconds since the command started, so the seconds before a first video can be
read off the log: ``+12.34 s``. The start is the process's own (the kernel's record of it, so the
interpreter's start and every import before the first line of ours count), or where that cannot be
read, the moment this module was first imported (the CLI imports it first of all).

Wall-clock times (``time.time()``) throughout, so that a worker's stamps taken in another process
(on another node of a cluster: that node's clock) can be set on the same line.
"""

from __future__ import annotations

import os
import time

_IMPORTED_AT = time.time()
_started_at: float | None = None


def process_started_at() -> float:
    """``time.time()`` at which this process started (10 ms resolution), from ``/proc/self/stat``;
    the import time of this module where ``/proc`` is not there."""
    global _started_at
    if _started_at is None:
        _started_at = _from_proc() or _IMPORTED_AT
    return _started_at


def _from_proc() -> float | None:
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # Field 22 (starttime, clock ticks after boot); the name in field 2 may hold spaces
            # and parentheses, so count from the last ")".
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    if not 0 <= age < 10 * 365 * 86400:
        return None
    return time.time() - age


def since_start(at: float | None = None) -> float:
    """Seconds from this process's start to ``at`` (a ``time.time()``; default now)."""
    return (time.time() if at is None else at) - process_started_at()


def stamp(at: float | None = None) -> str:
    """``+12.34 s``: ``at`` (default now) in seconds since this process started."""
    return f"{since_start(at):+.2f} s"
