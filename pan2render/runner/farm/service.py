"""The farm process: the one scheduler kept up, serving every batch submitted to it.

One process holds the Ray driver, the GPU groups (kept loaded between batches, released after an
idle time or when another model or group size needs the GPUs), the durable queue and the HTTP API.
Its main thread runs the scheduler and is the only writer of the queue and of every served batch's
ledger; the API (``api.py``) runs on a thread of its own, reads a snapshot the main thread
publishes after each pass, and puts every request that changes something in line for the main
thread (``requests.py``), which carries it out (``actions.py``).

What survives what: each batch's folder and ledger are its truth (the jobs, their stages, their
artifacts), the queue says which folders the farm serves and how. A farm killed at any moment
(SIGKILL included) restarts from the two: ``farm start`` again serves every batch not ended from its
ledger, and nothing done is redone. The GPU workers are the farm's Ray actors, so they end with it.
A write to the queue that the disk refuses is reported (the log, ``farm status``, the monitor) and
tried again on the next pass; the farm keeps answering reads meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pan2render.jobs import disk
from pan2render.jobs.ledger import JobState, Ledger
from pan2render.runner.cluster.executor import Executor
from pan2render.runner.farm.actions import Actions, FarmRequestError
from pan2render.runner.farm.config import FarmConfig
from pan2render.runner.farm.etas import Etas
from pan2render.runner.farm.folder import LOG_NAME, VIDEOS_DIR
from pan2render.runner.farm.queue import BatchEvent, BatchState, FarmQueue, QueuedBatch, QueueError, shown_state
from pan2render.runner.farm.reports import Reports
from pan2render.runner.farm.requests import Requests
from pan2render.runner.farm.users import ADMIN
from pan2render.runner.protocol.artifacts import preview_relpath
from pan2render.runner.serve import errors
from pan2render.runner.serve.jobflow import BatchFlow
from pan2render.runner.serve.pool import GroupPool
from pan2render.runner.serve.progress import RunningJob, RunProgress
from pan2render.runner.serve.scheduler import Scheduler, ServedBatch
from pan2render.runner.serve.session import BatchSession, model_folder_problems
from pan2render.runner.serve.steps import PAN2_FLOW
from pan2render.runner.views.eta import BatchEta

PUBLISH_EVERY_S = 0.5  # the snapshot's age at most (each publish counts every served batch's jobs)
EVENTS_SHOWN = 50  # the queue's latest events in the snapshot (the web monitor's list)
ENDED_SHOWN = 50  # ended batches in the snapshot, newest last (`queue --all` reads the queue itself)


@dataclass(eq=False)
class _Served:
    """A batch of the queue the farm serves. Its standing (priority, paused, preempting) is its
    queue row's, which the farm replaces with the row the queue returns after each change."""

    row: QueuedBatch
    session: BatchSession
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


