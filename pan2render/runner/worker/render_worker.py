"""The GPU worker: one per GPU (rank) of a group; the body of the Ray actor.

The driver reaches it through ONE entry point, :meth:`RenderWorker.execute` ``(call, seq)``: the
call is one of the typed messages of ``protocol/messages.py`` and the worker runs the handler registered
for its type (:attr:`RenderWorker.handlers`). ``execute`` never raises: every outcome comes back as
a small :class:`~pan2render.runner.protocol.messages.Reply` carrying the rank, and for a failure its class
(decided here, from the exception's type, by protocol/failures.py), the error and its traceback, so a
Ray-level exception always means the actor itself died. Every rank of a group runs every call but
the I/O lane's; rank 0's value is the reply, other ranks return None so artifacts cross the
object store once.

Two lanes. The GPU lane (every job call but ``CollectCall``) runs one call at a time, in the order the
driver issued them: the driver numbers them (``seq``) and may queue a job's first call behind the
previous job's ``decode``, so the GPU starts it the moment the decode ends; the worker holds a
call until its turn, because Ray runs the calls of a threaded actor in arrival order, not
submission order, and every rank of a group must meet its collectives in the same order. Whichever
of Ray's threads a call arrives on, it runs on the worker's one GPU-lane thread (see __init__). ``decode``
ends once the frames are converted to yuv420p on the device and copied to the host; the libx264
encode then runs on the worker's encode thread while the GPU lane takes the next call. The
I/O lane (``CollectCall``, rank 0 only, Ray concurrency group ``io``) waits for one job's encode
without holding the GPU lane, and returns the mp4 (written in a temp folder here, decoded back and
frame-counted by ``encode_mp4``) for the driver to write, check and record.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Protocol

import torch

from pan2render.jobs.ledger import Stage
from pan2render.jobs.spec import JobSpec
from pan2render.long_video import is_long
from pan2render.models.precision import PrecisionUnavailable
from pan2render.models.sampler_state import SamplingPreempted, pack_sampler_state
from pan2render.models.tiny import cache_root
from pan2render.phases import phase, recording
from pan2render.runner.protocol import artifacts, timeline
from pan2render.runner.protocol.failures import DeviceError, Failure, FailureKind, JobInputError, classify_exception
from pan2render.runner.protocol.messages import (
    CheckpointReply,
    CollectCall,
    CollectReply,
    DecodeCall,
    DecodeReply,
    EncodePromptsCall,
    EncodePromptsReply,
    FetchCheckpointCall,
    FetchPreviewCall,
    InitGroupCall,
    InitGroupReply,
    InterpolateCall,
    InterpolateReply,
    Lane,
    LoadCall,
    LoadReply,
    PreviewReply,
    RendezvousCall,
    RendezvousReply,
    Reply,
    SampleCall,
    SampleReply,
    SegmentFrameCall,
    SegmentFrameReply,
    StopSamplingCall,
    WorkerCall,
    WorkerConfig,
    WorkerStart,
)
from pan2render.runner.worker import group_setup, long_video, packing, scratch
from pan2render.runner.worker.adapters import AdapterCache
from pan2render.runner.worker.encodes import Encodes, encode_job
from pan2render.runner.worker.faults import FaultHooks
from pan2render.runner.worker.inputs import decode_image
from pan2render.runner.worker.sampling_control import SamplingControl, resume_state
from pan2render.runner.worker.threads import CPU_DECODE_THREADS, intra_op_threads
from pan2render.runner.worker.versions import runtime_versions


class ProgressSink(Protocol):
    def report(self, job_id: str, done: int, total: int, at: float | None = None) -> None: ...


# Specs a worker keeps (see RenderWorker._specs): far more than the jobs a group holds at once.
_SPECS_KEPT = 16


class SimulatedWorkerDeath(BaseException):
    """Raised instead of os._exit by the in-process executor's simulated crash."""


