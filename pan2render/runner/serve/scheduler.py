"""The scheduler: feeds the jobs of one or more batches to worker groups and keeps every group's GPU
busy. What a job does next, and how a reply or a failure is recorded, is the stage flow's
(``jobflow.py``); the scheduler decides only which job runs on which group, and when.

A group owns up to two kinds of jobs at once: one on its GPU lane (plus the next one queued behind
a decode) and up to ``MAX_ENCODES_IN_FLIGHT`` encoding in the background. The loop never blocks on
one call: it waits on all in-flight calls with a short timeout, and every call has its own deadline.
What a failure costs is ``retry.py``'s; what it serves and how, ``serving.py``'s and ``config.py``'s;
what it watches (deadlines, hung samplings, lost GPUs), ``watch.py``'s. ``driver.Driver`` is it
serving one batch (`run`), the farm (``farm/``) is it kept up. Pending jobs start strictly in queue
order (priority, then when their batch was served, then their order in it): when the head job's
group size is not free, later jobs wait too, so a 4-GPU job is never starved by 1-GPU jobs.
"""

from __future__ import annotations

from collections.abc import Iterator

from pan2render.jobs.ledger import EventKind, JobEvent, JobRecord, JobState, Stage, StageEvent, stage_name
from pan2render.runner.cluster.executor import Call, Executor, Group, GroupDied, GroupStartError
from pan2render.runner.protocol.artifacts import CANCEL_DOC
from pan2render.runner.protocol.failures import BatchStopped, Failure, FailureKind, classify_exception
from pan2render.runner.protocol.messages import Lane, StopSamplingCall, WorkerCall
from pan2render.runner.serve import watch
from pan2render.runner.serve.attempt import PREEMPTED_AT, JobRun, Phase, Stop, StopKind
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.pool import GroupPool
from pan2render.runner.serve.retry import BYSTANDER, Action, Decision, OnGroup, RetryPolicy
from pan2render.runner.serve.running import Running
from pan2render.runner.serve.serving import JobQueue, QueuedJob, ServedBatch
from pan2render.runner.serve.sides import SideFetches
from pan2render.runner.serve.waits import Waits