class Farm:
    def __init__(self, config: FarmConfig, executor: Executor, *, log: Callable[[str], None],
                 clock: Callable[[], float] = time.time):
        """``clock``: what the pool measures its groups' idle time with (``--idle-release``); a
        test passes its own."""
        self.config = config
        self.root = Path(config.root)
        self.videos_root = self.root / VIDEOS_DIR
        self.ex = executor
        self.log = log
        self.queue = FarmQueue(self.root)
        sched = config.scheduler_config()
        pool = GroupPool(executor, total_gpus=executor.total_gpus(), start_timeout_s=sched.group_start_timeout_s,
                         fault_limit=config.device_fault_limit, clock=clock)
        self.scheduler = Scheduler(executor=executor, config=sched, pool=pool)
        self.served: dict[str, _Served] = {}
        self.etas = Etas()  # the served batches' ETAs, planned within a share of this thread's time
        self.requests = Requests()
        self.reports = Reports(wake=self.requests.wake)  # written by a child process
        self.actions = Actions(self)
        self.write_error: str | None = None  # the queue's last refused write, until one succeeds
        self._snapshot: dict[str, Any] = {}
        self._encoded: dict[str, bytes] = {}  # what the API answers from this snapshot, as JSON
        self._snapshot_lock = threading.Lock()
        self._stopping = threading.Event()
        self._published = float("-inf")
        # What _publish keeps between passes: the queue's rows as of its last change, the ended
        # batches' descriptions (their ledgers, read once), so a snapshot costs the served batches.
        self._listed_at, self._listed_rows = -1, []
        self._ended_described: dict[tuple[str, float, BatchState], dict[str, Any]] = {}
        self.started_at = time.time()
        self.url = ""

    # ================================================================== requests from the API
    def ask(self, run: Callable[[], Any], *, action: str = "a request", user: str = ADMIN
            ) -> concurrent.futures.Future[Any]:
        """Run ``run`` on the main thread (the one writer); its result or error comes back in the
        future. Called from any other thread."""
        return self.requests.put(action, user, run).future

    def snapshot(self) -> dict[str, Any]:
        with self._snapshot_lock:
            return self._snapshot

    def encoded(self, name: str, make: Callable[[dict[str, Any]], Any]) -> bytes:
        """``make(snapshot)`` as JSON, encoded once per snapshot published, whoever asks: fifty
        clients reading the status of a thousand GPUs cost one encoding each half second, not fifty
        (each took ~10 ms of the GIL the scheduler's loop needs)."""
        with self._snapshot_lock:
            snap, cache = self._snapshot, self._encoded
        if (body := cache.get(name)) is None:
            body = cache[name] = json.dumps(make(snap)).encode()
        return body

    @property
    def snapshot_age_s(self) -> float:
        """Seconds since the main thread published its snapshot (at most PUBLISH_EVERY_S and a pass
        while its loop turns; infinite before the first): from any thread."""
        return time.monotonic() - self._published

    def stop(self) -> None:
        self._stopping.set()

    def describe(self, batch_id: str) -> dict[str, Any]:
        try:
            row = self.queue.get(batch_id)
        except QueueError as e:
            raise FarmRequestError(str(e), status=404) from None
        return self._described(row)

    def _described(self, row: QueuedBatch) -> dict[str, Any]:
        """On the main thread: a batch with what the farm knows of it while it serves it (an ended
        one as its ledger said when it last changed in the queue)."""
        s = self.served.get(row.id)
        if s is None:
            key = (row.id, row.updated_at, row.state)
            if (found := self._ended_described.get(key)) is None:
                found = self._ended_described[key] = described_from_ledger(row)
            return found
        running = [r.job.id for r in self.scheduler.running(s.batch)]
        return _description(row, s.session.counts(), running=running) | {
            "queued": self.scheduler.queued(s.batch), "waiting": self.scheduler.waiting(s.batch),
            "eta_s": s.batch.progress.eta_seconds()}

    # ================================================================== serving batches
    def resume_unfinished(self) -> None:
        """At start: every batch of the queue that has not ended is served again from its ledger
        (a cancelling one too: its jobs a client cancelled are cancelled then, and it ends)."""
        for row in self.queue.batches(include_ended=False):
            if broken := self.broken_model_folders(row):
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
            self.serve(row, session, revive_cancelled=False)

    @staticmethod
    def broken_model_folders(row: QueuedBatch) -> dict[str, list[str]]:
        """The model folders the batch's unfinished jobs name that cannot be loaded (checked
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

    def serve(self, row: QueuedBatch, session: BatchSession, *, revive_cancelled: bool) -> None:
        """Serve a batch held by ``session``: its jobs prepared (``revive_cancelled``: a cancelled
        job renders again, as when the batch is submitted again or retried), then queued."""
        try:
            session.prepare(retries=self.config.serving.retries, revive_cancelled=revive_cancelled)
            session.note_run(command="farm", gpus=self.scheduler.pool.total_gpus)
        except BaseException:
            session.close()
            raise
        self.reports.add(row.id, session.out_dir, say=session.log.line)
        eta = BatchEta(session.out_dir, session.job_ids, gpus=self.scheduler.pool.total_gpus)
        self.etas.add(row.id, lambda: eta.seconds(session.ledger))
        progress = RunProgress(log=session.log, live=False, eta=lambda: self.etas.seconds(row.id))
        holder: dict[str, ServedBatch] = {}
        flow = BatchFlow(out_dir=session.out_dir, ledger=session.ledger, flow=PAN2_FLOW, say=session.log.line,
                         upcoming=lambda: self.scheduler.upcoming(holder["batch"]), models_per_group=1)
        served = _Served(row=row, session=session, started=time.monotonic())
        served.batch = holder["batch"] = ServedBatch(flow=flow, progress=progress, standing=served,
                                                     on_job_end=lambda: self.reports.request(row.id))
        jobs = session.ledger.jobs(session.job_ids)
        progress.begin(total=len(jobs), done=sum(j.state is JobState.DONE for j in jobs),
                       failed=sum(j.state is JobState.FAILED for j in jobs))
        self.served[row.id] = served
        self.scheduler.serve(served.batch, session.job_ids)

    def _end_finished(self) -> None:
        """Close each served batch with nothing left to run, once its report is written: stopped
        if its folder refused a write, else failed if a job failed, cancelled if one was cancelled
        (or the batch was, its jobs not all done), done if every job is."""
        for batch_id, s in list(self.served.items()):
            if self.scheduler.running(s.batch):
                continue
            cancelling = s.row.state is BatchState.CANCELLING
            if s.batch.stop is None and self.scheduler.queued(s.batch) and not cancelling:
                continue
            if not self.reports.finish(batch_id):
                continue
            counts = s.session.counts()
            done, failed, cancelled = (counts[st.value] for st in (JobState.DONE, JobState.FAILED, JobState.CANCELLED))
            if s.batch.stop is not None:
                event, why = BatchEvent.STOP, f"its folder refused a write: {s.batch.stop}"
            elif failed:
                event = BatchEvent.END_FAILED
                why = f"{failed} job(s) failed" + (f", {cancelled} cancelled" if cancelled else "")
            elif cancelled or (cancelling and done < counts["total"]):
                event, why = BatchEvent.END_CANCELLED, f"{cancelled} job(s) cancelled, {done} done"
            else:
                event, why = BatchEvent.END_DONE, "every job done"
            if self._write(self.queue.transition, batch_id, event, reason=why):
                self._close(batch_id, s, why, counts, report_written=True)

    def _write(self, change: Callable[..., object], *args: Any, **kwargs: Any) -> bool:
        """A change of the queue the loop makes; a refused write (a full disk) is reported, once,
        and left for the next pass instead of stopping the farm."""
        try:
            change(*args, **kwargs)
        except Exception as e:
            if not disk.is_disk_full(e):
                raise
            if self.write_error is None:
                self.log(f"the queue could not be written ({e}); the farm goes on answering and tries again "
                         f"each pass: free space in {self.root}")
            self.write_error = f"{type(e).__name__}: {e}"
            return False
        if self.write_error is not None:
            self.log("the queue is written again")
            self.write_error = None
        return True

    def _close(self, batch_id: str, s: _Served, why: str, counts: dict[str, int], *, report_written: bool) -> None:
        """``report_written``: its final report is on disk (else it is written now, waited for)."""
        del self.served[batch_id]
        self.scheduler.forget(s.batch)
        self.etas.remove(batch_id)
        s.batch.progress.close()
        path = self.reports.path(batch_id) if report_written else self.reports.write_now(batch_id)
        self.reports.remove(batch_id)
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
        self._publish()
        try:
            while not self._stopping.is_set():
                self.step()
        finally:
            self.close()

    def step(self) -> None:
        """One pass: the API's requests, the scheduler's pass (or a short wait when idle), ended
        batches closed, idle groups released, the snapshot published."""
        # What a client just changed shows in its next read: the snapshot is published before it is answered.
        self.requests.run_waiting(refused=(FarmRequestError,), before_answers=self._publish)
        if self.scheduler.busy:
            self.scheduler.tick()
        else:
            self.requests.wait(self.config.poll_s)
        self._end_finished()
        self.reports.poll()
        for group in self.scheduler.pool.release_idle(self.config.idle_release_s):
            self.log(f"group {group.id} released after {self.config.idle_release_s:.0f} s idle")
        if time.monotonic() - self._published >= PUBLISH_EVERY_S:
            self._publish()

    def close(self) -> None:
        """Running jobs back to pending (uncharged), every batch's folder released, the groups ended."""
        self.scheduler.interrupt_all("the farm stopped", outcome="interrupted")
        for batch_id, s in list(self.served.items()):
            self._close(batch_id, s, "the farm stopped; it continues when the farm starts again", s.session.counts(),
                        report_written=False)
        self.reports.close()
        self.scheduler.close()
        self.queue.close()

    def _listed(self) -> list[QueuedBatch]:
        """The batches the snapshot shows: every one not ended and the latest ENDED_SHOWN ended,
        none hidden, in submission order; read from the queue again only once it changed."""
        if self._listed_at != self.queue.changes:
            rows = self.queue.batches(include_ended=False, include_hidden=False) + self.queue.ended(ENDED_SHOWN)
            self._listed_rows, self._listed_at = sorted(rows, key=lambda r: r.seq), self.queue.changes
            shown = {r.id for r in rows}
            self._ended_described = {k: v for k, v in self._ended_described.items() if k[0] in shown}
        return self._listed_rows

    def _publish(self) -> None:
        self.etas.refresh()
        batches = [self._described(r) for r in self._listed()]
        groups = [{"id": g.id, "gpus": g.size, "models": sorted(g.loads), "state": state, "since": since,
                   "jobs": [r.job.id for r in self.scheduler.running_on(g)], "faults": g.faults}
                  for g, state, since in self.scheduler.pool.describe()]
        snap = {"url": self.url, "root": str(self.root), "pid": os.getpid(), "host": socket.gethostname(),
                "started_at": self.started_at, "cluster": self.ex.cluster, "gpus": self.scheduler.pool.total_gpus,
                "groups": groups, "batches": batches,
                "queue_depth": sum(self.scheduler.queued(s.batch) for s in self.served.values()),
                "log": str(self.root / LOG_NAME), "idle_release_s": self.config.idle_release_s,
                "write_error": self.write_error,
                "running": [_running_row(batch_id, s.batch.progress, r) for batch_id, s in self.served.items()
                            for r in s.batch.progress.running()],
                "events": self.queue.events(limit=EVENTS_SHOWN)}
        with self._snapshot_lock:
            self._snapshot, self._encoded = snap, {}
        self._published = time.monotonic()