class RenderWorker:
    def __init__(self, *, rank: int, world_size: int, config: WorkerConfig,
                 progress: ProgressSink | None = None, die: Callable[[], None] | None = None,
                 imports_s: float = 0.0, gpu_ids: tuple[int, ...] = ()):
        """``imports_s``: how long the process took to import this module (`ray_actors.RayWorkerProcess`
        measures it), reported with the first load. ``gpu_ids``: the cluster's numbers of the GPUs
        this worker was given (what the ``broken_gpu`` fault hook names)."""
        self.rank = rank
        self.gpu_ids = gpu_ids
        self.world_size = world_size
        self.config = config
        self._progress = progress
        self._faults = FaultHooks(config.faults, rank=rank, gpu_ids=gpu_ids, die=die or (lambda: os._exit(17)))
        self._pipes: dict[str, Any] = {}  # model (as named in the spec) -> loaded pipeline
        self._group: Any = None  # torch.distributed default group once init_group ran
        self._turn = threading.Condition()
        self._next_seq = 0  # the GPU-lane call whose turn it is
        self._encodes = Encodes()
        self._interpolation = long_video.Interpolation()
        self._segment_frames = long_video.SegmentFrames()
        # The specs of the jobs this worker runs: a call carries its job's spec only when it is
        # the attempt's first that needs it. Bounded: a job whose attempt failed never says
        # goodbye, and a group holds at most a few jobs at once (GPU lane, encodes).
        self._specs: OrderedDict[str, JobSpec] = OrderedDict()
        self._adapters = AdapterCache()  # the LoRA files it was sent, read on its device
        self._samplings = SamplingControl()  # stops asked, newest step checkpoints (the I/O lane's side)
        # Every call but the I/O lane's runs on this one thread, whichever thread of the actor it
        # arrived on. cuDNN's autotuning results are kept per thread (PyTorch's cuDNN plan cache
        # is thread-local), and Ray runs a threaded actor's calls on a pool of threads: on one
        # thread, what the load's warm-up tuned is what the jobs' calls find, instead of being
        # tuned again by the first decode that lands on the pool's other thread.
        self._gpu_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-lane")
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu" and config.threads:
            torch.set_num_threads(config.threads)
        # Compiled Triton kernels persist in the pan2-render cache folder, so the second batch on
        # a machine loads them instead of compiling (read by Triton at its first compile).
        os.environ.setdefault("TRITON_CACHE_DIR", str(cache_root() / "triton"))
        scratch.sweep_dead()  # what workers killed in the middle of an encode left behind
        self.started = WorkerStart(process_started_at=timeline.process_started_at(), ready_at=time.time(),
                                   imports_s=imports_s)

    # ------------------------------------------------------------------ the one entry point
    # The handler of each call type (filled in below the class; a subclass extends a copy).
    handlers: ClassVar[dict[type[WorkerCall], Callable[[Any, Any], Any]]] = {}

    def execute(self, call: WorkerCall, seq: int | None = None) -> Reply[Any]:
        """Run one call. ``seq``: the GPU-lane call's number (0, 1, 2, ... per group), or None
        for calls that need no ordering (group set-up, the I/O lane)."""
        if call.lane is Lane.IO:
            return self._run(call)  # waits for an encode thread, beside the GPU lane
        if seq is None:
            return self._on_gpu_thread(call)
        with self._turn:
            self._turn.wait_for(lambda: self._next_seq == seq)
        try:
            return self._on_gpu_thread(call)
        finally:
            with self._turn:
                self._next_seq = seq + 1
                self._turn.notify_all()

    def _on_gpu_thread(self, call: WorkerCall) -> Reply[Any]:
        return self._gpu_thread.submit(self._run, call).result()

    def _run(self, call: WorkerCall) -> Reply[Any]:
        t0 = time.perf_counter()
        try:
            handler = self.handlers.get(type(call))
            if handler is None:
                raise TypeError(f"no handler for {type(call).__name__} on {type(self).__name__}")
            value = handler(self, call)
        except SimulatedWorkerDeath:
            raise
        except Exception as e:  # every failure goes back to the driver, with rank
            tb = traceback.format_exc()
            if call.lane is Lane.GPU:
                e = self._device_fault(e)
            failure = Failure(stage=call.stage or Stage.CONDITIONING, kind=classify_exception(e, on_worker=True),
                              error=f"{type(e).__name__}: {e}", traceback=tb, rank=self.rank)
            return Reply(rank=self.rank, failure=failure, seconds=time.perf_counter() - t0)
        return Reply(rank=self.rank, value=value if self.rank == 0 else None, seconds=time.perf_counter() - t0)

    def _device_fault(self, e: Exception) -> Exception:
        """``e``, or a DeviceError when the GPU no longer works after it. Torch names some device
        faults by type (AcceleratorError, protocol/failures.py knows it); others arrive as a plain
        RuntimeError. A sticky fault (an illegal address, a device-side assert) fails every later
        call on the device, so a synchronize tells one that poisoned the device from one that did
        not, without reading the message."""
        if self.device != "cuda" or classify_exception(e, on_worker=True) is not FailureKind.UNKNOWN:
            return e
        try:
            torch.cuda.synchronize()
        except Exception as probe:  # any failure of the probe means the device is gone
            return DeviceError(f"the device fails after {type(e).__name__}: {e} "
                               f"(synchronize: {type(probe).__name__}: {probe})")
        return e

    # ------------------------------------------------------------------ group set-up
    def _rendezvous(self, call: RendezvousCall) -> RendezvousReply:
        return group_setup.rendezvous(self.device)

    def _init_group(self, call: InitGroupCall) -> InitGroupReply:
        self._group = group_setup.join_group(init_method=call.init_method, backend=call.backend, rank=self.rank,
                                             world_size=self.world_size, device=self.device,
                                             timeout_s=self.config.dist_timeout_s)
        return InitGroupReply(world_size=self.world_size)

    # ------------------------------------------------------------------ stages
    def _pipeline(self, model: str) -> Any:
        pipe = self._pipes.get(model)
        if pipe is None:
            module, attr = self.config.pipeline_factory.split(":", 1)
            with phase("imports"):  # the factory's module (the default one, this, imports its own)
                factory = getattr(importlib.import_module(module), attr)
            pipe = factory(model, self.device)
            if self._group is not None:
                from pan2render.parallel import parallelize_pipeline  # groups only

                # The one place a group's pipeline becomes sequence-parallel.
                pipe = parallelize_pipeline(pipe, self._group)
            self._pipes[model] = pipe
        return pipe

    def _unload(self, models: tuple[str, ...]) -> None:
        """Drop these models' pipelines and give their device memory back (a group holding one model
        at a time is asked for another)."""
        dropped = [self._pipes.pop(m) for m in models if m in self._pipes]
        if not dropped:
            return
        del dropped
        self._adapters.clear()  # read for the dropped DiT
        import gc

        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def _load(self, call: LoadCall) -> LoadReply:
        """Load the model (once per group) and, where the pipeline has ``warm_up``, run its
        compiles and autotuning at the call's warm-up size, so they count as load time rather than
        inside the first job's stages. Its decode goes through what a job's decode runs
        (`_frames_on_host`). Each step is timed (``pan2render.phases``) and sent back in order."""
        self._unload(call.unload)
        t0 = time.perf_counter()
        with recording() as record:
            if self.device == "cuda" and call.model not in self._pipes:
                with phase("CUDA", sync=torch.cuda.synchronize):
                    torch.cuda.init()
                    torch.empty(1, device=self.device)  # the context, before any weights move
            pipe = self._pipeline(call.model)
            load_s = time.perf_counter() - t0
            warm = getattr(pipe, "warm_up", None)
            if call.warmup is not None and warm is not None:
                warm(height=call.warmup.height, width=call.warmup.width, frames=call.warmup.frames,
                     guidance=call.warmup.guidance, decode=lambda latents: self._frames_on_host(pipe, latents))
        backend, world = "none", 1
        if self._group is not None:
            import torch.distributed as dist

            backend, world = str(dist.get_backend()), dist.get_world_size()
        return LoadReply(model_id=pipe.model_id, text_encoder_id=pipe.text_encoder_id,
                         backend=backend, world_size=world, device=self.device,
                         attention=getattr(pipe, "attention_backend", "n/a"),  # n/a: a pipeline without a DiT
                         load_s=load_s, warmup_s=time.perf_counter() - t0 - load_s,
                         describe=pipe.describe(), versions=runtime_versions(),
                         phases=tuple(record.phases), worker=self.started)

    def _encode_prompts(self, call: EncodePromptsCall) -> EncodePromptsReply:
        pipe = self._pipeline(call.model)
        out = []
        for text in call.texts:
            emb = pipe.encode_prompt(text)  # float32 [512, text_dim]
            key = artifacts.embedding_key(prompt=text, text_encoder_id=pipe.text_encoder_id)
            out.append(packing.pack_embedding(emb, key=key, text_encoder_id=pipe.text_encoder_id))
        return EncodePromptsReply(embeddings=tuple(out))

    def _spec(self, job_id: str, spec: JobSpec | None) -> JobSpec:
        """The job's spec: the one ``spec`` carries (kept for the job's later calls), or the one an
        earlier call of its attempt carried."""
        if spec is not None:
            self._specs[job_id] = spec
            self._specs.move_to_end(job_id)
            while len(self._specs) > _SPECS_KEPT:
                self._specs.popitem(last=False)
            return spec
        try:
            return self._specs[job_id]
        except KeyError:
            raise RuntimeError(f"job {job_id}: the call carries no spec and no earlier call of its attempt "
                               f"did (the driver sends it with the attempt's first call that needs it)") from None

    def _sample(self, call: SampleCall) -> SampleReply:
        pipe = self._pipeline(call.model)
        job_id = call.job_id
        progress_key = call.progress_key or job_id
        js = self._spec(job_id, call.spec)
        self._adapters.set(pipe, call.adapters)
        self._interpolation.forget()
        self._segment_frames.forget_unless(job_id)
        first_frame = None if call.image is None else decode_image(call.image)  # uint8 [H, W, 3]
        self._faults.at_stage(js, "sampling")

        def progress(done: int, total: int) -> None:
            if self.rank == 0 and self._progress is not None:
                self._progress.report(progress_key, done, total, time.time())
            self._faults.at_step(js, done, segment=1 if call.segment is None else call.segment.index)

        args = js.sample_args()
        if call.segment is not None:  # a chained job's segment: its own noise
            args["seed"] = call.segment.seed
        # (a model without a calibration raises CalibrationMissing here: the job's input, failures.py)
        plan = pipe.sampling_plan(conditioned=first_frame is not None, **args)
        resume, refused = resume_state(js, pipe, call.resume, cached=not plan.lanes.steps_exact)
        stop = self._samplings.begin(job_id)
        # Previews: rank 0 hands the predicted latents over; the I/O lane makes the picture.
        rgb_map = pipe.preview_map if self.rank == 0 and js.preview_every > 0 else None
        try:
            lat = pipe.sample(
                prompt_embeds=packing.unpack_embedding(call.prompt_embeds),
                negative_prompt_embeds=packing.unpack_embedding(call.negative_embeds),
                image=first_frame, progress=progress, resume_from=resume,
                # Periodic checkpoints need a state the cache does not fully hold (the residuals).
                checkpoint_every_s=js.checkpoint_every if plan.lanes.steps_exact else 0.0,
                on_checkpoint=(lambda state: self._samplings.keep(job_id, state)) if self.rank == 0 else None,
                should_stop=stop.is_set, preview_every_s=js.preview_every if rgb_map is not None else 0.0,
                on_preview=(lambda p: self._samplings.keep_preview(job_id, p, rgb_map)) if rgb_map else None,
                **args,
            )  # float32 [48, T, h, w]
        except SamplingPreempted as e:  # a stop at a step boundary: where, and how to go on from there
            data = pack_sampler_state(e.state, spec_hash=js.spec_hash) if self.rank == 0 else None
            return SampleReply(latents=None, stopped_at=e.state.step, checkpoint=data, segment=call.segment,
                               adapters_held=self._adapters.held(), resume_refused=refused)
        except PrecisionUnavailable as e:  # the same on any worker of this kind
            raise JobInputError(str(e)) from e
        finally:
            self._samplings.end(job_id)
        segment = None if call.segment is None else {  # what makes these latents this segment's
            "index": call.segment.index, "seed": call.segment.seed,
            "conditioning_sha256": None if call.image is None else artifacts.sha256_bytes(call.image)}
        return SampleReply(latents=packing.pack_latents(lat, spec_hash=js.spec_hash, seed=args["seed"], steps=js.steps,
                                                          model_id=pipe.model_id, spec=js.to_dict(),
                                                          fast_lanes=None if plan.lanes.exact else plan.describe(),
                                                          segment=segment),
                           adapters_held=self._adapters.held(), resume_refused=refused, segment=call.segment)

    def _stop_sampling(self, call: StopSamplingCall) -> None:
        self._samplings.stop(call.job_id)

    def _fetch_checkpoint(self, call: FetchCheckpointCall) -> CheckpointReply | None:
        js = self._specs.get(call.job_id)
        return self._samplings.fetch(call.job_id, after_step=call.after_step, wait_s=call.wait_s,
                                     spec_hash=js.spec_hash if js is not None else "")

    def _fetch_preview(self, call: FetchPreviewCall) -> PreviewReply | None:
        return self._samplings.fetch_preview(call.job_id, after_step=call.after_step, wait_s=call.wait_s)

    def _decode(self, call: DecodeCall) -> DecodeReply | None:
        """Decode on the device, convert to yuv420p there, copy to the host once and hand the planes
        to the encode thread; frames (hundreds of MB) never enter the object store. A long video's
        segments are decoded, colour-matched and joined on the device first (worker/long_video.py)."""
        from pan2render.media.yuv import rgb_to_yuv420

        pipe = self._pipeline(call.model)
        js = self._spec(call.job_id, call.spec)
        self._faults.at_stage(js, "decode")
        t0 = time.perf_counter()
        if not is_long(js):
            planes = self._frames_on_host(pipe, packing.unpack_latents(call.latents),
                                          want=(js.frames, js.height, js.width, 3))
        else:
            frames = long_video.video_frames_on_device(pipe, call, js, rank=self.rank, device=self.device,
                                                       kept=self._segment_frames)
            if frames is not None and js.interpolate > 1:  # its InterpolateCall takes them from here
                self._interpolation.keep(call.job_id, frames)
                return DecodeReply(decode_s=time.perf_counter() - t0)
            planes = None if frames is None else rgb_to_yuv420(frames).cpu().numpy()  # the one host copy
        if planes is None:  # not rank 0
            return None
        self._encodes.submit(call.job_id, functools.partial(self._encode, js, planes))
        return DecodeReply(decode_s=time.perf_counter() - t0)

    def _interpolate(self, call: InterpolateCall) -> InterpolateReply | None:
        """Rank 0 interpolates the frames its decode kept, then hands them to the encode thread."""
        from pan2render.media.yuv import rgb_to_yuv420

        js = self._spec(call.job_id, call.spec)
        self._faults.at_stage(js, "interpolate")
        if self.rank != 0:
            return None
        t0 = time.perf_counter()
        frames = self._interpolation.run(call, js)
        planes = rgb_to_yuv420(frames).cpu().numpy()  # the one host copy
        self._encodes.submit(call.job_id, functools.partial(self._encode, js, planes))
        return InterpolateReply(interpolate_s=time.perf_counter() - t0, frames=int(frames.shape[0]))

    def _segment_frame(self, call: SegmentFrameCall) -> SegmentFrameReply | None:
        js = self._spec(call.job_id, call.spec)
        self._faults.at_stage(js, "decode")
        return long_video.segment_frame(self._pipeline(call.model), call, js, rank=self.rank,
                                       device=self.device, kept=self._segment_frames)

    def _frames_on_host(self, pipe: Any, latents: torch.Tensor,
                        want: tuple[int, int, int, int] | None = None) -> Any:
        """Normalised latents ``[48, T, h, w]`` -> uint8 yuv420p planes ``[F, H*3/2, W]`` (numpy) on
        this host: decoded on the device, converted there, copied once. Every rank decodes (a
        group's decode is split over them); rank 0 alone gets planes, the others None. What a job's
        decode runs, and what the load's warm-up runs, so that none of it runs first in a job."""
        from pan2render.media.yuv import rgb_to_yuv420

        with intra_op_threads(CPU_DECODE_THREADS if self.device == "cpu" else None):  # (threads.py: why)
            frames = pipe.decode(latents, on_device=True)  # uint8 [F, H, W, 3]
        if self.rank != 0:
            return None
        if want is not None and tuple(frames.shape) != want:
            raise ValueError(f"decode returned frames of shape {tuple(frames.shape)}, expected {want}")
        planes = rgb_to_yuv420(frames).cpu().numpy()  # uint8 [F, H*3/2, W]: the one host copy
        del frames
        return planes

    def _collect(self, call: CollectCall) -> CollectReply:
        """Wait for the job's encode (handed over by the decode) and return the checked mp4."""
        return self._encodes.collect(call.job_id)

    def _encode(self, js: JobSpec, planes: Any) -> CollectReply:
        """On the encode thread: planes uint8 [F, H*3/2, W] -> mp4 bytes, decoded back and counted."""
        self._faults.at_stage(js, "encode")
        return encode_job(js, planes, model_id=self._pipeline(js.model).model_id)


RenderWorker.handlers = {
    RendezvousCall: RenderWorker._rendezvous,
    InitGroupCall: RenderWorker._init_group,
    LoadCall: RenderWorker._load,
    EncodePromptsCall: RenderWorker._encode_prompts,
    SampleCall: RenderWorker._sample,
    SegmentFrameCall: RenderWorker._segment_frame,
    DecodeCall: RenderWorker._decode,
    InterpolateCall: RenderWorker._interpolate,
    CollectCall: RenderWorker._collect,
    StopSamplingCall: RenderWorker._stop_sampling,
    FetchCheckpointCall: RenderWorker._fetch_checkpoint,
    FetchPreviewCall: RenderWorker._fetch_preview,
}
