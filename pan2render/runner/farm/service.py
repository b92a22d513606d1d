"""The farm process: the one scheduler kept up, serving every batch submitted to it.

One process holds the Ray driver, the GPU groups (kept loaded between batches, released after an
idle time or when another model or group size needs the GPUs), the durable queue and the HTTP API.
Its main thread runs the scheduler; the API (``api.py``) runs on a thread of its own and hands every
request that changes something to the main thread (:meth:`Farm.ask`), which is so the only writer
of the queue and of every served batch's ledger. Reads come from a snapshot the main thread
publishes after each pass.

What survives what: each batch's folder and ledger are its truth (the jobs, their stages, their
artifacts), the queue says which folders the farm serves and how. A farm killed at any moment
(SIGKILL included) restarts from the two: ``farm start`` again serves every batch not ended from its
ledger, and nothing done is redone. The GPU workers are the farm's Ray actors, so they end with it.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue as queue_mod
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pan2render.jobs.ledger import FolderLockedError, JobState, Ledger
from pan2render.runner.cluster.executor import Executor
from pan2render.runner.farm.config import FarmConfig
from pan2render.runner.farm.queue import BatchEvent, BatchState, FarmQueue, QueuedBatch
from pan2render.runner.serve import errors
from pan2render.runner.serve.errors import UnrecordedWork
from pan2render.runner.serve.jobflow import BatchFlow
from pan2render.runner.serve.pool import GroupPool
from pan2render.runner.serve.progress import RunningJob, RunProgress
from pan2render.runner.serve.scheduler import Scheduler, ServedBatch
from pan2render.runner.serve.session import BatchRequest, BatchSession, model_folder_problems
from pan2render.runner.serve.steps import PAN2_FLOW
from pan2render.runner.views.report import ReportUpdater

PUBLISH_EVERY_S = 0.5  # the snapshot's age at most (each publish reads every served batch's ledger)
TOKEN_NAME = "token"
INFO_NAME = "farm.json"
LOG_NAME = "farm.log"
EVENTS_SHOWN = 50  # the queue's latest events in the snapshot (the web monitor's list)


class FarmRequestError(RuntimeError):
    """A client's request the farm refuses (the reason is sent back as is, with the HTTP status:
    409 a conflict with the farm's state, 422 a batch that cannot be rendered as things stand)."""

    def __init__(self, message: str, *, status: int = 409):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class _Served:
    """A batch of the queue the farm serves. Its standing (priority, paused, preempting) is its
    queue row's, which the farm replaces with the row the queue returns after each change."""

    row: QueuedBatch
    session: BatchSession
    report: ReportUpdater
    started: float
    batch: ServedBatch = field(init=False)

    @property
    def priority(self) -> int:
        return self.row.priority

    @property
    def paused(self) -> bool:
        return self.row.state is BatchState.PAUSED

    @property
    def preempts(self) -> bool:
        return self.row.preempt


def ensure_token(root: Path) -> str:
    """The farm's token (``ROOT/token``, readable by its owner only), made on first use."""
    path = root / TOKEN_NAME
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    os.chmod(path, 0o600, follow_symlinks=False)
    return path.read_text().strip()