class Scheduler:
    """Runs the pending jobs of every served batch on groups from one pool."""

    def __init__(self, *, executor: Executor, config: ServingConfig, pool: GroupPool | None = None):
        self.ex = executor
        self.config = config
        self.pool = pool or GroupPool(executor, total_gpus=executor.total_gpus(),
                                      start_timeout_s=config.group_start_timeout_s)
        self._max_group = executor.max_group_size()  # a group's GPUs must all be on one node
        self._queue = JobQueue()
        self._running = Running()
        self._batch_of: dict[int, ServedBatch] = {}
        self._policy = RetryPolicy()
        self._cluster = watch.ClusterWait(executor, wait_s=config.cluster_wait_s)
        self._watch = watch.Watch(executor, stall_timeout_s=config.stall_timeout_s)
        self._sides = SideFetches(executor, self._call)

    # ================================================================== what it serves
    def serve(self, batch: ServedBatch, job_ids: list[str]) -> None:
        """Queue the named jobs of ``batch`` that are pending (prepared: see prepare_jobs), each to
        start once the jobs it runs after are done (serve/waits.py)."""
        self._batch_of[batch.seq] = batch
        jobs = batch.ledger.jobs(job_ids)
        batch.waits = Waits(jobs)
        stuck = batch.waits.caught()  # job id -> why it can never start
        for job in jobs:  # all queued before any ends: a job's end ends the queued jobs after it
            if job.state is JobState.PENDING:
                self._queue.add(batch, job)
        for job in jobs:
            if (q := self._queue.find(batch, job.id)) and (job.spec.gpus > self._max_group or job.id in stuck):
                self._queue.remove(q)
                self._fail_unrunnable(batch, job, stuck.get(job.id))
            elif job.state in (JobState.FAILED, JobState.CANCELLED):  # not revived: the jobs after it cannot run
                self._end_after(batch, job.id, job.state, job.error or "in an earlier run")

    def pending(self, batch: ServedBatch) -> list[str]:
        return [q.job_id for q in self._queue.of(batch)]

    def queued(self, batch: ServedBatch) -> int:  # len(pending(batch)), without the list
        return self._queue.count(batch)

    def waiting(self, batch: ServedBatch) -> int:  # of queued(batch), those waiting for their `after`
        return batch.waits.count(queued=lambda job_id: self._queue.find(batch, job_id) is not None)

    def running(self, batch: ServedBatch) -> list[JobRun]:
        return self._running.of(batch)

    @property
    def busy(self) -> bool:
        """Anything left to do: a job running, or one that may start."""
        return bool(self._running) or any(b.stop is None and not b.paused and self._queue.count(b)
                                          for b in self._batch_of.values())

    def reorder(self) -> None:
        """After a batch's priority changed."""
        self._queue.reorder()

    def running_on(self, group: Group) -> list[JobRun]:
        return [r for _, r in self._running.on(group)]

    # ================================================================== stops: cancel, preemption
    def cancel(self, batch: ServedBatch, job_ids: list[str] | None, *, reason: str) -> list[JobRun]:
        """Cancel the batch's jobs (``job_ids``; None: all): a queued one now, a sampling one at its
        next step boundary (returned), one still before its sampling when its call in flight
        returns, one past its sampling once its video is made. Durable when it returns: the queued
        jobs are cancelled in the ledger (one transaction), the running ones marked there to be
        cancelled (``CANCEL_DOC``), so a driver killed before they stop cancels them at its next start."""
        wanted = None if job_ids is None else set(job_ids)
        queued = [q for q in self._queue.of(batch) if wanted is None or q.job_id in wanted]
        runs = [r for r in self.running(batch) if (wanted is None or r.job.id in wanted) and not r.cancelled]
        batch.ledger.transition_many([q.job_id for q in queued], JobEvent.CANCEL, reason=reason)
        batch.ledger.set_documents([r.job.id for r in runs], CANCEL_DOC, reason)
        for q in queued:
            self._queue.remove(q)
            batch.progress.job_ended(q.job_id, "cancelled", reason)
            batch.ended += 1
        for q in queued:  # (once they are all out of the queue: one that waited for another is cancelled already)
            self._end_after(batch, q.job_id, JobState.CANCELLED, reason)
        stopped = []
        for run in runs:
            run.stop = Stop(StopKind.CANCEL, reason)
            if self._stop_sampling(run):
                stopped.append(run)
        return stopped

    def _stop_sampling(self, run: JobRun) -> bool:
        """Ask ``run``'s sampling, if one is in flight, to stop at its next step boundary."""
        if run.phase is not Phase.SAMPLING:
            return False
        run.move(Phase.STOPPING)
        self.ex.call(run.group, StopSamplingCall(job_id=run.job.id), timeout_s=StopSamplingCall.default_timeout_s)
        return True

    def _preempt_for(self, q: QueuedJob) -> None:
        """``q`` waits for a group while a lower-priority batch's job samples on one of its size:
        that sampling stops at its next step boundary, checkpointed, and its job goes back to the
        queue (uncharged); ``q`` then takes the group. One preemption at a time."""
        if not q.batch.preempts or any(r.preempted for r in self._running.runs()):
            return
        victims = [(b, r) for b, r in self._running
                   if r.group.size == q.gpus and b.priority < q.batch.priority and r.stop is None
                   and r.phase is Phase.SAMPLING]
        if victims:
            _, victim = min(victims, key=lambda found: found[0].priority)
            victim.stop = Stop(StopKind.PREEMPT, "a higher-priority batch needs its group")
            self._stop_sampling(victim)

    def _settle_stop(self, batch: ServedBatch, run: JobRun) -> bool:
        """After a reply of a job being stopped: does the stop end the attempt here? A sampling that
        stopped at a step boundary ends cancelled or, preempted, back in the queue uncharged; a job
        cancelled before its sampling ends cancelled without going further; one past its GPU work
        (encoding) finishes, and so does a sampling that returned its latents before the stop took
        it (the stop is void for a preemption; a cancel ends the job at the next reply)."""
        if run.stop is None:
            return False
        if run.phase is Phase.STOPPED:
            self._leave(batch, run)
            if run.cancelled:
                self._end_cancelled(batch, run.job.id, f"{run.stop.reason}: sampling stopped at step {run.stopped_at}")
            else:
                self._requeue(batch, run.job.id, f"{PREEMPTED_AT} {run.stopped_at} by a higher-priority batch; "
                                                 f"it continues from its step checkpoint")
                batch.progress.job_ended(run.job.id, "requeued", f"preempted at step {run.stopped_at}")
            return True
        if run.cancelled and not run.gpu_done:  # its GPU work not done: go no further
            self._leave(batch, run)
            self._end_cancelled(batch, run.job.id, run.stop.reason)
            return True
        if run.preempted:
            run.stop = None  # it got past its sampling: nothing left to preempt
        return False

    def _end_cancelled(self, batch: ServedBatch, job_id: str, reason: str) -> None:
        batch.ledger.transition(job_id, JobEvent.CANCEL, reason=reason)
        batch.ledger.delete_document(job_id, CANCEL_DOC)  # (after: a crash between leaves it to prepare_jobs)
        batch.progress.job_ended(job_id, "cancelled", reason)
        batch.ended += 1
        self._end_after(batch, job_id, JobState.CANCELLED, reason)

    def upcoming(self, batch: ServedBatch) -> Iterator[QueuedJob]:
        """The batch's queued jobs that may start (none waiting for its `after`), in start order, with
        their prompts (the look-ahead's: reading their specs from the ledger cost ~0.1 s a call)."""
        return (q for q in self._queue.queued_of(batch) if not batch.waits.waits(q.job_id))

    # ================================================================== the loop
    def tick(self) -> None:
        """One pass: start what can start, handle every reply that is ready, and what the watch
        finds due (deadlines, steps, hung samplings: every few tenths of a second)."""
        self.ex.check_cluster()
        self._dispatch()
        if (note := self.pool.take_start_note()) is not None:  # a group waiting for GPUs, every few seconds
            for batch in self._batch_of.values():
                batch.progress.say(note)
        if not self._running:  # nothing running: a group is starting (or failed to)
            self.pool.wait_for_start(self.config.poll_s)
            return
        for call in self.ex.wait(self._running.calls(), timeout_s=self.config.poll_s):
            self._on_ready(call)
        steps, found = self._watch.look(self._running.keyed, ledger_of=lambda key: self._batch_of[key[0]].ledger)
        for (seq, job_id), report in steps.items():
            self._batch_of[seq].progress.steps({job_id: report})
        self._tear_down(found)
        for batch in self._batch_of.values():
            batch.progress.tick()
            batch.notify_job_end()

    def forget(self, batch: ServedBatch) -> None:
        """``batch`` is served no more (the farm closed it; none of its jobs runs): its jobs still
        queued (a batch a full disk stopped) leave the queue; the passes no longer look at it."""
        assert not self._running.count(batch), f"batch {batch.seq} has jobs running"
        for q in self._queue.of(batch):
            self._queue.remove(q)
        self._batch_of.pop(batch.seq, None)

    def interrupt_all(self, reason: str, *, outcome: str = "interrupted", detail: str = "") -> None:
        """Every running job back to pending, uncharged (the run stops, or the cluster went)."""
        for batch, run in self._running:
            self._running.end(batch, run)
            batch.ledger.transition(run.job.id, JobEvent.INTERRUPT, reason=reason)
            batch.progress.job_ended(run.job.id, outcome, detail)

    def close(self) -> None:
        self.pool.close()

    def _dispatch(self) -> None:
        """Start queued jobs, in order, on groups. Where a job goes, best first: a group that
        holds a job already and whose GPU lane is free (its jobs only encode); an idle or new group
        from the pool; a held group whose GPU lane runs only a decode, the job's first call queued
        behind it."""
        if not self._cluster_ready():
            return
        for q in self._queue:  # (the queue may change while it is walked: see JobQueue)
            if q.batch.stop is not None or q.batch.paused or q.batch.waits.waits(q.job_id):
                continue
            group = self._running.held_group(q.gpus, behind_decode=False, avoid=q.avoid)
            try:
                group = group or self.pool.try_acquire(q.gpus, model=q.model, adapters=q.adapters, avoid=q.avoid)
            except GroupStartError as e:
                self._queue.remove(q)
                q.batch.ledger.transition(q.job_id, JobEvent.START, reason="starting a group")
                # Charged to the stage the job would have run next; its finished stages (and their
                # artifacts) stay done.
                kind = FailureKind.CLUSTER_LOST if self.ex.lacks_gpus_for(q.gpus) else FailureKind.UNKNOWN
                self._failed(q.batch, q.job_id, Failure(stage=q.batch.flow.next_stage(q.job_id), kind=kind,
                                                        error=str(e), cause=e))
                continue
            group = group or self._running.held_group(q.gpus, behind_decode=True, avoid=q.avoid)
            if group is None:
                self._preempt_for(q)
                break
            if (line := self.pool.placement_line(group)) is not None:  # its first job
                q.batch.progress.say(line)
            self._queue.remove(q)
            with q.batch.step():  # the start and the first stage marked: one commit
                q.batch.ledger.transition(q.job_id, JobEvent.START, reason=f"on group {group.id} ({group.size} GPU(s))")
                run = JobRun(job=q.batch.ledger.job(q.job_id), group=group)
                q.batch.progress.job_started(q.job_id, group=group.id, attempt=run.job.attempts)
                self._running.add(q.batch, run)
                self._advance(q.batch, run)

    def _leave(self, batch: ServedBatch, run: JobRun) -> None:
        """The job no longer runs on its group; the group goes back to the pool once it holds no job."""
        self._running.end(batch, run)
        if not self.running_on(run.group):
            self.pool.release(run.group)

    def _advance(self, batch: ServedBatch, run: JobRun) -> None:
        """Issue the job's next call, or finish it. A driver-side problem (input image gone or
        changed, unreadable cache file) fails the stage the job was about to run."""
        if batch.stop is not None:  # e.g. the disk is full: this job goes back to pending, uncharged
            self._leave(batch, run)
            return self._requeue(batch, run.job.id, "the output folder refused a write: the batch stops; "
                                                    "`resume` continues")
        try:
            message = batch.flow.next_call(run)
        except Exception as e:  # any driver-side failure is the job's, with its class
            self._leave(batch, run)
            return self._failed(batch, run.job.id, batch.flow.driver_failure(run.job.id, e))
        if message is None:
            self._leave(batch, run)
            self.pool.succeeded(run.group)
            batch.flow.finish(run)
            batch.waits.done(run.job.id)
            batch.progress.job_ended(run.job.id, "done")
            batch.ended += 1
            return None
        if message.marks_stage and message.stage is not None:
            batch.ledger.set_stage(run.job.id, message.stage, StageEvent.START)
        batch.progress.stage(run.job.id, message.label())
        run.sent(message, self._call(run, message))
        if run.sampling:
            watch.started_sampling(run)
            self._sides.start(run)  # its step checkpoint's and preview's fetches, beside it
            if run.stop is not None:  # asked before this call went out
                self._stop_sampling(run)
        return None

    def _call(self, run: JobRun, message: WorkerCall) -> Call:
        timeout_s = self.config.call_timeouts_s.get(message.timeout_key, message.default_timeout_s)
        return self.ex.call(run.group, message, timeout_s=timeout_s)

    # ================================================================== results
    def _on_ready(self, call: Call) -> None:
        found = self._running.find(call)
        if found is None:
            return  # its job left when its group was torn down: the reply is void
        with found[0].step():  # its record and what follows (the next stage marked): one commit
            self._on_reply(*found, call)

    def _on_reply(self, batch: ServedBatch, run: JobRun, call: Call) -> None:
        if call is not run.call:  # a fetch beside its sampling (sides.py)
            return self._sides.on_reply(batch, run, call)
        stage = call.message.stage
        assert stage is not None, f"{type(call.message).__name__} is not a job's call"
        try:
            reply = self.ex.result(call)
        except GroupDied as e:  # its worker died under every call in flight on it: any may have killed it
            why = f"worker group {run.group.id} died or stopped answering: {e}"
            failure = Failure(stage=stage, kind=e.kind, error=why)
            return self._call_failed(batch, run, failure, OnGroup(size=run.group.size), died=True, under_all=True)
        if reply.failure is not None:
            on_group = OnGroup(size=run.group.size, io_lane=call.message.lane is Lane.IO)
            return self._call_failed(batch, run, reply.failure, on_group)
        try:
            batch.flow.record(run, call.message, reply.value, reply.seconds)
        except Exception as e:  # e.g. disk full, or the written video fails its check
            self._leave(batch, run)
            return self._failed(batch, run.job.id, batch.flow.driver_failure(run.job.id, e))
        run.returned()
        if not self._settle_stop(batch, run):
            self._advance(batch, run)

    # ================================================================== failures
    def _tear_down(self, found: list[tuple[tuple[int, str], JobRun, Failure]]) -> None:
        """Each run the watch found overdue or hung: its group torn down, as a dead one (its other jobs, bystanders)."""
        for key, run, failure in found:
            if key in self._running:  # (not a job of a group torn down for an earlier one)
                self._call_failed(self._batch_of[key[0]], run, failure, OnGroup(size=run.group.size), died=True)

    def _call_failed(self, batch: ServedBatch, run: JobRun, failure: Failure, on_group: OnGroup, *,
                     died: bool = False, under_all: bool = False) -> None:
        """A call of ``run`` failed on its group: one decision (serve/retry.py) says what becomes of the
        job and whether the group takes the next job or is torn down (``died``: it is gone already;
        ``under_all``: its worker died under its other jobs' calls too, which are then charged)."""
        job = batch.ledger.job(run.job.id)
        self._queue.failed_on(batch, job.id, run.group.id)
        decision = self._policy.decide(job, failure, on_group=on_group)
        if decision.keep_group:
            self._leave(batch, run)  # only this job's call failed; the group goes on
            return self._carry_out(batch, job.id, failure, decision, cancel=run.cancel_reason)
        if not died:
            batch.ledger.log(job.id, EventKind.GROUP_DISCARDED,
                             f"group {run.group.id} after [{failure.kind.value}]: {failure.message}")
        others = [(b, r) for b, r in self._running.on(run.group) if r is not run]
        if failure.kind is FailureKind.WORKER_DEATH:
            fresh = self.pool.device_fault(run.group)
            if fresh is None and run.group.faults >= (self.pool.fault_limit or 0) > 0:
                batch.progress.say(f"group {run.group.id} is out of service after {run.group.faults} device "
                                   f"faults in a row; its jobs run elsewhere")
        else:
            self.pool.discard(run.group)
        for b, r in [(batch, run), *others]:
            self._running.end(b, r)
        batch.ledger.log(job.id, EventKind.GROUP_DIED, failure.message)
        self._carry_out(batch, job.id, failure, decision, cancel=run.cancel_reason)
        # Every other job the torn-down group owned (one queued on its GPU lane, ones encoding) goes back from its last
        # durable stage: charged as cluster-lost when this failure was (the same lost node), as a worker death when the
        # worker died under their calls too, else not at all (retry.BYSTANDER: their calls were answering).
        lost = failure.kind is FailureKind.CLUSTER_LOST or self.ex.lacks_gpus_for(run.group.size)
        for b, r in others:
            msg = (f"group {run.group.id} was torn down (after job {run.job.name}: "
                   f"{failure.message.splitlines()[0][:300]})")
            b.ledger.log(r.job.id, EventKind.GROUP_DIED, msg)
            stage = r.call.message.stage if r.call is not None else b.flow.next_stage(r.job.id)
            also = Failure(stage=stage or Stage.CONDITIONING, error=msg,
                           kind=FailureKind.CLUSTER_LOST if lost else FailureKind.WORKER_DEATH)
            decision = self._policy.decide(b.ledger.job(r.job.id), also) if lost or under_all else BYSTANDER
            self._carry_out(b, r.job.id, also, decision, cancel=r.cancel_reason)

    def _failed(self, batch: ServedBatch, job_id: str, failure: Failure, *, cancel: str | None = None) -> None:
        """A failure of a job off any group (a driver write, a group that never formed, a job of a
        group torn down for another): decided by serve/retry.py, then carried out."""
        self._carry_out(batch, job_id, failure, self._policy.decide(batch.ledger.job(job_id), failure), cancel=cancel)

    def _carry_out(self, batch: ServedBatch, job_id: str, failure: Failure, decision: Decision, *,
                   cancel: str | None = None) -> None:
        """The flow records the decision in the ledger; here the job is queued again or ends. A job
        a client cancelled (``cancel``: why) is not queued again: it ends cancelled."""
        first = failure.message.splitlines()[0][:200] if failure.message else ""
        line = f"{stage_name(failure.stage)}: [{failure.kind.value}] {first}"
        if cancel is not None and decision.action is not Action.FAIL:
            return self._end_cancelled(batch, job_id, f"{cancel} (its {line} meanwhile)")
        if decision.action is Action.REQUEUE:
            if decision.stop_batch and batch.stop is None:
                batch.stop = BatchStopped(failure.cause or RuntimeError(failure.message))
            if failure.kind is FailureKind.CLUSTER_LOST:
                self._cluster.lose()
            self._requeue(batch, job_id, f"{decision.reason}: {failure.message}")
            batch.progress.job_ended(job_id, "requeued", f"{line}; {decision.reason}")
            return
        batch.flow.record_failure(job_id, failure.without_cause(), decision)
        if decision.action is Action.RETRY:
            self._queue.add(batch, batch.ledger.job(job_id))
            batch.progress.job_ended(job_id, "retry", line)
        else:
            batch.progress.job_ended(job_id, "FAILED", f"{line}; {decision.reason}")
            batch.ended += 1
            error = batch.ledger.job(job_id).error  # (as recorded: the jobs after it say it whole)
            self._end_after(batch, job_id, JobState.FAILED, f"{stage_name(failure.stage)}: {error}")

    def _requeue(self, batch: ServedBatch, job_id: str, reason: str) -> None:
        """Back to pending without charging the job (the environment failed, not the job). If the
        ledger cannot record it (the disk that filled holds it too), the job stays "running" there,
        which the next run or resume treats as interrupted: the same outcome."""
        try:
            batch.ledger.transition(job_id, JobEvent.INTERRUPT, reason=reason)
        except Exception as e:  # only a full disk is expected here
            if classify_exception(e) is not FailureKind.STORAGE:
                raise
        if batch.stop is None:
            self._queue.add(batch, batch.ledger.job(job_id))

    def _cluster_ready(self) -> bool:
        """After the cluster lost GPUs: have enough come back for every queued job? (Raises
        ClusterLostError once they have been gone too long, no job running.)"""
        if not self._cluster.lost:
            return True
        back = self._cluster.back(need=max((q.gpus for q in self._queue), default=0), running=bool(self._running),
                                  queued=len(self._queue), folders=[b.flow.out_dir for b in self._batch_of.values()])
        if back is None:
            return not self._cluster.lost
        self.pool.total_gpus = back
        for batch in self._batch_of.values():
            batch.progress.say(f"the cluster has {back} GPU(s) again; continuing")
        return True

    def _fail_unrunnable(self, batch: ServedBatch, job: JobRecord, msg: str | None = None) -> None:
        msg = msg or (f"needs a group of {job.spec.gpus} GPUs but the cluster has {self.pool.total_gpus} "
                      f"(at most {self._max_group} on one node, and a group must sit on one node); lower "
                      f"`gpus` or add GPUs (--cpu-gpus N on a CPU-only machine)")
        batch.flow.fail_unrunnable(job.id, msg)
        batch.progress.job_ended(job.id, "FAILED", msg)
        batch.ended += 1
        self._end_after(batch, job.id, JobState.FAILED, msg)

    def _end_after(self, batch: ServedBatch, job_id: str, state: JobState, reason: str) -> None:
        """``job_id`` failed or was cancelled: the queued jobs after it end so too, unstarted (serve/waits.py)."""
        for dependent, event, why in batch.waits.ended(job_id, state, reason,
                                                        waiting=lambda j: self._queue.find(batch, j) is not None):
            self._queue.remove(self._queue.find(batch, dependent))  # type: ignore[arg-type]
            batch.flow.end_unstarted(dependent, event, why)
            batch.progress.job_ended(dependent, "FAILED" if event is JobEvent.FAIL else "cancelled", why)
            batch.ended += 1
