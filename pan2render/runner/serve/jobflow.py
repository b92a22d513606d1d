"""A job's stage flow, declared once: which worker call each stage makes, what it leaves on disk,
how that is checked on resume and rebuilt by ``repair``, and how its reply is recorded. The
stages every batch runs are declared in ``serve/steps.py`` (:data:`~pan2render.runner.serve.steps.PAN2_FLOW`).

Before a job's first stage a group must hold its model (``LoadCall``, once per group and model:
the group's work, charged to the job that asked for it when it fails).

Which call comes next (:meth:`BatchFlow.next_call`) is decided from the ledger and the disk,
from the last stage backwards: the job restarts after its latest stage whose result still checks
out, so a job re-queued after a crash, or resumed by another process, loses only what was not
durable. A stage whose recorded artifact fails its check is reset (with every later stage) and
redone, a bounded number of times (``max_redos``).

The scheduler (``scheduler.py``) decides only which job runs on which group; everything about what a
job does next lives here. A new stage is a new :class:`Step` in a flow (docs/architecture.md,
"Adding a stage"): the ledger gets a row for it, the scheduler runs it, resume checks it and
``repair`` rebuilds it, without a change anywhere else but the worker's handler for its call.
"""

from __future__ import annotations

import enum
import json
import os
import re
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pan2render.jobs import outdir
from pan2render.jobs.ledger import (
    EventKind,
    JobEvent,
    Ledger,
    Stage,
    StageEvent,
    StageRecord,
    StageState,
    stage_name,
)
from pan2render.jobs.spec import JobSpec
from pan2render.lanes import FastLanes
from pan2render.phases import describe as describe_phases
from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.failures import ArtifactCheckError, Failure, FailureKind, classify_exception
from pan2render.runner.protocol.messages import CheckpointReply, LoadCall, LoadReply, Warmup, WorkerCall
from pan2render.runner.protocol.timeline import stamp
from pan2render.runner.serve.attempt import JobRun
from pan2render.runner.serve.retry import Action, Decision
from pan2render.step_checkpoint import StepCheckpointError, read_checkpoint

# A text asked of an encode call counts as being encoded for this long at most (a call takes well
# under a second; one that failed or whose group died never answers).
ENCODING_FORGOTTEN_S = 60.0


class StepStatus(enum.Enum):
    """Where a step stands: its result is there and checks out (DONE), or it is still to do."""

    DONE = "done"
    TO_DO = "to do"


@dataclass(frozen=True)
class Redo:
    """The step's recorded result failed its check: reset it and every later stage, then redo it."""

    problem: str


Status = StepStatus | Redo


# ---------------------------------------------------------------------- the steps
class Step:
    """One stage of a flow. Subclasses set the class attributes and override what they need.

    ``status`` is asked from the last step backwards until one is DONE; the next step's ``call``
    is then made and its reply handed to ``record``. ``proof`` is what ``repair`` reads: the stage
    row's fields when the disk proves the stage done for ``spec``, else None.
    """

    stage: ClassVar[Stage | str]
    calls: ClassVar[tuple[type[WorkerCall], ...]]  # the calls it makes, whose replies it records
    # Its result is a file of this job (repair can prove it from the disk); False: a shared cache
    # or nothing durable, so the stage counts as done once a later stage is proven.
    per_job_artifact: ClassVar[bool] = True

    def status(self, flow: BatchFlow, run: JobRun, rec: StageRecord) -> Status:
        return StepStatus.DONE if rec.state is StageState.DONE else StepStatus.TO_DO

    def call(self, flow: BatchFlow, run: JobRun) -> WorkerCall:
        raise NotImplementedError

    def record(self, flow: BatchFlow, run: JobRun, value: Any, seconds: float) -> None:
        raise NotImplementedError

    def proof(self, out_dir: Path, spec: JobSpec) -> dict[str, Any] | None:
        return None


def file_proof(out_dir: Path, relpath: str) -> tuple[artifacts.Recorded, dict[str, Any]] | None:
    """What a regular file on disk is, as a stage row would record it (None: no such file)."""
    path = out_dir / relpath
    if not path.is_file() or path.is_symlink():
        return None
    data = path.read_bytes()
    rec = artifacts.Recorded(relpath, artifacts.sha256_bytes(data), len(data))
    return rec, {"artifact": relpath, "sha256": rec.sha256, "size": rec.size}