class Farm:
    def __init__(self, config: FarmConfig, executor: Executor, *, log: Callable[[str], None]):
        self.config = config
        self.root = Path(config.root)
        self.ex = executor
        self.log = log
        self.queue = FarmQueue(self.root)
        sched = config.scheduler_config()
        pool = GroupPool(executor, total_gpus=executor.total_gpus(), start_timeout_s=sched.group_start_timeout_s,
                         fault_limit=config.device_fault_limit)
        self.scheduler = Scheduler(executor=executor, config=sched, pool=pool)
        self.served: dict[str, _Served] = {}
        self._requests: queue_mod.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue_mod.Queue()
        self._snapshot: dict[str, Any] = {}
        self._snapshot_lock = threading.Lock()
        self._stopping = threading.Event()
        self._published = float("-inf")
        self.started_at = time.time()
        self.url = ""

    # ================================================================== requests from the API
    def ask(self, request: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``request`` on the main thread (the one writer); its result or error comes back in
        the future. Called from the API's thread."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._requests.put((request, fut))
        return fut

    def snapshot(self) -> dict[str, Any]:
        with self._snapshot_lock:
            return self._snapshot

    def stop(self) -> None:
        self._stopping.set()

    def _run_requests(self) -> None:
        while True:
            try:
                request, fut = self._requests.get_nowait()
            except queue_mod.Empty:
                return
            try:
                fut.set_result(request())
            except Exception as e:  # every refusal goes back to the client
                fut.set_exception(e)

    # ================================================================== what a client can ask
    def submit(self, request: BatchRequest, *, owner: str, priority: int, preempt: bool = False) -> dict[str, Any]:
        """Record the batch in its folder's ledger, queue it, serve it. ``preempt``: its jobs may stop
        a lower-priority batch's sampling at a step boundary to take its group (that job continues
        from its step checkpoint after)."""
        out = str(request.out_dir)
        if (other := self.queue.active_for(out)) is not None:
            raise FarmRequestError(f"{out} is already served by batch {other.id} on this farm; wait for it to end "
                                   f"or `pan2-render cancel {other.id}`, or choose another --out")
        if broken := model_folder_problems(request.batch.jobs):
            raise FarmRequestError(errors.broken_checkpoints(broken, resume=None), status=422)
        title = (f"submit {request.batch.path} {' '.join(request.overrides.flags())}".rstrip()
                 + f" (farm {self.root}, priority {priority}, owner {owner})")
        try:
            session = BatchSession.record(request, stream=None, title=title)
        except (FolderLockedError, UnrecordedWork) as e:
            raise FarmRequestError(str(e)) from e
        try:
            row = self.queue.add(out_dir=out, batch_path=request.batch.path, owner=owner, priority=priority,
                                 job_ids=session.job_ids, preempt=preempt)
        except BaseException:
            session.close()
            raise
        self.log(f"{row.id}: submitted by {owner}: {len(row.job_ids)} job(s) into {out}, priority {priority}")
        self._serve(row, session)
        return self.describe(row.id)

    def pause(self, batch_id: str, *, paused: bool) -> dict[str, Any]:
        row = self.queue.transition(batch_id, BatchEvent.PAUSE if paused else BatchEvent.UNPAUSE,
                                    reason="paused by a client" if paused else "unpaused by a client")
        if (s := self.served.get(row.id)) is not None:
            s.row = row
            s.session.log.line(f"farm: batch {row.id} {'paused: no new job of it starts' if paused else 'unpaused'}")
        return self.describe(row.id)

    def set_priority(self, batch_id: str, priority: int) -> dict[str, Any]:
        row = self.queue.set_priority(batch_id, priority)
        if (s := self.served.get(row.id)) is not None:
            s.row = row
            self.scheduler.reorder()
        return self.describe(row.id)

    def cancel(self, batch_id: str, *, job: str | None = None) -> dict[str, Any]:
        """The batch (or one of its jobs, by id, unique id prefix or name): queued jobs are cancelled
        now, a sampling in progress stops at its next step, a job past its sampling finishes."""
        row = self.queue.get(batch_id)
        s = self.served.get(row.id)
        if job is None:
            row = self.queue.transition(row.id, BatchEvent.CANCEL, reason="cancelled by a client")
            if s is None:
                return self.describe(row.id)
            s.row = row
            stopped = self.scheduler.cancel(s.batch, None, reason="the batch was cancelled")
        else:
            if s is None:
                raise FarmRequestError(f"batch {row.id} is {row.state.value}: none of its jobs runs or waits")
            from pan2render.runner.views.status import JobNotFound, find_job

            try:
                target = find_job(s.session.ledger, job)
            except JobNotFound as e:
                raise FarmRequestError(str(e)) from e
            stopped = self.scheduler.cancel(s.batch, [target.id], reason="cancelled by a client")
        s.session.log.line(f"farm: cancel of {'batch ' + row.id if job is None else 'job ' + job}: "
                           f"{len(stopped)} sampling(s) stop at their next step")
        return self.describe(row.id)

    def retry(self, batch_id: str) -> dict[str, Any]:
        """An ended batch back in the queue: its failed, cancelled and interrupted jobs run again."""
        row = self.queue.get(batch_id)
        if row.id in self.served:
            raise FarmRequestError(f"batch {row.id} is {row.state.value}: it is being served; retry it once it ends")
        if broken := self._broken_checkpoints(row):
            raise FarmRequestError(errors.broken_checkpoints(broken, resume=None), status=422)
        session = BatchSession.reopen(Path(row.out_dir), stream=None, job_ids=row.job_ids,
                                      title=f"farm: retry of batch {row.id} ({{batch}})")
        row = self.queue.transition(row.id, BatchEvent.RETRY, reason="retried by a client")
        self._serve(row, session)
        return self.describe(row.id)

    def describe(self, batch_id: str) -> dict[str, Any]:
        row = self.queue.get(batch_id)
        s = self.served.get(row.id)
        counts = s.session.counts() if s is not None else _ledger_counts(Path(row.out_dir), row.job_ids)
        running = [r.job.id for r in self.scheduler.running(s.batch)] if s is not None else []
        return {"id": row.id, "out_dir": row.out_dir, "batch": row.batch_path, "owner": row.owner,
                "priority": row.priority, "preempt": row.preempt, "state": row.state.value, "reason": row.reason,
                "submitted_at": row.submitted_at, "updated_at": row.updated_at, "counts": counts,
                "running": running, "queued": len(self.scheduler.pending(s.batch)) if s is not None else 0,
                "eta_s": s.batch.progress.eta_seconds() if s is not None else None,
                "exit_code": exit_code(row.state, counts)}

    # ================================================================== serving batches
    def resume_unfinished(self) -> None:
        """At start: every batch of the queue that has not ended is served again from its ledger."""
        for row in self.queue.batches(include_ended=False):
            if broken := self._broken_checkpoints(row):
                why = errors.broken_checkpoints(broken, resume=None)
                self.queue.transition(row.id, BatchEvent.STOP, reason=why)
                self.log(f"{row.id}: not continued: {why}")
                continue
            try:
                session = BatchSession.reopen(Path(row.out_dir), stream=None, job_ids=row.job_ids,
                                              title=f"farm: continuing batch {row.id} ({{batch}}) after the "
                                                    f"farm's restart")
            except Exception as e:  # one unusable folder must not keep the farm down
                self.queue.transition(row.id, BatchEvent.STOP, reason=f"could not be reopened: {type(e).__name__}: {e}")
                self.log(f"{row.id}: not continued: {type(e).__name__}: {e}")
                continue
            self.log(f"{row.id}: continued from its ledger ({row.out_dir})")
            self._serve(row, session, revive_cancelled=False)

    @staticmethod
    def _broken_checkpoints(row: QueuedBatch) -> dict[str, list[str]]:
        """The checkpoint folders the batch's unfinished jobs name that cannot be loaded (checked
        before a batch is served again: each of its jobs would fail its load the same way)."""
        try:
            ledger = Ledger.open_readonly(Path(row.out_dir))
        except Exception:  # an unreadable folder: reopening it says what is wrong
            return {}
        try:
            specs = [j.spec for j in ledger.jobs(row.job_ids) if j.state is not JobState.DONE]
        finally:
            ledger.close()
        return model_folder_problems(specs)

    def _serve(self, row: QueuedBatch, session: BatchSession, *, revive_cancelled: bool = True) -> None:
        try:
            session.prepare(retries=self.config.serving.retries, revive_cancelled=revive_cancelled)
            session.note_run(command="farm", gpus=self.scheduler.pool.total_gpus)
        except BaseException:
            session.close()
            raise
        report = ReportUpdater(session.out_dir, say=session.log.line)
        progress = RunProgress(log=session.log, live=False)
        holder: dict[str, ServedBatch] = {}
        flow = BatchFlow(out_dir=session.out_dir, ledger=session.ledger, flow=PAN2_FLOW, say=session.log.line,
                         upcoming=lambda: self.scheduler.upcoming(holder["batch"]), models_per_group=1)
        served = _Served(row=row, session=session, report=report, started=time.monotonic())
        served.batch = holder["batch"] = ServedBatch(flow=flow, progress=progress, standing=served,
                                                     on_job_end=report.request)
        jobs = session.ledger.jobs(session.job_ids)
        progress.begin(total=len(jobs), done=sum(j.state is JobState.DONE for j in jobs),
                       failed=sum(j.state is JobState.FAILED for j in jobs))
        self.served[row.id] = served
        self.scheduler.serve(served.batch, session.job_ids)

    def _end_finished(self) -> None:
        for batch_id, s in list(self.served.items()):
            if self.scheduler.running(s.batch):
                continue
            if s.batch.stop is None and self.scheduler.pending(s.batch) and s.row.state is not BatchState.CANCELLED:
                continue
            counts = s.session.counts()
            if s.batch.stop is not None:
                event, why = BatchEvent.STOP, f"its folder refused a write: {s.batch.stop}"
            elif s.row.state is BatchState.CANCELLED:
                event, why = None, "cancelled"
            elif counts[JobState.DONE.value] < counts["total"]:
                event = BatchEvent.END_FAILED
                why = ", ".join(f"{counts[s.value]} job(s) {s.value}" for s in (JobState.FAILED, JobState.CANCELLED)
                                if counts[s.value])
            else:
                event, why = BatchEvent.END_DONE, "every job done"
            self._close(batch_id, s, event, why, counts)

    def _close(self, batch_id: str, s: _Served, event: BatchEvent | None, why: str, counts: dict[str, int]) -> None:
        del self.served[batch_id]
        if event is not None:
            s.row = self.queue.transition(batch_id, event, reason=why)
        s.batch.progress.close()
        path = s.report.close()
        log = s.session.log
        if path is not None:
            log.line(f"report: {path}")
        # The closing lines `run` prints, then the farm's own.
        failed = [j.id for j in s.session.ledger.jobs(s.session.job_ids) if j.state is JobState.FAILED]
        log.line(f"{counts[JobState.DONE.value]} done, {len(failed)} failed in {time.monotonic() - s.started:.1f} s "
                 f"on the farm; see `pan2-render status {s.session.out_dir}`")
        for jid in failed:
            log.line(f"  failed: {jid}  (`pan2-render show {s.session.out_dir} {jid}` has its traceback)")
        log.line(f"farm: batch {batch_id} ended ({why}): {counts[JobState.DONE.value]} done, "
                 f"{counts[JobState.FAILED.value]} failed, {counts[JobState.CANCELLED.value]} cancelled of "
                 f"{counts['total']}")
        s.session.close()
        self.log(f"{batch_id}: ended ({why})")

    # ================================================================== the loop
    def run(self) -> None:
        """Serve until asked to stop (``farm stop``, SIGTERM); then every running job goes back to
        pending in its ledger, uncharged, as `run` does on a stop."""
        self.resume_unfinished()
        try:
            while not self._stopping.is_set():
                self.step()
        finally:
            self.close()

    def step(self) -> None:
        """One pass: the API's requests, the scheduler's pass (or a short wait when idle), ended
        batches closed, idle groups released, the snapshot published."""
        self._run_requests()
        if self.scheduler.busy:
            self.scheduler.tick()
        else:
            self._idle_wait()
        self._end_finished()
        for group in self.scheduler.pool.release_idle(self.config.idle_release_s):
            self.log(f"group {group.id} released after {self.config.idle_release_s:.0f} s idle")
        if time.monotonic() - self._published >= PUBLISH_EVERY_S:
            self._publish()

    def close(self) -> None:
        """Running jobs back to pending (uncharged), every batch's folder released, the groups ended."""
        self.scheduler.interrupt_all("the farm stopped", outcome="interrupted")
        for batch_id, s in list(self.served.items()):
            self._close(batch_id, s, None, "the farm stopped; it continues when the farm starts again",
                        s.session.counts())
        self.scheduler.close()
        self.queue.close()

    def _idle_wait(self) -> None:
        """Nothing to run: wait for a request (or the poll interval), without spinning."""
        try:
            request, fut = self._requests.get(timeout=self.config.poll_s)
        except queue_mod.Empty:
            return
        self._requests.put((request, fut))

    def _publish(self) -> None:
        batches = [self.describe(b.id) for b in self.queue.batches()[-200:]]
        groups = [{"id": g.id, "gpus": g.size, "models": sorted(g.loads), "state": state, "since": since,
                   "jobs": [r.job.id for r in self.scheduler.running_on(g)], "faults": g.faults}
                  for g, state, since in self.scheduler.pool.describe()]
        snap = {"url": self.url, "root": str(self.root), "pid": os.getpid(), "host": socket.gethostname(),
                "started_at": self.started_at, "cluster": self.ex.cluster, "gpus": self.scheduler.pool.total_gpus,
                "groups": groups, "batches": batches,
                "queue_depth": sum(len(self.scheduler.pending(s.batch)) for s in self.served.values()),
                "log": str(self.root / LOG_NAME), "idle_release_s": self.config.idle_release_s,
                "running": [_running_row(batch_id, s.batch.progress, r) for batch_id, s in self.served.items()
                            for r in s.batch.progress.running()],
                "events": self.queue.events(limit=EVENTS_SHOWN)}
        with self._snapshot_lock:
            self._snapshot = snap
        self._published = time.monotonic()


def _running_row(batch_id: str, progress: RunProgress, r: RunningJob) -> dict[str, Any]:
    """One running job for the snapshot: its stage, for how long, and a sampling's step k/N with the
    rate measured where the steps happen (None before its second step)."""
    steps = r.steps
    return {"job": r.job_id, "batch": batch_id, "group": r.group, "stage": r.stage,
            "stage_s": progress.stage_seconds(r), "step": steps.done if steps else None,
            "total": steps.total if steps else None, "rate": steps.rate if steps else None}


def exit_code(state: BatchState, counts: dict[str, int]) -> int | None:
    """What `run` would exit with for a batch in this state (None: not ended)."""
    if not state.ended:
        return None
    if state is BatchState.STOPPED:
        return 3
    return 0 if counts.get(JobState.DONE.value, 0) == counts.get("total", 0) else 1


def _ledger_counts(out_dir: Path, job_ids: list[str]) -> dict[str, int]:
    from pan2render.jobs.ledger import Ledger

    try:
        led = Ledger.open_readonly(out_dir)
    except Exception:  # a folder gone or damaged since: counts unknown
        return {"total": len(job_ids)}
    try:
        jobs = led.jobs(job_ids)
        return {state.value: sum(j.state is state for j in jobs) for state in JobState} | {"total": len(jobs)}
    finally:
        led.close()
