"""What the ledgers say, in Prometheus's terms: the ``pan2render_*`` families both the farm
(``farm/metrics.py``, over every folder its queue holds) and `run --metrics-port` (over its own
batch) expose, built from the records, never from counters kept in memory, so that they survive a
restart and agree with `status` and `queue`:

- from the jobs' rows as they are now (re-read whole at each refresh): jobs by state, the
  histograms of stage seconds and of seconds per sampling step (a stage redone replaces its seconds);
- from the ledger's events, which are only ever appended (each read once): videos done and failed,
  retries, preemptions, step-checkpoint resumes, group loads, queue waits, seconds of video made.

A folder's tally (:class:`FolderTally`) counts only the jobs it is given (a folder may hold jobs of
other runs). No prompt text is read: a job is its id, state, size, model and timings.
"""

from __future__ import annotations

import bisect
import getpass
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from pan2render.jobs.ledger import EventKind, JobState, JobTally, Ledger
from pan2render.runner.protocol.failures import FailureKind
from pan2render.runner.protocol.messages import LoadCall
from pan2render.runner.serve.attempt import PREEMPTED_AT
from pan2render.runner.serve.jobflow import failure_class, load_seconds
from pan2render.runner.serve.progress import RunProgress

PREFIX = "pan2render_"
REFRESH_S = 5.0  # ledgers are read at most this often, however often a scraper asks
REALTIME_WINDOW_S = 600.0  # the realtime factor's window
# A failure whose reason names no class (a job that needs more GPUs than a node has).
UNKNOWN_CLASS = FailureKind.UNKNOWN.value
# Buckets, in seconds. Stages: 0.1 s (the tiny model on a CPU) to an hour (a long 720p sampling).
STAGE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
# A 720p step takes ~1.6 s on an H200 (docs/performance.md, "DiT fused kernels"); the tiny model's, milliseconds.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
LOAD_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
WAIT_BUCKETS = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 86400.0)
GROUP_STATES = ("loading", "busy", "idle", "held_out")


@dataclass(frozen=True)
class Family:
    """One family: its name (after ``pan2render_``), type, HELP line and labels."""

    name: str
    kind: str  # "gauge", "counter" or "histogram"
    help: str
    labels: tuple[str, ...] = ()


JOBS = Family("jobs", "gauge", "Jobs by their state in their ledger (pending, running, done, failed, cancelled).",
              ("state",))
QUEUE_DEPTH = Family("queue_depth", "gauge", "Jobs waiting to start (pending in their ledger), by their batch's "
                     "state (active: queued; paused: held back; cancelling) and owner.", ("batch_state", "owner"))
VIDEOS_DONE = Family("videos_done", "counter", "Videos finished: each move of a job to done in its ledger.")
VIDEOS_FAILED = Family("videos_failed", "counter", "Jobs failed for good: each move of a job to failed in its "
                       "ledger, by failure class.", ("failure_class",))
RETRIES = Family("retries", "counter", "Attempts retried after a failure (charged to the job), by failure class.",
                 ("failure_class",))
PREEMPTIONS = Family("preemptions", "counter", "Samplings stopped at a step boundary for a higher-priority batch, "
                     "their job back in the queue.")
RESUMES = Family("step_checkpoint_resumes", "counter", "Samplings continued from their job's step checkpoint.")
VIDEO_SECONDS = Family("video_seconds", "counter", "Seconds of video finished (frames / fps of each job done).")
REALTIME = Family("realtime_factor", "gauge", "Seconds of video finished per second of wall time over the last "
                  f"{REALTIME_WINDOW_S / 60:.0f} minutes (rate(pan2render_video_seconds_total[W]): any window).")
STAGE_SECONDS = Family("stage_seconds", "histogram", "Seconds of each job stage recorded done, by stage "
                       "(conditioning: 0 when its prompts were cached).", ("stage",))
QUEUE_WAIT = Family("queue_wait_seconds", "histogram", "Seconds a job waited before each start, from its last "
                    "move to pending (a pause, and time the farm was down, included).")
STEP_SECONDS = Family("sampling_step_seconds", "histogram", "Seconds per sampling step: each sampling done, its "
                      "seconds over its steps (one continued from a step checkpoint is left out), by model and size "
                      "(WxHxframes).", ("model", "size"))
GROUP_LOADS = Family("group_load_seconds", "histogram", "Seconds each GPU group's model load took (weights and "
                     "warm-up); its count is the loads.")
GROUPS = Family("gpu_groups", "gauge", "GPU groups by state: loading (a model), busy, idle, held_out (out of "
                "service after device faults).", ("state",))
GPUS = Family("gpus", "gauge", "GPUs of the cluster.")
START_TIME = Family("start_time_seconds", "gauge", "When this farm (or run) process started, Unix seconds.")


# ---------------------------------------------------------------------------------------- building
def gauge(family: Family, values: dict[tuple[str, ...], float] | float) -> GaugeMetricFamily:
    metric = GaugeMetricFamily(PREFIX + family.name, family.help, labels=family.labels)
    for labels, value in (values.items() if isinstance(values, dict) else [((), values)]):
        metric.add_metric(list(labels), value)
    return metric


