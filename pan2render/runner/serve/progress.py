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

Sampling steps arrive as ``protocol.steps.StepReport``s, measured where the steps happen.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from rich.cells import cell_len, set_cell_size

from pan2render.jobs.outdir import open_file
from pan2render.runner.protocol.steps import StepReport
from pan2render.runner.views.format import duration

RUN_LOG_NAME = "run.log"


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
        # A block redrawn in place below the lines (RunProgress on a terminal): every line clears
        # it first and redraws it after, so no line lands inside it and none of it is left behind.
        # One writer at a time: lines come from the scheduler's thread and the report's.
        self.region: Region | None = None
        self.lock = threading.RLock()

    @property
    def is_terminal(self) -> bool:
        try:
            return self.stream is not None and self.stream.isatty()
        except (OSError, ValueError):
            return False

    def line(self, text: str) -> None:
        with self.lock:
            if self.region is not None:
                self.region.clear()
            self.write_stream(text + "\n")
            if self.region is not None:
                self.region.redraw()
            self._write_file(text)

    def file_line(self, text: str) -> None:
        """A line for DIR/run.log alone (what is worth keeping but not worth the terminal)."""
        with self.lock:
            self._write_file(text)

    def _write_file(self, text: str) -> None:
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

    def terminal_width(self) -> int:
        """Columns of the terminal the stream is (80 when it cannot tell)."""
        try:
            return os.get_terminal_size(self.stream.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, OSError, ValueError):
            return 80

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Region(Protocol):
    """What a RunLog asks of the block it keeps below its lines."""

    def clear(self) -> None: ...
    def redraw(self) -> None: ...


def fit(text: str, width: int) -> str:
    """``text`` cut to fit a terminal line of ``width`` columns (wide characters count two), with
    one column to spare: a line that reaches the last column wraps on some terminals, and a wrapped
    row is one the in-place redraw does not know of."""
    if cell_len(text) < width:
        return text
    return set_cell_size(text, max(width - 2, 0)) + "…"


class _GuardedStream:
    """``sys.stdout`` / ``sys.stderr`` while a block is drawn: what other code prints there (Ray
    forwards its workers' output to the driver's streams) clears the block first, and the block is
    drawn again below it."""

    def __init__(self, stream: TextIO, log: RunLog):
        self._stream = stream
        self._log = log

    def write(self, text: str) -> int:
        with self._log.lock:
            region = self._log.region
            if region is not None:
                region.clear()
            n = self._stream.write(text)
            self._stream.flush()
            if region is not None and text.endswith("\n"):
                region.redraw()
            return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


# ---------------------------------------------------------------------------------------- progress
@dataclass
class RunningJob:
    """A job between its start and its end, as the progress shows it (read it, never change it)."""

    job_id: str
    group: str
    stage: str
    stage_since: float  # RunProgress.clock's time the stage began
    steps: StepReport | None = None  # while sampling: its latest steps
    preview: tuple[int, int] | None = None  # (step, steps) of its newest preview written this attempt


# The batch's ETA is planned again at each job's start, stage and end (what changes it in the
# ledger), else at most this often (a sampling's recorded step; a terminal redraws every 0.25 s).
ETA_EVERY_S = 1.0


