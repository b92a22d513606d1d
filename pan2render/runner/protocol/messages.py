"""The driver <-> worker protocol: one frozen dataclass per call, one per reply.

The driver builds a call, the executor (``cluster/executor.py``) carries it to every rank of a group, and the
worker (``worker/render_worker.py``) dispatches on its type and answers with a :class:`Reply` whose ``value`` is
the call's typed reply (rank 0's; other ranks send None so artifacts cross the object store once).
Each call type says, once, everything the driver and the executor need to know about it: the
ledger stage it belongs to, what progress shows while it runs, its lane on the worker, and its
deadline (key and default of ``ServingConfig.call_timeouts_s``).

Messages stay small: artifacts (embeddings, latents, mp4s) travel as ``bytes``. A job's
``JobSpec`` travels once per attempt on a group, with the attempt's first call that needs it
(``spec``; None on later calls): the workers keep it for the job's later calls.

    RendezvousCall                              -> RendezvousReply     rank 0 only, group set-up
    InitGroupCall                               -> InitGroupReply      every rank, group set-up
    LoadCall(model, warmup)                     -> LoadReply
    EncodePromptsCall(model, texts)             -> EncodePromptsReply  embedding safetensors bytes
    SampleCall(model, job_id, spec, embeds...)  -> SampleReply         latents safetensors bytes
    SegmentFrameCall(job_id, segment, latents)  -> SegmentFrameReply   a chained segment's last frame, colour
    DecodeCall(model, job_id, spec, latents)    -> DecodeReply         hands the encode to a thread
    InterpolateCall(job_id, weights)            -> InterpolateReply    (interpolate > 1) then hands it over
    CollectCall(job_id)                         -> CollectReply        the checked mp4 (I/O lane)
    StopSamplingCall, FetchCheckpointCall,
    FetchPreviewCall(job_id, after_step)        -> beside a sampling, on the I/O lane

Which stage makes which call, and how its reply is recorded, is declared in ``serve/jobflow.py`` and ``serve/steps.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from pan2render.jobs.ledger import Stage
from pan2render.jobs.spec import JobSpec
from pan2render.long_video import ColourStats
from pan2render.phases import Phase
from pan2render.runner.protocol.failures import Failure

DEFAULT_PIPELINE_FACTORY = "pan2render.runner.worker.inputs:load_pan2_pipeline"

# Jobs of one group whose encode is not collected yet (the driver keeps to it). Each holds its
# video's yuv420p planes in this worker's host memory until encoded (121 frames of 704x1248:
# 160 MB), so a group whose encodes fall behind stops taking jobs instead of piling frames up.
MAX_ENCODES_IN_FLIGHT = 2
# Calls that may wait at once on one actor's I/O lane: the collects, a step checkpoint's fetch, a
# preview's fetch and a sampling's stop.
IO_CONCURRENCY = MAX_ENCODES_IN_FLIGHT + 3
# GPU-lane calls the driver may have issued to one group at once: the one running and the next
# job's first call queued behind it. The actor's GPU lane gets this many threads, so the call whose
# turn it is always has one while the other waits for its turn.
GPU_QUEUE_DEPTH = 2


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker of a run shares; built by the driver, sent to each actor. (Here, not in
    worker/render_worker.py, so that the driver builds it without importing the worker's torch.)"""

    pipeline_factory: str = DEFAULT_PIPELINE_FACTORY  # "module:callable(model, device) -> pipeline"
    threads: int | None = None  # torch intra-op threads on CPU (None: leave torch's default)
    faults: dict[str, Any] = field(default_factory=dict)  # test hooks, see RenderWorker._maybe_fault
    dist_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if ":" not in self.pipeline_factory:
            raise ValueError(f"pipeline_factory {self.pipeline_factory!r} must look like 'module:callable'")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads} must be >= 1 (or None for torch's default)")


class Lane(enum.Enum):
    """Where a call runs on a worker (see worker/render_worker.py)."""

    SETUP = "setup"  # forming the group: before any job, unordered
    GPU = "gpu"  # one call at a time, in the order the driver numbered them, on every rank
    IO = "io"  # rank 0 alone, beside the GPU lane: waiting for an encode


@dataclass(frozen=True)
class WorkerCall:
    """A call to every rank of a group (rank 0 alone for the I/O lane and the rendezvous)."""

    lane: ClassVar[Lane] = Lane.GPU
    # The ledger stage a failure of this call is charged to (None: group set-up, no job).
    stage: ClassVar[Stage | None] = None
    # Whether the call marks its stage running when it starts. Loading a model is the group's
    # work, done once for many jobs: a failure is charged to the job's conditioning, but the
    # stage is not shown running for it.
    marks_stage: ClassVar[bool] = True
    shown: ClassVar[str] = ""  # what progress shows while the call runs
    timeout_key: ClassVar[str] = ""  # its key in ServingConfig.call_timeouts_s ("" for set-up calls)
    default_timeout_s: ClassVar[float] = 0.0

    def label(self) -> str:
        """What progress shows while this call runs: ``shown``, and which part of its job it is."""
        return self.shown


# ---------------------------------------------------------------------- group set-up
@dataclass(frozen=True)
class RendezvousCall(WorkerCall):
    """Rank 0 picks where the process group's ranks meet, on its own node."""

    lane: ClassVar[Lane] = Lane.SETUP


@dataclass(frozen=True)
class RendezvousReply:
    init_method: str  # torch.distributed's: a file on rank 0's node, which the group's ranks share
    backend: str  # "nccl" on GPUs, "gloo" on CPU


@dataclass(frozen=True)
class InitGroupCall(WorkerCall):
    """Every rank joins the torch.distributed group where rank 0 said."""

    lane: ClassVar[Lane] = Lane.SETUP
    init_method: str
    backend: str


@dataclass(frozen=True)
class InitGroupReply:
    world_size: int


# ---------------------------------------------------------------------- a job's calls
@dataclass(frozen=True)
class Warmup:
    """The size a freshly loaded model compiles and autotunes at (the first job's)."""

    height: int
    width: int
    frames: int
    guidance: float


@dataclass(frozen=True)
class LoadCall(WorkerCall):
    stage: ClassVar[Stage | None] = Stage.CONDITIONING
    marks_stage: ClassVar[bool] = False
    shown: ClassVar[str] = "loading model"
    timeout_key: ClassVar[str] = "load"
    # Loading a 5B checkpoint from a network disk, then compiling, can take many minutes.
    default_timeout_s: ClassVar[float] = 1800.0
    model: str
    warmup: Warmup | None = None
    unload: tuple[str, ...] = ()  # models to drop first (a farm's group holds one model at a time)


@dataclass(frozen=True)
class WorkerStart:
    """How a worker process came up (rank 0's), in wall-clock times of its node (``time.time()``)."""

    process_started_at: float  # the process's start (a Ray worker process; the driver's, in-process)
    ready_at: float  # the worker object built: torch and the worker's code imported
    imports_s: float  # of that, importing the worker's code (torch and what it pulls in)


@dataclass(frozen=True)
class LoadReply:
    model_id: str
    text_encoder_id: str
    backend: str  # the process group's backend, "none" for one rank
    world_size: int
    device: str
    attention: str  # the DiT's attention backend, "n/a" for a pipeline without one
    load_s: float  # building the pipeline: imports, CUDA, the weights, the attention warm-up
    warmup_s: float  # the warm-up at the first job's size, after load_s
    describe: dict[str, Any] = field(default_factory=dict)  # the pipeline's own account of its set-up
    versions: dict[str, Any] = field(default_factory=dict)  # of what renders (worker.versions.runtime_versions)
    # The steps of load_s and warmup_s in the order they ran (pan2render.phases: "imports", "CUDA",
    # "DiT", "VAE", "text encoder", "attention warm-up", "warm-up sampling", "warm-up decode"; a
    # pipeline names its own); they do not overlap and sum to at most load_s + warmup_s.
    phases: tuple[Phase, ...] = ()
    worker: WorkerStart | None = None  # rank 0's process start, for the run log's start-up lines


@dataclass(frozen=True)
class EncodePromptsCall(WorkerCall):
    stage: ClassVar[Stage | None] = Stage.CONDITIONING
    shown: ClassVar[str] = "conditioning"
    timeout_key: ClassVar[str] = "encode_prompts"
    default_timeout_s: ClassVar[float] = 600.0
    model: str
    texts: tuple[str, ...]


@dataclass(frozen=True)
class EncodePromptsReply:
    embeddings: tuple[bytes, ...]  # one safetensors file per text, in the call's order


@dataclass(frozen=True)
class Segment:
    """Which clip of a chained job a call renders (``long_video``): segment ``index`` (from 1) of
    ``count``, sampled from noise ``seed``."""

    index: int
    count: int
    seed: int

    @property
    def shown(self) -> str:
        return f"segment {self.index}/{self.count}"


@dataclass(frozen=True)
class SampleCall(WorkerCall):
    stage: ClassVar[Stage | None] = Stage.SAMPLING
    shown: ClassVar[str] = "sampling"
    timeout_key: ClassVar[str] = "sample"
    # 50 steps at 720p take minutes on one H200.
    default_timeout_s: ClassVar[float] = 7200.0
    model: str
    job_id: str
    spec: JobSpec | None  # None: sent with an earlier call of this attempt
    prompt_embeds: bytes  # safetensors, as cached
    negative_embeds: bytes
    image: bytes | None = None  # the first-frame image file's bytes: workers need no shared disk
    adapters: tuple[Adapter, ...] = ()  # the job's LoRAs, in order (none: the DiT as loaded)
    resume: bytes | None = None  # a step checkpoint of this job to continue from (step_checkpoint.py)
    # The key its step reports go under ("": the job id). One per sampling: a job id recurs
    # (another attempt, the same job in another batch of a farm), and a report of one sampling
    # must not pass for another's.
    progress_key: str = ""
    # A chained job's segment (its seed replaces the job's; ``image`` is then the previous
    # segment's last frame); None: a job of one clip.
    segment: Segment | None = None

    def label(self) -> str:
        return self.shown if self.segment is None else f"{self.shown} {self.segment.shown}"


@dataclass(frozen=True)
class Adapter:
    """One LoRA of a job, for the workers: its content digest and scale, and the file's bytes
    unless the group's workers hold that digest already (a sweep over scales sends a file once)."""

    sha256: str
    scale: float
    name: str  # the file's name, for messages
    data: bytes | None = None


@dataclass(frozen=True)
class SampleReply:
    latents: bytes | None  # safetensors, with the spec in its metadata; None: stopped (below)
    adapters_held: tuple[str, ...] = ()  # digests of the LoRAs the workers keep after this call
    # A sampling stopped at a step boundary (StopSamplingCall): the step it stopped after and its
    # step checkpoint, to continue from.
    stopped_at: int | None = None
    checkpoint: bytes | None = None
    resume_refused: str | None = None  # why the call's step checkpoint was not used (it sampled from 0)
    segment: Segment | None = None  # the call's (a chained job's segment)


@dataclass(frozen=True)
class StopSamplingCall(WorkerCall):
    """Stop the job's sampling at its next step boundary (a cancel, a preemption); rank 0 alone
    is told, the ranks agree at the boundary. Its reply is None; the sampling's reply says where
    it stopped."""

    lane: ClassVar[Lane] = Lane.IO
    stage: ClassVar[Stage | None] = Stage.SAMPLING
    marks_stage: ClassVar[bool] = False
    shown: ClassVar[str] = "sampling"
    timeout_key: ClassVar[str] = "stop"
    default_timeout_s: ClassVar[float] = 60.0
    job_id: str


@dataclass(frozen=True)
class _FetchNewestCall(WorkerCall):
    """Something rank 0 keeps of a job while it samples, newer than ``after_step``: waits up to
    ``wait_s`` for it; None when the sampling ended or nothing newer came in time. On the I/O lane,
    so that it never waits behind the sampling it asks about."""

    lane: ClassVar[Lane] = Lane.IO
    stage: ClassVar[Stage | None] = Stage.SAMPLING
    marks_stage: ClassVar[bool] = False
    shown: ClassVar[str] = "sampling"
    default_timeout_s: ClassVar[float] = 600.0
    job_id: str
    after_step: int
    wait_s: float = 30.0


@dataclass(frozen=True)
class FetchCheckpointCall(_FetchNewestCall):
    """The job's newest step checkpoint (a CheckpointReply)."""

    timeout_key: ClassVar[str] = "fetch_checkpoint"


@dataclass(frozen=True)
class CheckpointReply:
    step: int
    total_steps: int
    data: bytes  # step-checkpoint bytes (step_checkpoint.py)


@dataclass(frozen=True)
class FetchPreviewCall(_FetchNewestCall):
    """The job's newest live preview (a PreviewReply)."""

    timeout_key: ClassVar[str] = "fetch_preview"


@dataclass(frozen=True)
class PreviewReply:
    step: int
    total_steps: int
    image: bytes  # the preview file's bytes: a WebP strip with its note (preview_file.py)


@dataclass(frozen=True)
class SegmentFrameCall(WorkerCall):
    """A chained segment's latents decoded for what the next segment needs: its last frame,
    colour-matched to ``reference`` (the first segment's statistics; None: this is the first), and
    its own colour statistics. Part of the sampling stage: the next segment samples from it."""

    stage: ClassVar[Stage | None] = Stage.SAMPLING
    shown: ClassVar[str] = "segment decode"
    timeout_key: ClassVar[str] = "segment_frame"
    default_timeout_s: ClassVar[float] = 1800.0
    model: str
    job_id: str
    spec: JobSpec | None  # None: sent with an earlier call of this attempt
    segment: Segment
    latents: bytes
    reference: ColourStats | None

    def label(self) -> str:
        return f"{self.segment.shown} decode"


@dataclass(frozen=True)
class SegmentFrameReply:
    segment: Segment  # the call's
    last_frame: bytes  # PNG (lossless): the next segment's first frame, as a job's `image` is
    stats: ColourStats  # of the segment's frames as decoded, before matching
    decode_s: float


@dataclass(frozen=True)
class SegmentLatents:
    """One segment of a chained job for its video's decode: its latents and its colour statistics
    as its SegmentFrameCall measured them (the same frames give the same statistics; carrying them
    makes the video's colours the ones its conditioning frames were matched with, on any device)."""

    latents: bytes
    stats: ColourStats


@dataclass(frozen=True)
class DecodeCall(WorkerCall):
    stage: ClassVar[Stage | None] = Stage.DECODE
    shown: ClassVar[str] = "decode"
    timeout_key: ClassVar[str] = "decode"
    default_timeout_s: ClassVar[float] = 1800.0
    model: str
    job_id: str
    spec: JobSpec | None  # None: sent with an earlier call of this attempt
    latents: bytes  # a job of one clip's; empty for a chained job, whose clips are in `segments`
    # A chained job: every segment, in order, each decoded, matched to the first one's colour and
    # joined without its first frame (the previous one's last, repeated).
    segments: tuple[SegmentLatents, ...] = ()


@dataclass(frozen=True)
class DecodeReply:
    # The frames are on the host, the encode runs on the worker's encode thread; a job that
    # interpolates keeps them on the device for its InterpolateCall instead.
    decode_s: float


@dataclass(frozen=True)
class InterpolateCall(WorkerCall):
    """The job's decoded frames (kept on rank 0's device by its decode) interpolated by RIFE's IFNet
    to (n - 1) x factor + 1 frames, then handed to the encode thread as a decode's are."""

    stage: ClassVar[Stage | None] = Stage.INTERPOLATE
    shown: ClassVar[str] = "interpolate"
    timeout_key: ClassVar[str] = "interpolate"
    default_timeout_s: ClassVar[float] = 1800.0
    model: str
    job_id: str
    spec: JobSpec | None  # None: sent with an earlier call of this attempt
    weights: bytes  # the IFNet weights file's bytes (workers need no shared disk)
    weights_sha256: str  # ... as the job id was made with: the worker keeps the model it loaded by it


@dataclass(frozen=True)
class InterpolateReply:
    interpolate_s: float
    frames: int  # of the interpolated video


@dataclass(frozen=True)
class CollectCall(WorkerCall):
    lane: ClassVar[Lane] = Lane.IO
    stage: ClassVar[Stage | None] = Stage.ENCODE
    shown: ClassVar[str] = "encode"
    timeout_key: ClassVar[str] = "collect"
    default_timeout_s: ClassVar[float] = 1800.0
    job_id: str


@dataclass(frozen=True)
class CollectReply:
    mp4: bytes  # decoded back and frame-counted on the worker
    encode_s: float
    check_s: float


# Every call the driver makes for a job (each with a deadline), in a job's order.
JOB_CALLS: tuple[type[WorkerCall], ...] = (LoadCall, EncodePromptsCall, SampleCall, SegmentFrameCall, DecodeCall,
                                           InterpolateCall, CollectCall, StopSamplingCall, FetchCheckpointCall,
                                           FetchPreviewCall)
SETUP_CALLS: tuple[type[WorkerCall], ...] = (RendezvousCall, InitGroupCall)


def default_call_timeouts() -> dict[str, float]:
    return {c.timeout_key: c.default_timeout_s for c in JOB_CALLS}


# ---------------------------------------------------------------------- the envelope
R = TypeVar("R")


@dataclass(frozen=True)
class Reply(Generic[R]):
    """One rank's answer to a call. ``execute`` never raises, so a failure comes back here, with
    its rank; an exception from Ray instead means the worker process itself is gone."""

    rank: int
    value: R | None = None  # the call's typed reply on rank 0; None on other ranks and on failure
    failure: Failure | None = None  # built on the worker, classified there by the exception's type
    seconds: float = 0.0  # how long the call ran on this rank

    @property
    def ok(self) -> bool:
        return self.failure is None