def counter(family: Family, values: dict[tuple[str, ...], float] | float) -> CounterMetricFamily:
    metric = CounterMetricFamily(PREFIX + family.name, family.help, labels=family.labels)
    for labels, value in (values.items() if isinstance(values, dict) else [((), values)]):
        metric.add_metric(list(labels), value)
    return metric


@dataclass
class Buckets:
    """Observations counted into a histogram's buckets (``le``: at most the bound)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def add(self, other: Buckets) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += n
            out.append((bound, running))
        return out


def histogram(family: Family, values: dict[tuple[str, ...], Buckets] | Buckets) -> HistogramMetricFamily:
    metric = HistogramMetricFamily(PREFIX + family.name, family.help, labels=family.labels)
    for labels, b in (values.items() if isinstance(values, dict) else [((), values)]):
        metric.add_metric(list(labels), b.cumulative(), sum_value=b.total)
    return metric


# ---------------------------------------------------------------------------------------- a folder
@dataclass
class LedgerCounts:
    """What one folder's ledger says (or several's, summed with :meth:`add`)."""

    jobs: Counter[str] = field(default_factory=Counter)  # state -> jobs
    done: int = 0
    failed: Counter[str] = field(default_factory=Counter)  # failure class -> failures
    retries: Counter[str] = field(default_factory=Counter)
    preemptions: int = 0
    resumes: int = 0
    video_seconds: float = 0.0
    recent: list[tuple[float, float]] = field(default_factory=list)  # (finished at, video seconds), in the window
    stages: dict[str, Buckets] = field(default_factory=dict)
    steps: dict[tuple[str, str], Buckets] = field(default_factory=dict)  # (model, size)
    loads: Buckets = field(default_factory=lambda: Buckets(LOAD_BUCKETS))
    waits: Buckets = field(default_factory=lambda: Buckets(WAIT_BUCKETS))

    def add(self, other: LedgerCounts) -> None:
        self.jobs += other.jobs
        self.done += other.done
        self.failed += other.failed
        self.retries += other.retries
        self.preemptions += other.preemptions
        self.resumes += other.resumes
        self.video_seconds += other.video_seconds
        self.recent += other.recent
        for stage, b in other.stages.items():
            self.stages.setdefault(stage, Buckets(STAGE_BUCKETS)).add(b)
        for key, b in other.steps.items():
            self.steps.setdefault(key, Buckets(STEP_BUCKETS)).add(b)
        self.loads.add(other.loads)
        self.waits.add(other.waits)


class FolderTally:
    """One output folder's ledger, read for the jobs ``job_ids``: the jobs' rows re-read whole at
    each :meth:`refresh`, the events after the last one read. A folder that cannot be read (gone,
    damaged) keeps the counts of its last good read."""

    def __init__(self, out_dir: Path, job_ids: Iterable[str]):
        self.out_dir = Path(out_dir)
        self.job_ids = frozenset(job_ids)
        self.states: dict[str, JobState] = {}
        self._seq = 0
        self._events = LedgerCounts()  # what the events said so far
        self._rows = LedgerCounts()  # what the rows said at the last refresh
        self._pending_since: dict[str, float] = {}
        self._resumed: set[str] = set()
        self._recent: deque[tuple[float, float]] = deque()

    def refresh(self) -> None:
        try:
            ledger = Ledger.open_readonly(self.out_dir)
            try:
                events = ledger.events_after(self._seq)  # first: every job they name is in the rows read next
                jobs = {t.id: t for t in ledger.tallies() if t.id in self.job_ids}
            finally:
                ledger.close()
        except Exception:  # gone or damaged since: its last counts stand
            return
        for seq, e in events:
            self._seq = seq
            if e.job_id in self.job_ids:
                self._count_event(e.kind, e.at, e.job_id, e.detail, e.transition, jobs.get(e.job_id))
        self.states = {jid: t.state for jid, t in jobs.items()}
        self._rows = self._count_rows(jobs.values())

    def counts(self, now: float) -> LedgerCounts:
        while self._recent and self._recent[0][0] < now - REALTIME_WINDOW_S:
            self._recent.popleft()
        out = LedgerCounts(recent=list(self._recent))
        out.add(self._events)
        out.add(self._rows)
        return out

    def _count_event(self, kind: EventKind, at: float, job_id: str, detail: str,
                     transition: tuple[JobState, JobState] | None, job: JobTally | None) -> None:
        c = self._events
        if kind is EventKind.ADDED:
            self._pending_since[job_id] = at
        elif kind is EventKind.CHECKPOINT_RESUMED:
            c.resumes += 1
            self._resumed.add(job_id)
        elif kind is EventKind.GROUP_LOAD and (seconds := load_seconds(detail)) is not None:
            c.loads.observe(seconds)
        elif kind is EventKind.TRANSITION and transition is not None:
            old, new = transition
            if new is JobState.PENDING:
                self._pending_since[job_id] = at
                if old is JobState.RUNNING and (cls := failure_class(detail)) is not None:
                    c.retries[cls] += 1
                elif old is JobState.RUNNING and detail.startswith(PREEMPTED_AT):
                    c.preemptions += 1
            elif (old, new) == (JobState.PENDING, JobState.RUNNING) and job_id in self._pending_since:
                c.waits.observe(max(0.0, at - self._pending_since.pop(job_id)))
            elif new is JobState.DONE:
                c.done += 1
                seconds = job.frames / job.fps if job is not None and job.fps > 0 else 0.0
                c.video_seconds += seconds
                self._recent.append((at, seconds))
            elif new is JobState.FAILED:
                c.failed[failure_class(detail) or UNKNOWN_CLASS] += 1

    def _count_rows(self, jobs: Iterable[JobTally]) -> LedgerCounts:
        c = LedgerCounts()
        for t in jobs:
            c.jobs[t.state.value] += 1
            for stage, seconds in t.stage_seconds.items():
                c.stages.setdefault(stage, Buckets(STAGE_BUCKETS)).observe(seconds)
            sampled = t.stage_seconds.get("sampling")
            if sampled is not None and t.steps > 0 and t.id not in self._resumed:
                key = (Path(t.model).name or t.model, f"{t.width}x{t.height}x{t.frames}")
                c.steps.setdefault(key, Buckets(STEP_BUCKETS)).observe(sampled / t.steps)
        return c


def ledger_families(c: LedgerCounts, *, now: float) -> list[Metric]:
    """The families the ledgers give, from their summed counts (every job state and failure class,
    zero or not, so a dashboard's series exist from the start)."""
    recent = sum(seconds for at, seconds in c.recent if at >= now - REALTIME_WINDOW_S)
    return [
        gauge(JOBS, {(s.value,): c.jobs.get(s.value, 0) for s in JobState}),
        counter(VIDEOS_DONE, c.done),
        counter(VIDEOS_FAILED, _by_class(c.failed)),
        counter(RETRIES, _by_class(c.retries)),
        counter(PREEMPTIONS, c.preemptions),
        counter(RESUMES, c.resumes),
        counter(VIDEO_SECONDS, c.video_seconds),
        gauge(REALTIME, recent / REALTIME_WINDOW_S),
        histogram(STAGE_SECONDS, {(stage,): b for stage, b in sorted(c.stages.items())}),
        histogram(STEP_SECONDS, dict(sorted(c.steps.items()))),
        histogram(GROUP_LOADS, c.loads),
        histogram(QUEUE_WAIT, c.waits),
    ]


def _by_class(counts: Counter[str]) -> dict[tuple[str, ...], float]:
    """Every failure class, zero or not: a series that starts at 1 hides its first increase from rate()."""
    return {(cls,): counts.get(cls, 0) for cls in sorted({k.value for k in FailureKind} | set(counts))}


def group_states(groups: Iterable[tuple[str, bool]]) -> dict[tuple[str, ...], float]:
    """GPU groups by state, every state present: ``groups`` gives each group's pool state
    ("busy", "idle", "out of service") and whether a job on it loads a model."""
    counts = Counter({s: 0 for s in GROUP_STATES})
    for state, loading in groups:
        counts["held_out" if state == "out of service" else "loading" if loading else state] += 1
    return {(s,): n for s, n in counts.items()}


LOADING = LoadCall.shown  # the stage progress shows while a group loads a model


# ---------------------------------------------------------------------------------------- `run`
class RunCollector:
    """`run --metrics-port`: the families for the batch this process renders, from its ledger (read
    from the scrape's thread, beside the scheduler that writes it) and its progress."""

    def __init__(self, out_dir: Path, job_ids: Iterable[str], *, started_at: float):
        self.folder = FolderTally(out_dir, job_ids)
        self.started_at = started_at
        self.owner = _user()
        self.progress: RunProgress | None = None  # set once the run's progress exists
        self.gpus = 0
        self._lock = threading.Lock()
        self._read_at = float("-inf")

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        with self._lock:
            if time.monotonic() - self._read_at >= REFRESH_S:
                self.folder.refresh()
                self._read_at = time.monotonic()
            counts = self.folder.counts(now)
            pending = sum(s is JobState.PENDING for s in self.folder.states.values())
        yield from ledger_families(counts, now=now)
        yield gauge(QUEUE_DEPTH, {("active", self.owner): pending})
        running = self.progress.running() if self.progress is not None else []  # (a copy, made at once)
        groups: dict[str, bool] = {}
        for r in running:
            groups[r.group] = groups.get(r.group, False) or r.stage == LOADING
        yield gauge(GROUPS, group_states(("busy", loading) for loading in groups.values()))
        yield gauge(GPUS, self.gpus)
        yield gauge(START_TIME, self.started_at)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a uid without a name (a container's)
        return str(os.getuid())


def serve_run_metrics(port: int, collector: RunCollector) -> Callable[[], None]:
    """Serve ``collector`` on 127.0.0.1:``port`` from a thread of prometheus_client's own; returns
    the call that stops it. Raises OSError when the port is taken."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop
