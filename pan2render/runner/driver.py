"""The driver: feeds ledger jobs to worker groups, stage by stage, and records every result.

It is the ledger's only writer and the only process that touches the output folder. Each job is a
small sequence of collective calls on one group (typed messages, see ``messages.py``)::

    LoadCall (once per group and model) -> EncodePromptsCall (skipped on a cache hit) -> SampleCall
        -> DecodeCall -> CollectCall -> done

The GPU never waits for the driver or the encoder: a decode returns once the frames are on the
host and the job then only waits for its background encode (the collect, the worker's I/O lane),
while the group already works on the next job, whose first call was queued behind that decode.
So a group owns up to two kinds of jobs at once: one on its GPU lane (plus the next one queued
behind a decode) and up to ``MAX_ENCODES_IN_FLIGHT`` encoding. Prompts of upcoming jobs are
encoded together with the current job's, in one call, so later jobs find them cached.

Which call comes next is decided from the ledger and from checking the artifacts on disk, so a job
re-queued after a crash, or resumed by another driver, restarts at its last durable stage.
The scheduling loop never blocks on one call: it waits on all in-flight calls with a short timeout
(``ray.wait``), and every call has its own deadline; a call past it counts as a dead group.
What a failure costs the job and whether its group takes the next job is decided in ``retry.py``.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pan2render.jobs.disk import is_disk_full
from pan2render.jobs.ledger import (
    JobEvent,
    JobRecord,
    JobState,
    Ledger,
    Stage,
    StageState,
)
from pan2render.jobs.weights import folder_fingerprint
from pan2render.phases import describe as describe_phases
from pan2render.runner import outputs, stages
from pan2render.runner.groups import Call, Executor, GcsLost, Group, GroupDied, GroupPool, GroupStartError
from pan2render.runner.messages import (
    JOB_CALLS,
    MAX_ENCODES_IN_FLIGHT,
    CollectCall,
    CollectReply,
    DecodeCall,
    DecodeReply,
    EncodePromptsCall,
    EncodePromptsReply,
    Lane,
    LoadCall,
    LoadReply,
    Reply,
    SampleCall,
    SampleReply,
    Warmup,
    WorkerCall,
    default_call_timeouts,
)
from pan2render.runner.progress import RunLog, RunProgress
from pan2render.runner.retry import (
    Action,
    ArtifactCheckError,
    BatchStopped,
    ClusterLostError,
    Decision,
    FailureKind,
    JobInputError,
    OnGroup,
    RetryPolicy,
    classify_exception,
)
from pan2render.runner.timeline import stamp

# Prompts encoded in one encode_prompts call (the current job's and upcoming jobs'); each
# embedding is 512 x 4096 float32 = 8 MB of reply.
CONDITIONING_AHEAD_TEXTS = 16


@dataclass(frozen=True)
class DriverConfig:
    retries: int = 2  # retries per job after its first attempt (resume grants a fresh budget)
    poll_s: float = 0.5  # longest the loop sleeps in ray.wait before checking deadlines/progress
    group_start_timeout_s: float = 300.0
    # Per-call deadlines, by each call type's timeout_key (defaults: messages.py); a call past its
    # deadline is treated as a dead group.
    call_timeouts_s: dict[str, float] = field(default_factory=default_call_timeouts)
    progress: bool = True  # a live block on stderr when it is a terminal (else plain lines)
    # How long the batch waits for GPUs to come back after the cluster lost the ones a job needs
    # (a node died, its raylet or the GCS restarted) before it stops with a message.
    cluster_wait_s: float = 300.0
    # Times a job's artifact may be redone in one run because it failed its check (corrupt on
    # disk, or freshly written and rejected) before the job fails with the check's reason.
    max_redos: int = 2

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries={self.retries} must be >= 0 (0 = no retries)")
        if self.cluster_wait_s < 0 or self.max_redos < 0:
            raise ValueError(f"cluster_wait_s={self.cluster_wait_s} and max_redos={self.max_redos} must be >= 0")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s={self.poll_s} must be > 0")
        missing = {c.timeout_key for c in JOB_CALLS} - set(self.call_timeouts_s)
        if missing:
            raise ValueError(f"call_timeouts_s lacks {sorted(missing)}")


def _stage_of(message: WorkerCall) -> Stage:
    """The ledger stage a failure of this job call is charged to."""
    assert message.stage is not None, f"{type(message).__name__} is not a job's call"
    return message.stage


@dataclass(frozen=True)
class RunSummary:
    done: list[str]
    failed: list[str]
    groups_created: int
    seconds: float

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


@dataclass
class _Active:
    job: JobRecord
    group: Group
    call: Call | None = None
    encode_texts: list[str] = field(default_factory=list)  # texts of the encode_prompts in flight
    decode_s: float | None = None  # set when its decode returned: the encode runs in the background

    @property
    def encoding(self) -> bool:
        """Waiting only for its background encode: the group's GPU lane is not this job's."""
        return self.decode_s is not None

    @property
    def decoding(self) -> bool:
        """Its decode is in flight: the last GPU work of the job."""
        return self.call is not None and isinstance(self.call.message, DecodeCall)


def prepare_jobs(*, out_dir: Path, ledger: Ledger, job_ids: list[str], retries: int,
                 say: Callable[[str], None]) -> None:
    """Bring the named jobs to a runnable state (idempotent; needs no workers): interrupted ones
    back to pending, failed ones revived with a fresh retry budget, done ones whose video no longer
    checks out (missing, size/sha256 mismatch, does not decode) invalidated back to decode."""
    for job in ledger.jobs(job_ids):
        if job.state is JobState.RUNNING:
            ledger.transition(job.id, JobEvent.INTERRUPT, reason="the previous driver stopped while this job ran")
        elif job.state is JobState.FAILED:
            ledger.transition(job.id, JobEvent.REVIVE, retries=retries,
                              reason="resumed: a failed job gets a fresh retry budget")
        elif job.state is JobState.DONE:
            rec = ledger.stages(job.id)[Stage.ENCODE]
            problem = stages.check_video(out_dir, stages.Recorded(rec.artifact, rec.sha256, rec.size),
                                         frames=job.spec.frames, width=job.spec.width,
                                         height=job.spec.height)
            if problem:
                # Stages first: a crash between the two writes leaves a done job whose video is
                # checked again next time, never a pending job whose encode stage claims done.
                ledger.reset_stages(job.id, Stage.DECODE, reason=problem)
                ledger.transition(job.id, JobEvent.INVALIDATE, reason=problem)
                say(f"{job.name}: {problem}; encoding it again")
            elif fixed := outputs.restore_params(out_dir, ledger, job):
                ledger.log(job.id, "params-rewritten", fixed)
                say(f"{job.name}: {fixed}; rewritten")


class Driver:
    def __init__(self, *, out_dir: Path, ledger: Ledger, executor: Executor, config: DriverConfig,
                 progress: RunProgress | None = None, on_job_end: Callable[[], None] | None = None):
        """``on_job_end``: called from the loop after any job finished or failed (e.g. to refresh
        the report); it must return quickly."""
        self.out_dir = Path(out_dir)
        self._on_job_end = on_job_end
        if progress is None:  # stderr only (the CLI passes one that also writes DIR/run.log)
            log = RunLog(None)
            progress = RunProgress(log=log, live=config.progress and log.is_terminal)
        self.progress = progress
        self.ledger = ledger
        self.ex = executor
        self.config = config
        self.pool = GroupPool(executor, total_gpus=executor.total_gpus(),
                              start_timeout_s=config.group_start_timeout_s)
        self._max_group = executor.max_group_size()  # a group's GPUs must all be on one node
        self._model_ids: dict[str, dict[str, str]] = {}  # model -> {model_id, text_encoder_id}
        self._loads: dict[tuple[str, str], LoadReply] = {}  # (group id, model) -> its load reply
        self._pending: deque[str] = deque()
        self._active: dict[str, _Active] = {}
        self._ended = self._ended_seen = 0  # jobs ended so far / when on_job_end was last called
        self._policy = RetryPolicy()
        self._redos: dict[str, int] = {}  # job id -> artifacts redone after failing their check
        self._stop: BaseException | None = None  # set on a full disk: start nothing more, then raise
        self._lost_since: float | None = None  # monotonic time the cluster lost a job's GPUs
        self._groups_seen: set[str] = set()  # groups whose placement the run log has told
        self._workers_seen: set[str] = set()  # groups whose worker start the run log has told

    # ================================================================== the loop
    def run(self, job_ids: list[str], *, prepared: bool = False) -> RunSummary:
        """Run the named jobs to done or failed. ``prepared``: prepare_jobs already ran (it decodes
        every done video to check it, so the CLI runs it once, before deciding to start Ray)."""
        t0 = time.monotonic()
        if not prepared:
            prepare_jobs(out_dir=self.out_dir, ledger=self.ledger, job_ids=job_ids,
                         retries=self.config.retries, say=self._say)
        jobs = self.ledger.jobs(job_ids)
        self._gpus = {j.id: j.spec.gpus for j in jobs}  # read once: the loop polls this per tick
        for job in jobs:
            if job.state is JobState.PENDING:
                if job.spec.gpus > self._max_group:
                    self._fail_unrunnable(job)
                else:
                    self._pending.append(job.id)
        now = self.ledger.jobs(job_ids)
        self.progress.begin(total=len(now), done=sum(j.state is JobState.DONE for j in now),
                            failed=sum(j.state is JobState.FAILED for j in now))
        try:
            while (self._pending and self._stop is None) or self._active:
                self.ex.check_cluster()
                self._dispatch()
                if not self._active:  # nothing running: a group is starting (or failed to)
                    self.pool.wait_for_start(self.config.poll_s)
                    continue
                calls = [a.call for a in self._active.values() if a.call is not None]
                for call in self.ex.wait(calls, timeout_s=self.config.poll_s):
                    self._on_ready(call)
                self._check_deadlines()
                if any(a.call is not None and isinstance(a.call.message, SampleCall) for a in self._active.values()):
                    self.progress.steps(self.ex.progress())  # a Ray call: only while a job samples
                self.progress.tick()
                self._notify_job_end()
        except KeyboardInterrupt as e:
            # The CLI raises it with a stop signal's name (Ray's calls may raise a bare one).
            why = e.args[0] if e.args else "Ctrl-C or a stop signal"
            for a in list(self._active.values()):
                self.ledger.transition(a.job.id, JobEvent.INTERRUPT, reason=f"interrupted ({why})")
                self.progress.job_ended(a.job.id, "interrupted")
            raise
        except ClusterLostError as e:
            for a in list(self._active.values()):
                self.ledger.transition(a.job.id, JobEvent.INTERRUPT, reason=f"the cluster was lost: {e}")
                self.progress.job_ended(a.job.id, "requeued", "the cluster was lost")
            if isinstance(e, GcsLost):
                left = sum(j.state is JobState.PENDING for j in self.ledger.jobs(job_ids))
                raise ClusterLostError(
                    f"{e}. The {left} unfinished job(s) are pending, none was charged an attempt for the "
                    f"loss; finished jobs are intact. Start the cluster again (`ray start --head` on its "
                    f"head node), then `pan2-render resume {self.out_dir}` (with --address naming the new "
                    f"head) finishes the batch") from e
            raise
        finally:
            self.progress.close()
            self.pool.close()
        if self._stop is not None:
            raise self._stop
        final = self.ledger.jobs(job_ids)
        return RunSummary(done=[j.id for j in final if j.state is JobState.DONE],
                          failed=[j.id for j in final if j.state is JobState.FAILED],
                          groups_created=self.pool.created, seconds=time.monotonic() - t0)

    def _dispatch(self) -> None:
        """Start pending jobs, in order, on groups. Strictly in order: when the head job's group
        size is not free, later jobs wait too, so a 4-GPU job is never starved by a stream of
        1-GPU jobs taking every GPU that frees up (the pool tears idle groups down for it).

        Where a job goes, best first: a group this driver holds whose GPU lane is free (its jobs
        only encode); an idle or new group from the pool; a held group whose GPU lane runs only a
        decode, the job's first call queued behind it."""
        if self._stop is not None or not self._cluster_ready():
            return
        for job_id in list(self._pending):
            size = self._gpus[job_id]
            group = self._held_group(size, behind_decode=False)
            try:
                group = group or self.pool.try_acquire(size)
            except GroupStartError as e:
                self._pending.remove(job_id)
                self.ledger.transition(job_id, JobEvent.START, reason="starting a group")
                # Charged to the stage the job would have run next; its finished stages (and their
                # artifacts) stay done.
                stage = self._next_stage(job_id)
                kind = self._unless_cluster_lost(FailureKind.UNKNOWN, self._gpus[job_id])
                self._on_failure(self.ledger.job(job_id), stage, str(e), None, kind)
                continue
            group = group or self._held_group(size, behind_decode=True)
            if group is None:
                break
            self._say_placed(group)
            self._pending.remove(job_id)
            self.ledger.transition(job_id, JobEvent.START,
                                   reason=f"on group {group.id} ({group.size} GPU(s))")
            active = _Active(job=self.ledger.job(job_id), group=group)
            self.progress.job_started(job_id, group=group.id, attempt=active.job.attempts)
            self._active[job_id] = active
            self._advance_or_fail(active)

    def _say_placed(self, group: Group) -> None:
        """The run log's start-up line of a group the first time it takes a job (stamps: seconds
        since the command started)."""
        if group.id in self._groups_seen:
            return
        self._groups_seen.add(group.id)
        if group.placed_at:
            joined = ", its processes joined" if group.size > 1 else ""
            self._say(f"start-up: group {group.id} ({group.size} GPU{'s' if group.size > 1 else ''}) placed at "
                      f"{stamp(group.placed_at)}{joined} (asked for at {stamp(group.asked_at)})")

    def _say_loaded(self, group: Group, model: str, load: LoadReply, seconds: float) -> None:
        """The run log's lines of a group's load: its worker's start (the first load only) and the
        load's phases in order (stamps: seconds since the command started)."""
        if load.worker is not None and group.id not in self._workers_seen:
            self._workers_seen.add(group.id)
            w = load.worker
            self._say(f"start-up: group {group.id} worker process (rank 0) started at "
                      f"{stamp(w.process_started_at)}, up at {stamp(w.ready_at)} "
                      f"(importing the worker {w.imports_s:.2f} s)")
        self._say(f"start-up: group {group.id} loaded {model} at {stamp()} in {seconds:.1f} s "
                  f"(pipeline {load.load_s:.1f} s, warm-up {load.warmup_s:.1f} s): "
                  f"{describe_phases(load.phases, total=seconds) or 'no phases reported'}")

    def _jobs_on(self, group: Group) -> list[_Active]:
        return [a for a in self._active.values() if a.group is group]

    def _held_group(self, size: int, *, behind_decode: bool) -> Group | None:
        """A group of ``size`` this driver holds (it has active jobs) that can take one more job:
        its GPU lane is free (or, with ``behind_decode``, runs only a decode) and its encodes,
        counting that decode's, stay within MAX_ENCODES_IN_FLIGHT."""
        held = {id(a.group): a.group for a in self._active.values() if a.group.size == size}
        for group in held.values():
            jobs = self._jobs_on(group)
            on_gpu = [a for a in jobs if not a.encoding]
            if not on_gpu:
                free = True
            else:
                free = behind_decode and len(on_gpu) == 1 and on_gpu[0].decoding
            if free and len(jobs) < MAX_ENCODES_IN_FLIGHT:
                return group
        return None

    def _leave(self, a: _Active) -> None:
        """The job no longer runs on its group; the group goes back to the pool once it holds no job."""
        del self._active[a.job.id]
        if not self._jobs_on(a.group):
            self.pool.release(a.group)

    def _next_stage(self, job_id: str) -> Stage:
        """The first stage of the job that is not done (the one a failure now belongs to)."""
        st = self.ledger.stages(job_id)
        return next((s for s in st if st[s].state is not StageState.DONE), Stage.ENCODE)

    def _advance_or_fail(self, a: _Active) -> None:
        """_advance, with a driver-side problem (input image gone or changed, unreadable cache
        file) recorded as the failure of the stage the job was about to run."""
        try:
            self._advance(a)
        except Exception as e:  # noqa: BLE001
            stage = self._next_stage(a.job.id)
            self._leave(a)
            self._on_failure(self.ledger.job(a.job.id), stage, f"driver: {type(e).__name__}: {e}",
                             traceback.format_exc(), classify_exception(e), e)

    def _advance(self, a: _Active) -> None:
        """Issue the next call for the job, or finish it. Decided from the ledger + the disk."""
        spec, jid = a.job.spec, a.job.id
        if self._stop is not None:  # e.g. the disk is full: this job goes back to pending, uncharged
            self._leave(a)
            self._requeue(jid, "the output folder refused a write: the batch stops; `resume` continues")
            return None
        st = self.ledger.stages(jid)
        if st[Stage.ENCODE].state is StageState.DONE:  # (a driver died between the two writes)
            return self._finish(a)
        if a.encoding:
            return self._start_call(a, CollectCall(job_id=jid))
        if spec.model not in a.group.models:
            # Warm-up (compiles, autotuning) at this job's size, once per group: load time, not
            # the first job's stage times.
            warmup = Warmup(height=spec.height, width=spec.width, frames=spec.frames, guidance=spec.guidance)
            return self._start_call(a, LoadCall(model=spec.model, warmup=warmup))
        ids = self._model_ids[spec.model]
        if st[Stage.SAMPLING].state is StageState.DONE:
            rec = st[Stage.SAMPLING]
            problem = stages.check_latents(self.out_dir, stages.Recorded(rec.artifact, rec.sha256, rec.size),
                                           spec_hash=spec.spec_hash)
            if problem is None:
                latents = (self.out_dir / str(rec.artifact)).read_bytes()
                return self._start_call(a, DecodeCall(model=spec.model, job_id=jid, spec=spec.to_dict(),
                                                      latents=latents))
            self._count_redo(jid, problem)
            self.ledger.reset_stages(jid, Stage.SAMPLING, reason=f"{problem}: sampling again")
            self._say(f"{spec.name}: {problem}; sampling again")
        # Conditioning: the embedding cache is content-addressed (prompt + text encoder id).
        texts = (spec.prompt, spec.negative_prompt)
        keys = [stages.embedding_key(prompt=t, text_encoder_id=ids["text_encoder_id"]) for t in texts]
        problems = {t: p for t, k in zip(texts, keys)
                    if (p := stages.check_embedding(self.out_dir, stages.embedding_relpath(k), key=k))}
        missing = list(problems)
        if a.encode_texts and missing:  # written by this job's own encode and already rejected
            self._count_redo(jid, problems[missing[0]])
        if missing:
            # prompt == negative prompt: encode once; upcoming jobs' prompts ride along.
            a.encode_texts = list(dict.fromkeys(missing + self._upcoming_texts(spec.model, ids)))
            a.encode_texts = a.encode_texts[:max(CONDITIONING_AHEAD_TEXTS, len(missing))]
            return self._start_call(a, EncodePromptsCall(model=spec.model, texts=tuple(a.encode_texts)))
        if st[Stage.CONDITIONING].state is not StageState.DONE:
            self._record_conditioning(jid, keys[0], seconds=0.0)
        embeds = [(self.out_dir / stages.embedding_relpath(k)).read_bytes() for k in keys]
        if spec.weights is not None and folder_fingerprint(Path(spec.model))[0] != spec.weights:
            # The id promises these weights; rendering others under it would mislabel the video.
            raise JobInputError(f"the weights in {spec.model} changed since the batch was validated "
                                f"(fingerprint differs); run the batch again: its jobs get new ids")
        image = None
        if spec.image is not None:
            try:
                image = Path(spec.image).read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
                # The input is gone or unreadable; retrying reads the same path.
                raise JobInputError(f"image {spec.image} cannot be read ({type(e).__name__}: {e.strerror or e}); "
                                    f"restore it or run the batch again with another image") from e
            if spec.image_sha256 and stages.sha256_bytes(image) != spec.image_sha256:
                # The spec hash covers the image's content; rendering a changed file under the old
                # id would mislabel the video.
                raise JobInputError(f"image {spec.image} changed since the batch was validated "
                                     f"(sha256 differs); run the batch again to render the new image")
        return self._start_call(a, SampleCall(model=spec.model, job_id=jid, spec=spec.to_dict(),
                                              prompt_embeds=embeds[0], negative_embeds=embeds[1], image=image))

    def _upcoming_texts(self, model: str, ids: dict[str, str]) -> list[str]:
        """Prompts of pending jobs of ``model`` with no file in the embedding cache, in queue order.

        Only whether the file exists: reading and checking every cached embedding of a long queue
        on each look-ahead would cost more than it saves. A damaged one is found, and encoded
        again, when its own job reaches conditioning."""
        texts: list[str] = []
        for job in self.ledger.jobs(list(self._pending)):
            if job.spec.model != model:
                continue
            for text in (job.spec.prompt, job.spec.negative_prompt):
                key = stages.embedding_key(prompt=text, text_encoder_id=ids["text_encoder_id"])
                if text not in texts and not (self.out_dir / stages.embedding_relpath(key)).is_file():
                    texts.append(text)
            if len(texts) >= CONDITIONING_AHEAD_TEXTS:
                break
        return texts

    def _start_call(self, a: _Active, message: WorkerCall) -> None:
        if message.marks_stage and message.stage is not None:
            self.ledger.set_stage(a.job.id, message.stage, StageState.RUNNING)
        self.progress.stage(a.job.id, message.shown)
        a.call = self.ex.call(a.group, message, timeout_s=self.config.call_timeouts_s[message.timeout_key])

    # ================================================================== results
    def _on_ready(self, call: Call) -> None:
        a = next((x for x in self._active.values() if x.call is call), None)
        if a is None:
            return  # its job left when its group was torn down: the reply is void
        a.call = None
        stage = _stage_of(call.message)
        try:
            reply = self.ex.result(call)
        except GroupDied as e:
            return self._on_group_died(a, stage, str(e), e.kind)
        if not reply.ok:
            return self._on_worker_error(a, call.message, reply)
        try:
            self._apply(a, reply)
        except Exception as e:  # noqa: BLE001 - e.g. disk full, or the written video fails its check
            self._leave(a)
            return self._on_failure(self.ledger.job(a.job.id), stage, f"driver: {type(e).__name__}: {e}",
                                    traceback.format_exc(), classify_exception(e), e)
        self._advance_or_fail(a)

    def _apply(self, a: _Active, reply: Reply[object]) -> None:
        """Write the artifact (temp + rename), then record it in the ledger."""
        jid, spec = a.job.id, a.job.spec
        match reply.value:
            case LoadReply() as load:
                a.group.models.add(spec.model)
                self._model_ids[spec.model] = {"model_id": load.model_id, "text_encoder_id": load.text_encoder_id}
                self._loads[(a.group.id, spec.model)] = load
                self.ledger.log(jid, "group-load",
                                f"group {a.group.id}: {spec.model} ({load.model_id}) loaded on "
                                f"{load.world_size} rank(s), device {load.device}, process group backend "
                                f"{load.backend}, attention {load.attention}, {reply.seconds:.1f} s "
                                f"(weights {load.load_s:.1f} s, warm-up {load.warmup_s:.1f} s)"
                                + (f": {describe_phases(load.phases, total=reply.seconds)}" if load.phases else ""))
                self._say_loaded(a.group, spec.model, load, reply.seconds)
            case EncodePromptsReply(embeddings=embeddings):
                ids = self._model_ids[spec.model]
                for text, data in zip(a.encode_texts, embeddings, strict=True):
                    key = stages.embedding_key(prompt=text, text_encoder_id=ids["text_encoder_id"])
                    stages.write_artifact(self.out_dir, stages.embedding_relpath(key), data)
                key = stages.embedding_key(prompt=spec.prompt, text_encoder_id=ids["text_encoder_id"])
                self._record_conditioning(jid, key, seconds=reply.seconds)
                self.ledger.log(jid, "conditioning", f"{len(a.encode_texts)} prompt(s) encoded in one call, "
                                                     f"{reply.seconds:.2f} s")
            case SampleReply(latents=data):
                rel = stages.latents_relpath(jid)
                stages.write_artifact(self.out_dir, rel, data)
                self.ledger.set_stage(jid, Stage.SAMPLING, StageState.DONE, artifact=rel,
                                      sha256=stages.sha256_bytes(data), size=len(data), seconds=reply.seconds)
            case DecodeReply(decode_s=decode_s):
                # Decode's output is not durable: decode is recorded done together with the encode.
                a.decode_s = decode_s
                self.ledger.set_stage(jid, Stage.ENCODE, StageState.RUNNING)
            case CollectReply() as collected:
                self._record_video(a, collected)
            case other:
                raise TypeError(f"unexpected reply {type(other).__name__} from group {a.group.id}")

    def _record_video(self, a: _Active, collected: CollectReply) -> None:
        jid, spec = a.job.id, a.job.spec
        mp4, encode_s, check_s = collected.mp4, collected.encode_s, collected.check_s
        # params.json first: a write that fails between the two then leaves no video that the
        # ledger does not record (a lone params.json is rewritten with the next attempt).
        seconds = {s.value: r.seconds for s, r in self.ledger.stages(jid).items()}
        seconds.update(decode=a.decode_s, encode=encode_s + check_s)
        load = self._loads.get((a.group.id, spec.model))
        params = outputs.write_params(self.out_dir, job=a.job, seconds=seconds,
                                      load=None if load is None else dataclasses.asdict(load))
        rel = stages.video_relpath(jid)
        stages.write_artifact(self.out_dir, rel, mp4)
        rec = stages.Recorded(rel, stages.sha256_bytes(mp4), len(mp4))
        # The worker decoded these very bytes back and counted the spec's frames at the spec's
        # size before sending them (encode_mp4, after decode checked the frames' shape), so the
        # file needs only to hold the same bytes. Decoding it again here would stall the loop,
        # and so the GPU's next call, for seconds per 720p video. Resume still decodes it.
        problem = stages.check_recorded(self.out_dir, rec)
        if problem:
            raise RuntimeError(f"the written video does not check out: {problem}")
        self.ledger.set_stages(jid, [
            (Stage.DECODE, StageState.DONE, {"seconds": a.decode_s}),
            (Stage.ENCODE, StageState.DONE, {"artifact": rel, "sha256": rec.sha256, "size": rec.size,
                                             "seconds": encode_s + check_s}),
        ], documents={outputs.PARAMS_NAME: params})
        self.ledger.log(jid, "encode", f"libx264 {encode_s:.2f} s, decode-back check {check_s:.2f} s, "
                                       f"{len(mp4)} bytes")

    def _record_conditioning(self, jid: str, key: str, *, seconds: float) -> None:
        rel = stages.embedding_relpath(key)
        data = (self.out_dir / rel).read_bytes()
        self.ledger.set_stage(jid, Stage.CONDITIONING, StageState.DONE, artifact=rel,
                              sha256=stages.sha256_bytes(data), size=len(data), seconds=seconds)

    def _finish(self, a: _Active) -> None:
        self._leave(a)
        self.ledger.transition(a.job.id, JobEvent.FINISH, reason="video.mp4 written and checked")
        self.progress.job_ended(a.job.id, "done")
        self._ended += 1

    # ================================================================== failures
    def _on_group_died(self, a: _Active, stage: Stage, reason: str, kind: FailureKind) -> None:
        msg = f"worker group {a.group.id} died or stopped answering: {reason}"
        self._on_call_failed(a, stage, msg, None, self._unless_cluster_lost(kind, a.group.size), died=True)

    def _on_worker_error(self, a: _Active, message: WorkerCall, reply: Reply[object]) -> None:
        assert reply.failure is not None
        self._on_call_failed(a, _stage_of(message), f"rank {reply.rank}: {reply.failure.error}",
                             reply.failure.traceback, reply.failure.kind, io_lane=message.lane is Lane.IO)

    def _on_call_failed(self, a: _Active, stage: Stage, msg: str, tb: str | None, kind: FailureKind, *,
                        io_lane: bool = False, died: bool = False) -> None:
        """A call of ``a`` failed on its group: one decision (retry.py) says what becomes of the job
        and whether the group takes the next job or is torn down."""
        job = self.ledger.job(a.job.id)
        decision = self._policy.decide(job, kind, stage, msg, on_group=OnGroup(size=a.group.size, io_lane=io_lane))
        if decision.keep_group:
            self._leave(a)  # only this job's call failed; the group goes on
            return self._record_failure(job, stage, msg, tb, kind, decision)
        if not died:
            self.ledger.log(a.job.id, "group-discarded", f"group {a.group.id} after [{kind.value}]: {msg}")
        others = self._drop_group(a, msg)
        self._record_failure(job, stage, msg, tb, kind, decision)
        self._fail_others(a, others, msg, kind)

    def _drop_group(self, a: _Active, msg: str) -> list[_Active]:
        """Tear ``a``'s group down; every job on it leaves it. Returns the jobs other than ``a``."""
        others = [x for x in self._jobs_on(a.group) if x is not a]
        self.pool.discard(a.group)
        for x in [a, *others]:
            del self._active[x.job.id]
        self.ledger.log(a.job.id, "group-died", msg)
        return others

    def _fail_others(self, a: _Active, others: list[_Active], msg: str, kind: FailureKind) -> None:
        """Every other job the torn-down group owned (one queued on its GPU lane, ones encoding)
        fails where it stood, as a worker death (as cluster-lost when ``a``'s failure was: they
        were on the same lost node); each goes back from its last durable stage."""
        group = a.group
        for x in others:
            x_stage = _stage_of(x.call.message) if x.call is not None else self._next_stage(x.job.id)
            x_msg = f"group {group.id} was torn down (after job {a.job.name}: {msg.splitlines()[0][:300]})"
            self.ledger.log(x.job.id, "group-died", x_msg)
            x_kind = (kind if kind is FailureKind.CLUSTER_LOST
                      else self._unless_cluster_lost(FailureKind.WORKER_DEATH, group.size))
            self._on_failure(self.ledger.job(x.job.id), x_stage, x_msg, None, x_kind)

    def _on_failure(self, job: JobRecord, stage: Stage, error: str, tb: str | None,
                    kind: FailureKind, cause: BaseException | None = None) -> None:
        """A failure of a job off any group (a driver write, a group that never formed, a job of a
        group torn down for another): decided by retry.py, then recorded."""
        decision = self._policy.decide(job, kind, stage, error)
        self._record_failure(job, stage, error, tb, kind, decision, cause)

    def _record_failure(self, job: JobRecord, stage: Stage, error: str, tb: str | None, kind: FailureKind,
                        decision: Decision, cause: BaseException | None = None) -> None:
        """Carry a decision out: the job is re-queued, retried or failed, and the ledger says why."""
        line = f"{stage.value}: [{kind.value}] {error.splitlines()[0][:200] if error else ''}"
        if decision.action is Action.REQUEUE:
            if decision.stop_batch and self._stop is None:
                self._stop = BatchStopped(cause or RuntimeError(error))
            if kind is FailureKind.CLUSTER_LOST and self._lost_since is None:
                self._lost_since = time.monotonic()
            self._requeue(job.id, f"{decision.reason}: {error}")
            self.progress.job_ended(job.id, "requeued", f"{line}; {decision.reason}")
            return
        self.ledger.set_stage(job.id, stage, StageState.FAILED, error=error, traceback=tb)
        if decision.action is Action.RETRY:
            self.ledger.transition(job.id, JobEvent.RETRY, error=error, error_stage=stage,
                                   reason=f"{stage.value} failed [{kind.value}], {decision.reason}: {error}")
            self._pending.append(job.id)
            self.progress.job_ended(job.id, "retry", line)
        else:
            self.ledger.transition(job.id, JobEvent.FAIL, error=f"{error} [{kind.value}: {decision.reason}]",
                                   error_stage=stage,
                                   reason=f"{stage.value} failed [{kind.value}] ({decision.reason}): {error}")
            self.progress.job_ended(job.id, "FAILED", f"{line}; {decision.reason}")
            self._ended += 1

    def _requeue(self, job_id: str, reason: str) -> None:
        """Back to pending without charging the job (the environment failed, not the job). If the
        ledger cannot record it (the disk that filled holds it too), the job stays "running" there,
        which the next run or resume treats as interrupted: the same outcome."""
        try:
            self.ledger.transition(job_id, JobEvent.INTERRUPT, reason=reason)
        except sqlite3.OperationalError as e:
            if not is_disk_full(e):
                raise
        if self._stop is None:
            self._pending.append(job_id)

    def _unless_cluster_lost(self, kind: FailureKind, gpus: int) -> FailureKind:
        """``kind``, or cluster-lost when the cluster no longer has the GPUs such a group needs
        (a node died): then the failure is not the job's."""
        try:
            available = self.ex.total_gpus()
        except Exception:  # noqa: BLE001 - the cluster cannot even be asked: it is gone
            available = 0
        return FailureKind.CLUSTER_LOST if available < gpus else kind

    def _cluster_ready(self) -> bool:
        """After the cluster lost GPUs: have enough come back for every pending job? Raises
        ClusterLostError once they have been gone for ``cluster_wait_s``."""
        if self._lost_since is None:
            return True
        need = max((self._gpus[j] for j in self._pending), default=0)
        try:
            available = self.ex.total_gpus()
        except Exception:  # noqa: BLE001
            available = 0
        if available >= need:
            self.pool.total_gpus = available
            self._lost_since = None
            self._say(f"the cluster has {available} GPU(s) again; continuing")
            return True
        waited = time.monotonic() - self._lost_since
        if waited > self.config.cluster_wait_s and not self._active:  # running jobs finish first
            raise ClusterLostError(
                f"{self.ex.cluster} lost its GPUs ({available} left, {need} needed) and they did not come back "
                f"within {self.config.cluster_wait_s:.0f} s; the {len(self._pending)} unfinished job(s) are "
                f"pending, none was charged an attempt. Bring the node(s) back (`ray status` on the head "
                f"shows them), then `pan2-render resume {self.out_dir}`")
        return False

    def _count_redo(self, job_id: str, problem: str) -> None:
        """A check rejected one of the job's artifacts, which is about to be redone: allowed
        ``max_redos`` times in a run, then the job fails with the check's reason (so an artifact
        that keeps failing its check can never loop)."""
        n = self._redos.get(job_id, 0) + 1
        self._redos[job_id] = n
        if n > self.config.max_redos:
            raise ArtifactCheckError(f"an artifact failed its check {n} times in this run, even freshly "
                                     f"written: {problem}")

    def _fail_unrunnable(self, job: JobRecord) -> None:
        msg = (f"needs a group of {job.spec.gpus} GPUs but the cluster has {self.pool.total_gpus} "
               f"(at most {self._max_group} on one node, and a group must sit on one node); lower "
               f"`gpus` or add GPUs (--cpu-gpus N on a CPU-only machine)")
        self.ledger.set_stage(job.id, Stage.CONDITIONING, StageState.FAILED, error=msg)
        self.ledger.transition(job.id, JobEvent.FAIL, error=msg, error_stage=Stage.CONDITIONING,
                               reason=msg)
        self.progress.job_ended(job.id, "FAILED", msg)
        self._ended += 1

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for a in list(self._active.values()):
            if a.job.id not in self._active:
                continue  # failed with a group torn down for an earlier job of this loop
            if a.call is not None and now - a.call.started > a.call.timeout_s:
                message, limit = a.call.message, a.call.timeout_s
                a.call = None
                self._on_group_died(a, _stage_of(message), f"no reply to {type(message).__name__} within its "
                                                           f"{limit:.0f} s deadline", FailureKind.WORKER_DEATH)

    def _notify_job_end(self) -> None:
        if self._on_job_end is not None and self._ended != self._ended_seen:
            self._ended_seen = self._ended
            self._on_job_end()

    def _say(self, text: str) -> None:
        self.progress.say(text)