@dataclass
class RunProgress:
    """The driver's progress interface. ``live``: redraw a block on a terminal; else plain lines."""

    log: RunLog
    live: bool = False
    # The batch's ETA (views/eta.py: from its ledger, as `status` and the farm's monitor say it);
    # None: this run's throughput so far.
    eta: Callable[[], float | None] | None = None
    summary_every_s: float = 60.0
    redraw_every_s: float = 0.25
    clock: Callable[[], float] = time.monotonic
    total: int = 0
    done: int = 0
    failed: int = 0
    _running: dict[str, RunningJob] = field(default_factory=dict)
    _started: float = 0.0
    _ended_this_run: int = 0
    _last_summary: float = 0.0
    _last_draw: float = -1e9
    _drawn_lines: int = 0
    _guarded: list[tuple[str, TextIO]] = field(default_factory=list)  # (sys attribute, stream it replaced)
    _eta: float | None = None
    _eta_at: float = -1e9

    def __post_init__(self) -> None:
        if self.summary_every_s <= 0:
            raise ValueError(f"summary_every_s={self.summary_every_s} must be > 0")

    # ------------------------------------------------------------------ the interface
    def begin(self, *, total: int, done: int, failed: int) -> None:
        self.total, self.done, self.failed = total, done, failed
        self._ended_this_run = 0  # (jobs failed before the loop, unrunnable, took no time)
        self._started = self._last_summary = self.clock()
        if self.live and self.log.region is None:
            self.log.region = self
            for name in ("stdout", "stderr"):
                stream = getattr(sys, name)
                if not isinstance(stream, _GuardedStream):
                    self._guarded.append((name, stream))
                    setattr(sys, name, _GuardedStream(stream, self.log))

    def say(self, text: str) -> None:
        self.log.line(text)  # (on a terminal the log clears the block first and redraws it after)

    def job_started(self, job_id: str, *, group: str, attempt: int) -> None:
        self._eta_at = -1e9
        self._running[job_id] = RunningJob(job_id=job_id, group=group, stage="starting", stage_since=self.clock())
        self.say(f"start  {job_id}  on {group}" + (f", attempt {attempt}" if attempt > 1 else ""))

    def stage(self, job_id: str, stage: str) -> None:
        r = self._running.get(job_id)
        if r is None or r.stage == stage:
            return
        r.stage, r.stage_since, r.steps = stage, self.clock(), None
        self._eta_at = -1e9
        self.say(f"stage  {job_id}  {stage}")

    def steps(self, reports: dict[str, StepReport]) -> None:
        for job_id, rep in reports.items():
            r = self._running.get(job_id)
            if r is not None and r.stage.startswith("sampling"):  # ("sampling segment 2/3" too)
                r.steps = rep

    def preview(self, job_id: str, *, step: int, total: int) -> None:
        """The job's newest preview (``DIR/<job>/preview.webp``) now shows the x0 of step ``step``."""
        r = self._running.get(job_id)
        if r is not None:
            r.preview = (step, total)

    def job_ended(self, job_id: str, outcome: str, detail: str = "") -> None:
        """``outcome``: done, retry, FAILED, requeued (not charged: the environment failed) or
        interrupted."""
        self._running.pop(job_id, None)
        self._eta_at = -1e9
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
        with self.log.lock:
            self._clear()
            if self.log.region is self:
                self.log.region = None
            for name, stream in reversed(self._guarded):
                setattr(sys, name, stream)
            self._guarded.clear()

    # Region: what the log asks of the block
    def clear(self) -> None:
        self._clear()

    def redraw(self) -> None:
        self._draw(force=True)

    # ------------------------------------------------------------------ what is shown
    def running(self) -> list[RunningJob]:
        """The jobs running now, each at its stage (the web monitor's rows)."""
        return list(self._running.values())

    def stage_seconds(self, r: RunningJob) -> float:
        return self.clock() - r.stage_since

    def eta_seconds(self) -> float | None:
        """The batch's ETA (``eta``), else the jobs left over this run's throughput so far (None
        until a job has ended this run)."""
        left = self.total - self.done - self.failed
        if left <= 0:
            return 0.0
        if self.eta is not None:
            now = self.clock()
            if now - self._eta_at >= ETA_EVERY_S:
                self._eta, self._eta_at = self.eta(), now
            return self._eta
        elapsed = self.clock() - self._started
        if not self._ended_this_run or elapsed <= 0:
            return None
        return left * elapsed / self._ended_this_run

    def overall(self) -> str:
        eta = self.eta_seconds()
        left = self.total - self.done - self.failed - len(self._running)
        return (f"jobs {self.done + self.failed}/{self.total}: {self.done} done, {self.failed} failed, "
                f"{len(self._running)} running, {left} waiting; elapsed {duration(self.clock() - self._started)}, "
                f"ETA {'?' if eta is None else duration(eta)}")

    def job_text(self, r: RunningJob) -> str:
        if r.stage.startswith("sampling") and r.steps is not None:
            rate = r.steps.rate
            return (f"{r.stage} {r.steps.done}/{r.steps.total}"
                    + ("" if rate is None else f" {rate:.2f} step/s"))
        return f"{r.stage} {duration(self.stage_seconds(r))}"

    def _by_group(self, *, stage_first: bool = False) -> list[tuple[str, str]]:
        """(group, what its jobs are doing), one entry per running group; ``stage_first``: each
        job's stage and steps before its id (a row cut to the terminal keeps what moves)."""
        by_group: dict[str, list[RunningJob]] = {}
        for r in self._running.values():
            by_group.setdefault(r.group, []).append(r)
        def shown(r: RunningJob) -> str:
            return f"{self.job_text(r)}  {r.job_id}" if stage_first else f"{r.job_id}: {self.job_text(r)}"
        return [(g, " | ".join(shown(r) for r in rs)) for g, rs in sorted(by_group.items())]

    def group_rows(self) -> list[str]:
        return [f"  {g:8} {text}" for g, text in self._by_group(stage_first=True)]

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
        with self.log.lock:
            self._clear()
            # One terminal row per line, whatever the width: a wrapped line would leave a stale row.
            width = self.log.terminal_width()
            lines = [fit(line, width) for line in [*self.group_rows(), self.overall()]]
            self.log.write_stream("".join(line + "\n" for line in lines))
            self._drawn_lines = len(lines)
            self._last_draw = now