def _running_row(batch_id: str, progress: RunProgress, r: RunningJob) -> dict[str, Any]:
    """One running job for the snapshot: its stage, for how long, and a sampling's step k/N with the
    rate measured where the steps happen (None before its second step)."""
    steps = r.steps
    return {"job": r.job_id, "batch": batch_id, "group": r.group, "stage": r.stage,
            "stage_s": progress.stage_seconds(r), "step": steps.done if steps else None,
            "total": steps.total if steps else None, "rate": steps.rate if steps else None,
            "preview": _preview(batch_id, r)}


def _preview(batch_id: str, r: RunningJob) -> dict[str, Any] | None:
    """A running job's newest preview: its step, and where the monitor's files route serves it (the
    step in the query, so that a browser fetches each new picture)."""
    if r.preview is None:
        return None
    step, total = r.preview
    return {"step": step, "steps": total,
            "url": f"/api/batches/{batch_id}/files/{preview_relpath(r.job_id)}?step={step}"}


def exit_code(state: BatchState, counts: dict[str, int]) -> int | None:
    """What `run` would exit with for a batch in this state (None: not ended)."""
    if not state.ended:
        return None
    if state is BatchState.STOPPED:
        return 3
    return 0 if counts.get(JobState.DONE.value, 0) == counts.get("total", 0) else 1


