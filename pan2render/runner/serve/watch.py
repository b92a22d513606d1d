"""What the scheduler watches of the calls in flight: each sampling's latest step, recorded in its
ledger for ``status``; the stall watchdog (a sampling that reports no step for the stall timeout
is hung: a stopped worker, a collective that never completes, which no Ray error reports); and
every call's own deadline; and a cluster that lost the GPUs its jobs need, until they come back.
The watch only finds; the scheduler tears the groups down.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from pan2render.hints import command
from pan2render.jobs.ledger import Ledger, Stage
from pan2render.runner.cluster.executor import Executor
from pan2render.runner.protocol.artifacts import SAMPLING_STEP_DOC
from pan2render.runner.protocol.failures import ClusterLostError, Failure, FailureKind, classify_exception
from pan2render.runner.protocol.steps import StepReport
from pan2render.runner.serve.attempt import JobRun

STEP_RECORD_EVERY_S = 5.0  # a running sampling's step goes to its ledger at most this often
# How often the scheduler looks at every call in flight rather than at the replies alone: the
# samplings' steps (the farm publishes its snapshot every 0.5 s; a hung sampling is minutes) and
# the calls' deadlines (a minute and more). Looking on every pass made a pass cost every job running.
STEPS_EVERY_S = 0.25
DEADLINES_EVERY_S = 1.0

Key = TypeVar("Key")


def current_steps(runs: Iterable[tuple[Key, JobRun]], reports: dict[str, StepReport]) -> dict[Key, StepReport]:
    """The latest step of each sampling among ``runs``: the report under its attempt's key (never
    one of another sampling of the same job id: an earlier attempt, another batch of a farm) that
    arrived since its SampleCall went out (not one of a sampling the attempt redid)."""
    steps = {}
    for key, run in runs:
        rep = reports.get(run.progress_key) if run.sampling else None
        if rep is not None and rep.received_at >= run.sample_started_at:
            steps[key] = rep
    return steps


def started_sampling(run: JobRun) -> None:
    """``run``'s SampleCall just went out: the watchdog's clock starts over for this attempt."""
    run.sample_started_at, run.last_step = time.time(), None


class Watch:
    """What the scheduler looks for among the calls in flight every few tenths of a second: calls
    past their deadline (every DEADLINES_EVERY_S) and the samplings' steps (every STEPS_EVERY_S;
    a Ray call, made only while a job samples), which it records in the ledgers and checks for
    hung samplings."""

    def __init__(self, executor: Executor, *, stall_timeout_s: float):
        self.ex = executor
        self.stall_timeout_s = stall_timeout_s
        self._recorder = StepRecorder()
        self._deadlines_at = self._steps_at = float("-inf")  # (time.monotonic)

    def look(self, running: Callable[[], list[tuple[Key, JobRun]]], *, ledger_of: Callable[[Key], Ledger]
             ) -> tuple[dict[Key, StepReport], list[tuple[Key, JobRun, Failure]]]:
        """The steps read now (none when it is not time, or nothing samples) and the runs to tear
        down, each with its failure: overdue, then hung. ``running``: the runs, asked for only when
        it is time to look at them."""
        now, steps, found = time.monotonic(), {}, []
        due_deadlines, due_steps = now >= self._deadlines_at + DEADLINES_EVERY_S, now >= self._steps_at + STEPS_EVERY_S
        if not (due_deadlines or due_steps):
            return steps, found
        runs = running()
        if due_deadlines:
            self._deadlines_at = now
            found += overdue(runs, lacks_gpus_for=self.ex.lacks_gpus_for)
        if due_steps and any(r.sampling for _, r in runs):
            self._steps_at = now
            steps = current_steps(runs, self.ex.progress())
            found += hung(runs, steps, limit_s=self.stall_timeout_s)
            self._recorder.record([(key, run, ledger_of(key)) for key, run in runs], steps)
        return steps, found


class StepRecorder:
    """Each sampling's latest step into its ledger, at most every STEP_RECORD_EVERY_S per job
    (``status``, another process, reads it there), the steps due in one ledger in one transaction:
    one each made a commit, four fsyncs, per sampling every 5 s (at 1,000 GPUs of 20-step jobs, a
    third of the ledgers' commits). A write the disk refuses costs only those steps."""

    def __init__(self) -> None:
        self._recorded: dict[object, tuple[float, int]] = {}  # key -> (monotonic, step) last written

    def record(self, runs: Iterable[tuple[Key, JobRun, Ledger]], steps: dict[Key, StepReport]) -> None:
        """``steps``: :func:`current_steps` of the runs."""
        now = time.monotonic()
        runs = list(runs)
        self._recorded = {key: at for key, at in self._recorded.items() if key in steps}  # (samplings ended)
        due: dict[int, tuple[Ledger, dict[str, str]]] = {}  # id(ledger) -> it, job id -> its step document
        for key, run, ledger in runs:
            rep = steps.get(key)
            if rep is None:
                continue
            last = self._recorded.get(key)
            if last is not None and (now - last[0] < STEP_RECORD_EVERY_S or last[1] == rep.done):
                continue
            self._recorded[key] = (now, rep.done)
            doc = {"step": rep.done, "steps": rep.total, "rate": rep.rate, "at": time.time()}
            due.setdefault(id(ledger), (ledger, {}))[1][run.job.id] = json.dumps(doc)
        for ledger, bodies in due.values():
            try:
                ledger.set_each_document(SAMPLING_STEP_DOC, bodies)
            except Exception as e:  # only a full disk is expected; the batch goes on
                if classify_exception(e) is not FailureKind.STORAGE:
                    raise


def hung(runs: Iterable[tuple[Key, JobRun]], steps: dict[Key, StepReport], *,
         limit_s: float) -> list[tuple[Key, JobRun, Failure]]:
    """The samplings among ``runs`` whose latest step (or whose start) arrived more than
    ``limit_s`` ago, each with the failure it is charged (a worker death: the group goes);
    ``limit_s`` 0: none. ``steps``: :func:`current_steps` of the runs. Each run keeps the latest
    step seen, so a snapshot that is missing (the progress actor busy) raises no false alarm."""
    if not limit_s:
        return []
    now, found = time.time(), []
    for key, run in runs:
        if not run.sampling:
            continue
        if (report := steps.get(key)) is not None:
            run.last_step = report
        last = run.last_step.received_at if run.last_step is not None else run.sample_started_at
        if now - last <= limit_s:
            continue
        where = f"last step {run.last_step.done}/{run.last_step.total}" if run.last_step else "no step yet"
        found.append((key, run, Failure(
            stage=Stage.SAMPLING, kind=FailureKind.WORKER_DEATH,
            error=f"worker group {run.group.id} is hung: its sampling reported no step for {now - last:.0f} s "
                  f"({where}), over the {limit_s:.0f} s stall timeout")))
    return found


def overdue(runs: Iterable[tuple[Key, JobRun]], *,
            lacks_gpus_for: Callable[[int], bool]) -> list[tuple[Key, JobRun, Failure]]:
    """The runs whose call is past its deadline, each with its failure: a dead group, or a lost
    cluster where it no longer has the GPUs for the group."""
    now, found = time.monotonic(), []
    for key, run in runs:
        if run.call is None or now - run.call.started <= run.call.timeout_s:
            continue
        message, limit = run.call.message, run.call.timeout_s
        kind = FailureKind.CLUSTER_LOST if lacks_gpus_for(run.group.size) else FailureKind.WORKER_DEATH
        found.append((key, run, Failure(
            stage=message.stage or Stage.CONDITIONING, kind=kind,
            error=f"worker group {run.group.id} died or stopped answering: no reply to "
                  f"{type(message).__name__} within its {limit:.0f} s deadline")))
    return found


class ClusterWait:
    """The cluster lost GPUs a job needed (a node died, its raylet or the GCS restarted): the
    scheduler starts nothing until enough are back, for at most ``wait_s``."""

    def __init__(self, executor: Executor, *, wait_s: float):
        self.ex = executor
        self.wait_s = wait_s
        self._since: float | None = None  # monotonic time the GPUs were lost

    @property
    def lost(self) -> bool:
        return self._since is not None

    def lose(self) -> None:
        if self._since is None:
            self._since = time.monotonic()

    def back(self, *, need: int, running: bool, queued: int, folders: list[Path]) -> int | None:
        """The cluster's GPU count once ``need`` are back after a loss (the loss is over), else
        None. Raises ClusterLostError when they have been gone for ``wait_s`` and no job runs
        (running jobs finish first)."""
        if self._since is None:
            return None
        try:
            available = self.ex.total_gpus()
        except Exception:  # the cluster cannot even be asked
            available = 0
        if available >= need:
            self._since = None
            return available
        if time.monotonic() - self._since > self.wait_s and not running:
            raise ClusterLostError(
                f"{self.ex.cluster} lost its GPUs ({available} left, {need} needed) and they did not come back "
                f"within {self.wait_s:.0f} s; the {queued} unfinished job(s) are pending, none was charged an "
                f"attempt. Bring the node(s) back (`ray status` on the head shows them), then "
                f"`{command('resume', *folders)}`")
        return None