# ---------------------------------------------------------------------- what the ledger's reasons say
_FAILED = re.compile(r"(?:\S+ failed|not started) \[([a-z-]+)\]")
_LOAD_SECONDS = re.compile(r", (\d+(?:\.\d+)?) s \(weights ")  # in the detail BatchFlow.record_load writes


def failed_reason(stage: str, kind: FailureKind) -> str:
    """How the reason of a retry or a failure the flow records begins (``record_failure``)."""
    return f"{stage} failed [{kind.value}]"


def unstarted_reason(kind: FailureKind) -> str:
    """How the reason of a job that failed without starting begins (``end_unstarted``)."""
    return f"not started [{kind.value}]"


def failure_class(reason: str) -> str | None:
    """The failure class a reason :func:`failed_reason` or :func:`unstarted_reason` began names
    (None: another reason)."""
    found = _FAILED.match(reason)
    return found.group(1) if found else None


def load_seconds(detail: str) -> float | None:
    """The seconds a group's load took, from the detail of its GROUP_LOAD event."""
    found = _LOAD_SECONDS.search(detail)
    return float(found.group(1)) if found else None


# ---------------------------------------------------------------------- the flow
@dataclass(frozen=True)
class JobFlow:
    """An ordered declaration of stages. The last step's result is the job's output."""

    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        names = [stage_name(s.stage) for s in self.steps]
        if len(set(names)) != len(names):
            raise ValueError(f"a flow's stages must be distinct: {names}")
        calls = [c for s in self.steps for c in s.calls]
        if len(set(calls)) != len(calls):
            raise ValueError("a worker call belongs to one step only")

    @property
    def stages(self) -> tuple[str, ...]:
        """The ledger's stage names, in order."""
        return tuple(stage_name(s.stage) for s in self.steps)

    def step_of(self, message: WorkerCall) -> Step | None:
        """The step that made ``message`` (None: the group's load or set-up)."""
        return next((s for s in self.steps if isinstance(message, s.calls)), None)

    def proven(self, out_dir: Path, spec: JobSpec) -> tuple[bool, dict[str, dict[str, Any]]]:
        """What the disk proves of one job, for ``repair``: (done, stage name -> stage row fields).

        The latest step whose artifact checks out is done, and so is every earlier step that has
        no artifact of its own (a shared cache, frames): the later result consumed them. An
        earlier step with an artifact of its own is done only if that artifact checks out too."""
        done: dict[str, dict[str, Any]] = {}
        latest = -1
        for i in reversed(range(len(self.steps))):
            if (fields := self.steps[i].proof(out_dir, spec)) is not None:
                latest = i
                done[self.stages[i]] = fields
                break
        for step, name in list(zip(self.steps, self.stages, strict=True))[:max(latest, 0)]:
            if not step.per_job_artifact:
                done[name] = {}
            elif (fields := step.proof(out_dir, spec)) is not None:
                done[name] = fields
        return latest == len(self.steps) - 1, done




# ---------------------------------------------------------------------- a flow serving one batch
class Upcoming(Protocol):
    """A queued job as the prompts encoded ahead see it (the scheduler's ``QueuedJob``)."""

    @property
    def model(self) -> str: ...

    @property
    def prompts(self) -> tuple[str, ...]: ...  # the texts it is conditioned on (long_video.job_texts)