def described_from_ledger(row: QueuedBatch) -> dict[str, Any]:
    """A batch as its queue row and its ledger (read-only) say, from any thread."""
    return _description(row, _ledger_counts(Path(row.out_dir), row.job_ids))


def _description(row: QueuedBatch, counts: dict[str, int], *, running: list[str] | None = None) -> dict[str, Any]:
    """``state``: the queue's; ``shown_state``: as `queue` and the monitor name it (running, queued, ...)."""
    return {"id": row.id, "out_dir": row.out_dir, "batch": row.batch_path, "owner": row.owner,
            "priority": row.priority, "preempt": row.preempt, "state": row.state.value,
            "shown_state": shown_state(row.state, running=bool(running)), "reason": row.reason,
            "submitted_at": row.submitted_at, "updated_at": row.updated_at, "counts": counts,
            "running": running or [], "queued": 0, "waiting": 0, "eta_s": None,
            "exit_code": exit_code(row.state, counts), "video_id": row.video_id, "hidden": row.hidden}


def _ledger_counts(out_dir: Path, job_ids: list[str]) -> dict[str, int]:
    try:
        led = Ledger.open_readonly(out_dir)
    except Exception:  # a folder gone or damaged since: counts unknown
        return {"total": len(job_ids)}
    try:
        states = list(led.job_states(job_ids).values())
        return {state.value: states.count(state) for state in JobState} | {"total": len(states)}
    finally:
        led.close()
