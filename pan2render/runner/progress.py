"""What a run tells the person watching it, and ``DIR/run.log``.

The driver calls a small interface (:class:`RunProgress`): a job started on a group, a job's stage
changed, the latest sampling steps, a job ended; plus ``tick`` once per scheduling pass. What it
shows depends on where stderr goes:

- a terminal: a block redrawn in place, one row per running group (its job, the job's stage, for
  sampling ``k/N`` and the measured step rate) and an overall row (done / failed / running / left,
  elapsed, ETA); job events print above the block;
- anything else (``nohup``, CI, ``ray job submit``): one plain line per job event and a summary
  line every ``summary_every_s`` (default a minute).

Every line printed (events and summaries, not the redrawn block) is also appended to
``DIR/run.log`` with a UTC timestamp, so an overnight run can be read back the next morning.

Step rates are measured where the steps happen: :class:`StepClock` stamps each step report as it
arrives (in the worker's process for the in-process executor, in a small Ray actor otherwise), so
the rate is (k - 1) steps over the time between step 1 and step k, however seldom the driver polls.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from pan2render.jobs.outdir import open_file

RUN_LOG_NAME = "run.log"


# ---------------------------------------------------------------------------------------- steps
@dataclass(frozen=True)
class StepReport:
    """Sampling progress of one job: ``done`` of ``total`` steps; wall-clock times (``time.time``,
    taken by the :class:`StepClock` that received them) of step 1 and of step ``done``."""

    done: int
    total: int
    first_at: float
    last_at: float

    @property
    def rate(self) -> float | None:
        """Steps per second between step 1 and the latest step; None before step 2."""
        if self.done < 2 or self.last_at <= self.first_at:
            return None
        return (self.done - 1) / (self.last_at - self.first_at)


class StepClock:
    """Receives ``report(job_id, done, total)`` from rank 0 of each group as sampling steps finish
    and keeps the latest :class:`StepReport` per job. A report of step 1 (or of fewer steps than
    before: a retried job) restarts that job's clock."""

    def __init__(self) -> None:
        self._state: dict[str, StepReport] = {}

    def report(self, job_id: str, done: int, total: int) -> None:
        now = time.time()
        prev = self._state.get(job_id)
        first = now if prev is None or done <= 1 or done < prev.done else prev.first_at
        self._state[job_id] = StepReport(done=done, total=total, first_at=first, last_at=now)

    def snapshot(self) -> dict[str, StepReport]:
        return dict(self._state)


# ---------------------------------------------------------------------------------------- log
STDERR = object()  # RunLog's default stream: sys.stderr as it is when the log is opened


