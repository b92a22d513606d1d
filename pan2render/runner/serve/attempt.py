"""One attempt of one job on one group (:class:`JobRun`): its phase, named, with the moves allowed
between phases declared once (:data:`PHASE_MOVES`), and why it is being stopped, if it is.

The ledger holds what is durable about a job (its state, its stages); an attempt holds what the
scheduler knows beyond it while the job runs: the call in flight, what that call is (a load or a
stage's call, a sampling, a sampling asked to stop, the background encode), and whether a client
cancelled it or a higher-priority batch preempts it::

    ready --> calling --> ready                 (a stage's call, or the group's load)
    ready --> sampling --> ready                (the sampling returned its latents)
              sampling --> stopping --> stopped (asked to stop: it stopped at a step boundary)
                           stopping --> ready   (it finished before the stop took)
    ready --> encoding --> ready                (its last GPU call returned, its decode or its
                                                 interpolation: only its encode is left)
    any --> ended                               (done, failed, cancelled, back in the queue)
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from pan2render.jobs.ledger import JobRecord
from pan2render.jobs.spec import JobSpec
from pan2render.runner.cluster.executor import Call, Group
from pan2render.runner.protocol.messages import DecodeCall, InterpolateCall, SampleCall, WorkerCall
from pan2render.runner.protocol.steps import StepReport


class Phase(str, enum.Enum):
    READY = "ready"  # on its group; its last reply recorded, its next call not out yet
    CALLING = "calling"  # one of its flow's calls (or its group's load) in flight
    SAMPLING = "sampling"  # its SampleCall in flight
    STOPPING = "stopping"  # its sampling was asked to stop at its next step boundary
    STOPPED = "stopped"  # its sampling stopped at a step boundary; its step checkpoint is recorded
    ENCODING = "encoding"  # its last GPU call returned: only its background encode is left (the GPU is free)
    ENDED = "ended"  # no longer on its group


PHASE_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.READY: frozenset({Phase.CALLING, Phase.SAMPLING, Phase.ENCODING, Phase.ENDED}),
    Phase.CALLING: frozenset({Phase.READY, Phase.ENDED}),
    Phase.SAMPLING: frozenset({Phase.STOPPING, Phase.READY, Phase.ENDED}),
    Phase.STOPPING: frozenset({Phase.STOPPED, Phase.READY, Phase.ENDED}),
    Phase.STOPPED: frozenset({Phase.ENDED}),
    Phase.ENCODING: frozenset({Phase.READY, Phase.ENDED}),
    Phase.ENDED: frozenset(),
}


class IllegalPhaseMove(RuntimeError):
    """A move :data:`PHASE_MOVES` does not allow: a bug in the scheduler, never the job's."""


# How the ledger's reason for a preempted job's return to the queue begins (the scheduler's stop).
PREEMPTED_AT = "preempted at step"


class StopKind(str, enum.Enum):
    CANCEL = "cancel"  # a client cancelled the job: it ends cancelled
    PREEMPT = "preempt"  # a higher-priority batch takes its group: it goes back to the queue, uncharged


@dataclass(frozen=True)
class Stop:
    """Why an attempt is being stopped."""

    kind: StopKind
    reason: str


_RUN_NUMBERS = itertools.count(1)


@dataclass(eq=False)
class JobRun:
    """One attempt of one job on one group: what the scheduler knows beyond the ledger while it runs."""

    job: JobRecord
    group: Group
    phase: Phase = Phase.READY
    call: Call | None = None  # the call in flight
    # I/O-lane calls beside it while it samples: its step checkpoint's and its preview's fetches
    sides: list[Call] = field(default_factory=list)
    stop: Stop | None = None  # set once it is being cancelled or preempted
    stopped_at: int | None = None  # the step its sampling stopped after (phase STOPPED)
    spec_sent: bool = False  # the group's workers hold this attempt's spec (sent with its first job call)
    encode_texts: list[str] = field(default_factory=list)  # texts of the encode_prompts in flight
    decode_s: float | None = None  # how long its decode took, once it returned
    interpolate_s: float | None = None  # how long its interpolation took, once it returned (interpolate > 1)
    checkpoint_step: int = 0  # the step of its newest step checkpoint recorded (0: none)
    segment_sampled_s: float | None = None  # a chained job: its current segment's sampling, once recorded
    preview_step: int = 0  # the step of its newest preview written (0: none this attempt)
    sample_started_at: float = 0.0  # when its SampleCall went out (time.time): the watchdog's start
    last_step: StepReport | None = None  # the latest step this attempt's sampling reported
    number: int = field(default_factory=lambda: next(_RUN_NUMBERS))  # unique in this process

    def move(self, to: Phase) -> None:
        if to not in PHASE_MOVES[self.phase]:
            allowed = ", ".join(sorted(p.value for p in PHASE_MOVES[self.phase])) or "nothing"
            raise IllegalPhaseMove(f"job {self.job.id} (attempt {self.number}): {self.phase.value} -> {to.value} "
                                   f"is not a move of an attempt (from {self.phase.value}: {allowed})")
        self.phase = to

    def sent(self, message: WorkerCall, call: Call) -> None:
        """``message`` went out as ``call``: the phase says what is in flight."""
        self.call = call
        if isinstance(message, SampleCall):
            self.move(Phase.SAMPLING)
        elif self.gpu_done:
            self.move(Phase.ENCODING)
        else:
            self.move(Phase.CALLING)

    @property
    def gpu_done(self) -> bool:
        """Its GPU work returned: its decode, and its interpolation where it interpolates."""
        return self.decode_s is not None and (self.job.spec.interpolate == 1 or self.interpolate_s is not None)

    def stopped_after(self, step: int) -> None:
        """Its sampling stopped at the boundary after ``step``, as asked (the flow recorded its state)."""
        self.stopped_at = step
        self.move(Phase.STOPPED)

    def returned(self) -> None:
        """Its call in flight returned and its reply is recorded."""
        self.call = None
        if self.phase is not Phase.STOPPED:
            self.move(Phase.READY)

    @property
    def sampling(self) -> bool:
        return self.phase in (Phase.SAMPLING, Phase.STOPPING)

    @property
    def encoding(self) -> bool:
        """Waiting only for its background encode: the group's GPU lane is not this job's."""
        return self.phase is Phase.ENCODING

    @property
    def decoding(self) -> bool:
        """The last GPU work of the job is in flight: its decode, or its interpolation after it (the
        next job queued behind the decode would hold the interpolation back for its whole sampling)."""
        last = InterpolateCall if self.job.spec.interpolate > 1 else DecodeCall
        return self.phase is Phase.CALLING and self.call is not None and isinstance(self.call.message, last)

    @property
    def cancelled(self) -> bool:
        return self.stop is not None and self.stop.kind is StopKind.CANCEL

    @property
    def cancel_reason(self) -> str | None:
        """Why a client cancelled it, if one did."""
        return self.stop.reason if self.stop is not None and self.stop.kind is StopKind.CANCEL else None

    @property
    def preempted(self) -> bool:
        return self.stop is not None and self.stop.kind is StopKind.PREEMPT

    @property
    def progress_key(self) -> str:
        """The key this attempt's step reports go under: its own, not its job id, which an earlier
        attempt or the same job in another of a farm's batches reported under too."""
        return f"{self.job.id}#{self.number}"

    def spec_once(self) -> JobSpec | None:
        """The spec for this attempt's next call to carry: with the first call that needs it,
        then None (the workers keep it for the attempt)."""
        if self.spec_sent:
            return None
        self.spec_sent = True
        return self.job.spec