class BatchFlow:
    """A flow bound to one output folder and its ledger: decides each job's next call, records
    replies and failures there. One per batch; the scheduler holds one for every batch it serves.

    ``upcoming``: the pending jobs of the batch in queue order, their model and prompts (for the
    prompts encoded ahead);
    ``say``: a line for the run log."""

    def __init__(self, *, out_dir: Path, ledger: Ledger, flow: JobFlow, max_redos: int = 2,
                 upcoming: Callable[[], Iterable[Upcoming]] = lambda: (), say: Callable[[str], None] = print,
                 models_per_group: int | None = None):
        """``models_per_group``: most models a group keeps loaded (a load for one more drops the
        others first; the farm keeps one); None: no limit, every model a batch names stays."""
        if ledger.stage_names != flow.stages:
            raise ValueError(f"the ledger {ledger.path} records the stages {list(ledger.stage_names)}, the flow "
                             f"declares {list(flow.stages)}: a batch runs with the flow it was recorded with")
        self.out_dir = Path(out_dir)
        self.ledger = ledger
        self.flow = flow
        self.max_redos = max_redos
        self._upcoming = upcoming
        self.say = say
        self.models_per_group = models_per_group
        self._encoders: dict[str, str] = {}  # model -> its text encoder id, from a group's load
        self._encoding: dict[str, float] = {}  # text -> when a call in flight was asked to encode it
        self.proven = artifacts.Proven()  # artifacts checked once, not again while unchanged
        self._redos: dict[str, int] = {}  # job id -> artifacts redone after failing their check

    # ------------------------------------------------------------------ what comes next
    def next_call(self, run: JobRun) -> WorkerCall | None:
        """The job's next call on its group, or None when the job is finished. Raises what a
        driver-side check raises (an input gone or changed: JobInputError)."""
        spec = run.job.spec
        if spec.model not in run.group.loads:
            # Warm-up (compiles, autotuning) at this job's size, once per group: load time, not
            # the first job's stage times.
            held = list(run.group.loads)
            limit = self.models_per_group
            unload = tuple(held[:len(held) - limit + 1]) if limit is not None and len(held) >= limit else ()
            return LoadCall(model=spec.model, unload=unload,
                            warmup=Warmup(height=spec.height, width=spec.width, frames=spec.frames,
                                          guidance=spec.guidance, image=spec.image is not None or spec.segments > 1))
        self._encoders.setdefault(spec.model, run.group.loads[spec.model].text_encoder_id)
        steps, names = self.flow.steps, self.flow.stages
        start, records = 0, self.ledger.stages(run.job.id)
        for i in reversed(range(len(steps))):
            status = steps[i].status(self, run, records[names[i]])
            if status is StepStatus.DONE:
                start = i + 1
                break
            if isinstance(status, Redo):
                self.count_redo(run.job.id, status.problem)
                self.ledger.reset_stages(run.job.id, names[i], reason=f"{status.problem}: {names[i]} again")
                self.say(f"{spec.name}: {status.problem}; {names[i]} again")
                records = self.ledger.stages(run.job.id)
        if start == len(steps):
            return None
        return steps[start].call(self, run)

    def record(self, run: JobRun, message: WorkerCall, value: Any, seconds: float) -> None:
        """Write what a call returned (temp name + rename), then record it in the ledger."""
        if isinstance(message, LoadCall):
            return self.record_load(run, value, seconds)
        step = self.flow.step_of(message)
        if step is None:
            raise TypeError(f"no step of the flow makes {type(message).__name__}")
        step.record(self, run, value, seconds)

    def finish(self, run: JobRun) -> None:
        self.ledger.transition(run.job.id, JobEvent.FINISH, reason="video.mp4 written and checked")
        # A done job's live preview goes: its video (and the report's poster of it) shows what it
        # is, and a picture of an earlier step left beside them would pass for the result. A job
        # that ends otherwise keeps its last preview, the last look at it (status, the report).
        (self.out_dir / artifacts.preview_relpath(run.job.id)).unlink(missing_ok=True)
        self.proven.forget(self.out_dir / artifacts.latents_relpath(run.job.id))  # (its video is what counts now)

    def fail_unrunnable(self, job_id: str, reason: str) -> None:
        """A job that can never run here (it needs more GPUs than a node has): failed at its first
        stage, never started."""
        first = self.flow.stages[0]
        self.ledger.set_stage(job_id, first, StageEvent.FAIL, error=reason)
        self.ledger.transition(job_id, JobEvent.FAIL, error=reason, error_stage=first, reason=reason)

    def end_unstarted(self, job_id: str, event: JobEvent, why: str) -> None:
        """A queued job ends without having started, as a job it runs after did (``event``: fail or
        cancel), with ``why``. Failed, its reason names the class (dependency), as the flow's other
        failures name theirs; no stage row is touched: none ran."""
        if event is JobEvent.FAIL:
            self.ledger.transition(job_id, event, error=why,
                                   reason=f"{unstarted_reason(FailureKind.DEPENDENCY)}: {why}")
        else:
            self.ledger.transition(job_id, event, reason=why)

    def next_stage(self, job_id: str) -> str:
        """The first stage of the job that is not done (the one a failure now belongs to)."""
        st = self.ledger.stages(job_id)
        return next((name for name in self.flow.stages if st[name].state is not StageState.DONE),
                    self.flow.stages[-1])

    # ------------------------------------------------------------------ failures
    def driver_failure(self, job_id: str, e: Exception) -> Failure:
        """A failure of the job on the driver's side (an input gone, a write refused, an artifact that
        fails its check), charged to the stage it was about to run, classed by the exception."""
        return Failure(stage=self.next_stage(job_id), kind=classify_exception(e),
                       error=f"driver: {type(e).__name__}: {e}", traceback=traceback.format_exc(), cause=e)

    def record_failure(self, job_id: str, failure: Failure, decision: Decision) -> None:
        """Carry a decision out in the ledger: the job goes back to pending (requeue: uncharged;
        retry: one attempt spent) or fails, with the stage's error and traceback."""
        if decision.action is Action.REQUEUE:
            self.ledger.transition(job_id, JobEvent.INTERRUPT, reason=f"{decision.reason}: {failure.message}")
            return
        self.ledger.set_stage(job_id, failure.stage, StageEvent.FAIL, error=failure.message,
                              traceback=failure.traceback)
        failed = failed_reason(stage_name(failure.stage), failure.kind)
        if decision.action is Action.RETRY:
            self.ledger.transition(job_id, JobEvent.RETRY, error=failure.message, error_stage=failure.stage,
                                   reason=f"{failed}, {decision.reason}: {failure.message}")
        else:
            self.ledger.transition(job_id, JobEvent.FAIL, error_stage=failure.stage,
                                   error=f"{failure.message} [{failure.kind.value}: {decision.reason}]",
                                   reason=f"{failed} ({decision.reason}): {failure.message}")

    def count_redo(self, job_id: str, problem: str) -> None:
        """A check rejected one of the job's artifacts, which is about to be redone: allowed
        ``max_redos`` times in a run, then the job fails with the check's reason (so an artifact
        that keeps failing its check can never loop)."""
        n = self._redos.get(job_id, 0) + 1
        self._redos[job_id] = n
        if n > self.max_redos:
            raise ArtifactCheckError(f"an artifact failed its check {n} times in this run, even freshly "
                                     f"written: {problem}")

    # ------------------------------------------------------------------ shared by the steps
    def text_encoder_id(self, model: str) -> str:
        return self._encoders[model]

    def encoding(self, texts: Iterable[str], *, asked: bool) -> None:
        """``texts`` were asked of a call in flight (``asked``), or its answer came."""
        for text in texts:
            if asked:
                self._encoding[text] = time.monotonic()
            else:
                self._encoding.pop(text, None)

    def being_encoded(self, text: str) -> bool:
        """Is ``text`` being encoded by a call in flight? (A call whose answer never came, its group
        lost, frees its texts after ENCODING_FORGOTTEN_S.)"""
        asked = self._encoding.get(text)
        if asked is not None and time.monotonic() - asked > ENCODING_FORGOTTEN_S:
            del self._encoding[text]
            asked = None
        return asked is not None

    # ------------------------------------------------------------------ step checkpoints
    def step_checkpoint(self, run: JobRun) -> bytes | None:
        """The job's step checkpoint to continue its sampling from, if one is on disk and checks out
        for this job and model; one that does not is dropped, with why. The file carries its own
        digest and key, so it is checked on its own, not against the ledger's record of it: a
        driver killed after renaming a newer checkpoint into place and before recording it leaves
        that newer file, as good a place to continue from (and one killed before recording its
        first leaves a file with no record)."""
        rel = artifacts.step_checkpoint_relpath(run.job.id)
        path = self.out_dir / rel
        if self.ledger.document(run.job.id, artifacts.STEP_CHECKPOINT_DOC) is None and not path.is_file():
            return None
        if not FastLanes.of(run.job.spec.sample_args()).steps_exact:
            # The worker would refuse it too, but only in its reply, once the sampling has run:
            # until then `status` would show the restarted sampling behind a checkpoint it does not
            # continue from (sampling 15/500 (checkpoint at 314)).
            self.drop_step_checkpoint(run.job.id, "a step cache's kept residuals are not in a step checkpoint: "
                                                  "sampling from step 0")
            return None
        try:
            fd = outdir.open_file(path, os.O_RDONLY)  # (never through a link planted at its name)
            with os.fdopen(fd, "rb") as f:
                data = f.read()
            model_id = run.group.loads[run.job.spec.model].model_id
            header, _ = read_checkpoint(data, spec_hash=run.job.spec.spec_hash, model_id=model_id)
        except (OSError, outdir.UnsafePathError, StepCheckpointError) as e:
            problem = f"{rel} is missing" if isinstance(e, FileNotFoundError) else str(e)
            self.drop_step_checkpoint(run.job.id, f"its step checkpoint is refused ({problem}); sampling from step 0")
            return None
        run.checkpoint_step = header.step
        said = f"continuing its sampling from the step checkpoint at step {header.step}/{header.key.total_steps}"
        self.ledger.log(run.job.id, EventKind.CHECKPOINT_RESUMED, said)
        self.say(f"{run.job.name}: {said}")
        return data

    def record_step_checkpoint(self, run: JobRun, reply: CheckpointReply) -> None:
        if reply.step > run.checkpoint_step:
            self.write_step_checkpoint(run, reply.data, step=reply.step)

    def write_step_checkpoint(self, run: JobRun, data: bytes, *, step: int) -> None:
        """``DIR/<job>/sampling.ckpt.safetensors`` written (temp name, rename), then recorded."""
        rel = artifacts.step_checkpoint_relpath(run.job.id)
        artifacts.write_artifact(self.out_dir, rel, data)
        total = run.job.spec.steps
        self.ledger.set_document(run.job.id, artifacts.STEP_CHECKPOINT_DOC, json.dumps(
            {"artifact": rel, "sha256": artifacts.sha256_bytes(data), "size": len(data), "step": step, "total": total}))
        run.checkpoint_step = step

    def drop_step_checkpoint(self, job_id: str, reason: str | None) -> None:
        """Forget the job's step checkpoint (the record first, then the file): the sampling ended, or
        the checkpoint was refused (``reason``, logged)."""
        path = self.out_dir / artifacts.step_checkpoint_relpath(job_id)
        recorded = self.ledger.document(job_id, artifacts.STEP_CHECKPOINT_DOC) is not None
        if not recorded and not path.is_symlink() and not path.exists():
            return
        self.ledger.delete_document(job_id, artifacts.STEP_CHECKPOINT_DOC)
        path.unlink(missing_ok=True)
        if reason:
            self.ledger.log(job_id, EventKind.CHECKPOINT_DROPPED, reason)
            self.say(f"{job_id}: {reason}")

    def upcoming(self) -> Iterable[Upcoming]:
        """The batch's pending jobs, in the order they will start."""
        return self._upcoming()

    def record_load(self, run: JobRun, load: LoadReply, seconds: float) -> None:
        """A group loaded the job's model: the group holds it now, the ledger and the run log say how
        it went."""
        group, model = run.group, run.job.spec.model
        for dropped in [m for m in group.loads if m != model and self.models_per_group is not None
                        and len(group.loads) >= self.models_per_group]:
            group.loads.pop(dropped)
            group.adapters = frozenset()
        group.loads[model] = load
        self.ledger.log(run.job.id, EventKind.GROUP_LOAD,
                        f"group {group.id}: {model} ({load.model_id}) loaded on {load.world_size} rank(s), "
                        f"device {load.device}, process group backend {load.backend}, attention "
                        f"{load.attention}, {seconds:.1f} s (weights {load.load_s:.1f} s, warm-up "
                        f"{load.warmup_s:.1f} s)"
                        + (f": {describe_phases(load.phases, total=seconds)}" if load.phases else ""))
        if load.worker is not None and not group.worker_told:
            group.worker_told = True
            w = load.worker
            # Ray may hand the group a worker process it started beforehand, even before the
            # cluster was ready: said as such, so the earlier stamp reads as no mistake.
            early = (" before the group was placed,"
                     if group.placed_at and w.process_started_at < group.placed_at else "")
            self.say(f"start-up: group {group.id} worker process (rank 0) up at {stamp(w.ready_at)} "
                     f"(started{early} at {stamp(w.process_started_at)}; importing the worker {w.imports_s:.2f} s)")
        self.say(f"start-up: group {group.id} loaded {model} at {stamp()} in {seconds:.1f} s "
                 f"(pipeline {load.load_s:.1f} s, warm-up {load.warmup_s:.1f} s): "
                 f"{describe_phases(load.phases, total=seconds) or 'no phases reported'}")