class RunLog:
    """Lines for the person running the batch: written to ``stream`` and appended, timestamped, to
    ``path`` (``DIR/run.log``; None: no file). A stream that went away (the terminal of a dropped
    SSH session) is dropped quietly: the log file still gets every line."""

    def __init__(self, path: Path | None, *, stream: TextIO | None | object = STDERR):
        """``stream``: a text stream, ``STDERR`` (the process's, as it is when the log is made) or
        None (the file alone: a farm's batches)."""
        self.stream: TextIO | None = sys.stderr if stream is STDERR else stream  # type: ignore[assignment]
        self._file = None if path is None else os.fdopen(
            open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")
        self.path = path

    @property
    def is_terminal(self) -> bool:
        try:
            return self.stream is not None and self.stream.isatty()
        except (OSError, ValueError):
            return False

    def line(self, text: str) -> None:
        self.write_stream(text + "\n")
        if self._file is not None:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            for part in text.splitlines() or [""]:
                self._file.write(f"{stamp} {part}\n")
            self._file.flush()

    def write_stream(self, text: str) -> None:
        if self.stream is None:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # EIO after SIGHUP, or a closed pipe
            self.stream = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------------------------- progress
@dataclass
class _Running:
    job_id: str
    group: str
    stage: str
    stage_since: float  # monotonic
    steps: StepReport | None = None


def duration(seconds: float) -> str:
    """Seconds as people read them: 42s, 3m05s, 2h10m. Never negative: a span between stamps of
    two clocks (a clock stepped back, another host's) shows as 0s."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class RunProgress:
    """The driver's progress interface. ``live``: redraw a block on a terminal; else plain lines."""

    log: RunLog
    live: bool = False
    summary_every_s: float = 60.0
    redraw_every_s: float = 0.25
    clock: Callable[[], float] = time.monotonic
    total: int = 0
    done: int = 0
    failed: int = 0
    _running: dict[str, _Running] = field(default_factory=dict)
    _started: float = 0.0
    _ended_this_run: int = 0
    _last_summary: float = 0.0
    _last_draw: float = -1e9
    _drawn_lines: int = 0

    def __post_init__(self) -> None:
        if self.summary_every_s <= 0:
            raise ValueError(f"summary_every_s={self.summary_every_s} must be > 0")

    # ------------------------------------------------------------------ the interface
    def begin(self, *, total: int, done: int, failed: int) -> None:
        self.total, self.done, self.failed = total, done, failed
        self._ended_this_run = 0  # (jobs failed before the loop, unrunnable, took no time)
        self._started = self._last_summary = self.clock()

    def say(self, text: str) -> None:
        self._clear()
        self.log.line(text)
        self._draw(force=True)

    def job_started(self, job_id: str, *, group: str, attempt: int) -> None:
        self._running[job_id] = _Running(job_id=job_id, group=group, stage="starting", stage_since=self.clock())
        self.say(f"start  {job_id}  on {group}" + (f", attempt {attempt}" if attempt > 1 else ""))

    def stage(self, job_id: str, stage: str) -> None:
        r = self._running.get(job_id)
        if r is None or r.stage == stage:
            return
        r.stage, r.stage_since, r.steps = stage, self.clock(), None
        self.say(f"stage  {job_id}  {stage}")

    def steps(self, reports: dict[str, StepReport]) -> None:
        for job_id, rep in reports.items():
            r = self._running.get(job_id)
            if r is not None and r.stage == "sampling":
                r.steps = rep

    def job_ended(self, job_id: str, outcome: str, detail: str = "") -> None:
        """``outcome``: done, retry, FAILED, requeued (not charged: the environment failed) or
        interrupted."""
        self._running.pop(job_id, None)
        if outcome == "done":
            self.done += 1
        elif outcome == "FAILED":
            self.failed += 1
        if outcome in ("done", "FAILED"):
            self._ended_this_run += 1
        self.say(f"{outcome:6} {job_id}" + (f"  ({detail})" if detail else ""))

    def tick(self) -> None:
        now = self.clock()
        if self.live:
            self._draw(force=False)
        elif now - self._last_summary >= self.summary_every_s:
            self._last_summary = now
            self.log.line(self.summary())

    def close(self) -> None:
        self._clear()

    # ------------------------------------------------------------------ what is shown
    def eta_seconds(self) -> float | None:
        """Jobs left over this run's throughput so far; None until a job has ended this run."""
        left = self.total - self.done - self.failed
        elapsed = self.clock() - self._started
        if left <= 0:
            return 0.0
        if not self._ended_this_run or elapsed <= 0:
            return None
        return left * elapsed / self._ended_this_run

    def overall(self) -> str:
        eta = self.eta_seconds()
        left = self.total - self.done - self.failed - len(self._running)
        return (f"jobs {self.done + self.failed}/{self.total}: {self.done} done, {self.failed} failed, "
                f"{len(self._running)} running, {left} waiting; elapsed {duration(self.clock() - self._started)}, "
                f"ETA {'?' if eta is None else duration(eta)}")

    def job_text(self, r: _Running) -> str:
        if r.stage == "sampling" and r.steps is not None:
            rate = r.steps.rate
            return (f"sampling {r.steps.done}/{r.steps.total}"
                    + ("" if rate is None else f" {rate:.2f} step/s"))
        return f"{r.stage} {duration(self.clock() - r.stage_since)}"

    def _by_group(self) -> list[tuple[str, str]]:
        """(group, what its jobs are doing), one entry per running group."""
        by_group: dict[str, list[_Running]] = {}
        for r in self._running.values():
            by_group.setdefault(r.group, []).append(r)
        return [(g, " | ".join(f"{r.job_id}: {self.job_text(r)}" for r in rs)) for g, rs in sorted(by_group.items())]

    def group_rows(self) -> list[str]:
        return [f"  {g:8} {text}" for g, text in self._by_group()]

    def summary(self) -> str:
        rows = "; ".join(f"{g} {text}" for g, text in self._by_group())
        return f"[progress] {self.overall()}" + (f"; {rows}" if rows else "")

    # ------------------------------------------------------------------ terminal block
    def _clear(self) -> None:
        if self.live and self._drawn_lines:
            self.log.write_stream(f"\x1b[{self._drawn_lines}F\x1b[J")  # up N lines, clear below
            self._drawn_lines = 0

    def _draw(self, *, force: bool) -> None:
        if not self.live:
            return
        now = self.clock()
        if not force and now - self._last_draw < self.redraw_every_s:
            return
        self._clear()
        lines = [*self.group_rows(), self.overall()]
        self.log.write_stream("".join(line + "\n" for line in lines))
        self._drawn_lines = len(lines)
        self._last_draw = now
