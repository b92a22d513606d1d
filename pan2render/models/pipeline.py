"""The single-process PAN2 pipeline: text conditioning -> flow-matching sampling -> VAE decode.

``PAN2Pipeline.sample`` returns latents in the normalised latent space (what diffusers' WanPipeline
returns with ``output_type="latent"``); ``PAN2Pipeline.decode`` turns them into uint8 frames
``[F, H, W, 3]`` converted on the device and copied to the host once. Model code knows nothing of
Ray or process groups: the pipeline is built from a denoiser and a frame decoder
(`pan2render.models.strategies`), single-process ones by default, and
``pan2render.parallel.parallelize_pipeline`` returns one built from sequence-parallel ones.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..cache import cache_root
from ..kernels.attention import describe_attention, start_attention_import, warm_up_attention
from ..kernels.vae_decode import SWITCHED_OFF, to_uint8_frames
from ..lanes import (
    BF16,
    CACHE_NONE,
    DEFAULT_CACHE_MAX_SKIPS,
    DEFAULT_CACHE_RETENTION,
    DEFAULT_CACHE_THRESHOLD,
    DEFAULT_GUIDANCE_UNTIL,
    Branch,
    FastLanes,
    SamplingPlan,
    lane_problems,
    plan_sampling,
)
from ..model_files import DMD_TIMESTEPS_KEY, listed_dmd_timesteps
from ..model_files import model_id as checkpoint_id
from ..phases import phase
from ..sampling import DMD, SAMPLERS, WAN22, Geometry, combination_problems, is_int, timesteps_problem
from ..step_checkpoint import StepCheckpointError
from ..tiny_dit import TINY_MODEL, TINY_NAME
from ..vae_plan import SHAPE_COVERING_LATENT_FRAMES
from .calibration import calibration_for
from .dit import PAN2DiT, PAN2DiTConfig
from .dit_ops import ROUTED_OPS, TORCH_OPS
from .loading import ModelFolderError, instantiate, read_json, resolve_component
from .lora import LoraWeights, MergedLoras, linear_shapes, read_lora
from .precision import DiTPrecision
from .preview import PREVIEW_FRAMES, PreviewHook, PreviewLatents, RgbMap, rgb_map_for
from .sampler_state import CheckpointKey, SamplerState, StepHooks, capture_state, resume_state
from .samplers import FlowDMDSampler, FlowSampler, SchedulerConfig, clean_estimate, make_sampler
from .step_cache import RatioRecorder, fast_lane_velocity
from .strategies import (
    Denoiser,
    FastDecoder,
    FrameDecoder,
    ReferenceDecoder,
    SeparateGuidance,
    apply_guidance,
    make_denoiser,
)
from .text import TextEncoder
from .vae import WanVAE, WanVAEConfig

ProgressFn = Callable[[int, int], None]

# diffusers keeps these in fp32 when the transformer runs in bf16 (WanTransformer3DModel's
# _keep_in_fp32_modules): the time embedding, the modulation tables and the norms.
DIT_KEEP_IN_FP32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")


def _dtype_of(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if value not in names:
        raise ValueError(f"dtype {value!r} is not supported; use one of {sorted(names)} or 'auto'")
    return names[value]


@dataclass
class PAN2PipelineConfig:
    """How and where the pipeline runs; the fast-path switches default on where they apply."""

    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: str | torch.dtype = "auto"  # DiT dtype. "auto": bfloat16 on CUDA, float32 on CPU
    vae_dtype: str | torch.dtype = "float32"  # reference VAE path; the fast decoder is bf16
    text_encoder_device: str | None = None  # None: same as device
    vae_decode_kernel: bool = True  # fast Hopper VAE decoder; falls back (logged once) elsewhere
    vae_decode_kernel_parallel: bool = True  # split one decode over a sequence-parallel group
    dit_fused_kernels: bool = True  # fused Triton DiT kernels on CUDA; eager path elsewhere
    # Keep the DiT's residual stream in fp32 and round only the norms' outputs to the compute dtype
    # (PAN2DiT.set_residual_dtype). diffusers rounds it to bf16 after each of the 4 residual adds per
    # block: on one H200 at 704x1248x121 (docs/performance.md) rel. L2 vs a strict fp32 forward was
    # 1.46e-2 that way (over the 1e-2 we hold the bf16 DiT to) and 3.35e-3 with the fp32 stream, for +7.5-9 ms per
    # forward. False: diffusers' numerics bit for bit. A no-op when the DiT runs in fp32.
    dit_fp32_residual: bool = True
    # In a parallelized pipeline whose group size is even: run a guided step's two branches on the
    # two halves of the group (each half sequence-parallel over its own ranks when it has more than
    # one) instead of both branches Ulysses-parallel over the whole group; one exchange of the two
    # velocities per step. Unguided steps always use the whole group. See pan2render/parallel/guidance.py
    # for why and the measurement (docs/performance.md).
    guidance_parallel: bool = True

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.device(self.device)  # raises on a malformed device string
        if self.dtype == "auto":
            self.dtype = torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
        self.dtype = _dtype_of(self.dtype)
        self.vae_dtype = _dtype_of(self.vae_dtype)
        if self.text_encoder_device is None:
            self.text_encoder_device = self.device
        for name in ("vae_decode_kernel", "vae_decode_kernel_parallel", "dit_fused_kernels", "dit_fp32_residual",
                     "guidance_parallel"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r}: expected True or False")


@dataclass(frozen=True)
class SampleRequest:
    """A validated sampling request (sizes in pixels), checked against the model's geometry."""

    height: int
    width: int
    frames: int
    steps: int
    guidance: float
    seed: int
    sampler: str = "unipc"
    flow_shift: float | None = None
    # DMD only: the listed timesteps (ints in [1, T], strictly decreasing); None for the other
    # samplers. For dmd the step count is len(timesteps) and ``steps`` must equal it.
    timesteps: tuple[int, ...] | None = None
    geometry: Geometry = WAN22  # the pipeline's, from its VAE and DiT configs

    def __post_init__(self) -> None:
        problems = []
        geo = self.geometry
        if not is_int(self.frames) or not geo.frames_ok(self.frames):
            problems.append(f"frames={self.frames!r}: must be {geo.vae_temporal}k+1 (1, 5, ..., 17, ..., 121)")
        for name in ("height", "width"):
            v = getattr(self, name)
            if not is_int(v) or v < geo.spatial_multiple or v % geo.spatial_multiple:
                problems.append(f"{name}={v!r}: must be a positive multiple of {geo.spatial_multiple}")
        if not is_int(self.steps) or self.steps < 1:
            problems.append(f"steps={self.steps!r}: must be an integer >= 1")
        if isinstance(self.guidance, bool) or not isinstance(self.guidance, (int, float)) \
                or not math.isfinite(self.guidance) or self.guidance < 1:
            problems.append(f"guidance={self.guidance!r}: must be a number >= 1 (1 means no guidance)")
        if not is_int(self.seed) or self.seed < 0:
            problems.append(f"seed={self.seed!r}: must be a non-negative integer")
        if self.sampler not in SAMPLERS:
            problems.append(f"sampler={self.sampler!r}: must be one of {', '.join(SAMPLERS)}")
        if self.flow_shift is not None and (not isinstance(self.flow_shift, (int, float))
                                            or isinstance(self.flow_shift, bool) or self.flow_shift <= 0):
            problems.append(f"flow_shift={self.flow_shift!r}: must be a number > 0")
        if self.sampler == DMD and self.timesteps is None:
            problems.append("sampler='dmd' needs timesteps (the job's, or the checkpoint's dmd_denoising_steps)")
        if self.timesteps is not None and is_int(self.steps) and self.steps != len(self.timesteps):
            problems.append(f"steps={self.steps!r}: must equal the number of timesteps ({len(self.timesteps)})")
        if not problems:  # the combination rules assume each value is well formed
            problems += [f"{fld}: {msg}" for fld, msg in combination_problems(
                sampler=self.sampler, timesteps=self.timesteps, guidance=self.guidance)]
        if problems:
            raise ValueError("invalid sampling request: " + "; ".join(problems))

    @property
    def latent_frames(self) -> int:
        return self.geometry.latent_frames(self.frames)


def default_denoiser(dit: PAN2DiT, config: PAN2PipelineConfig) -> Denoiser:
    """The single-process denoiser: each guidance branch its own batch-1 forward (one batch-2
    forward measured equal within noise on an H200 at twice the activation peak: 1.720 s vs
    1.724 s a guided step, 4.1 vs 2.0 GiB; docs/performance.md, DiT)."""
    return SeparateGuidance(dit)


def default_frame_decoder(vae: WanVAE, config: PAN2PipelineConfig) -> FrameDecoder:
    """The single-process frame decoder ``config`` asks for (``vae_decode_kernel``)."""
    if config.vae_decode_kernel:
        return FastDecoder(vae, device=torch.device(config.device))
    return ReferenceDecoder(vae, why=SWITCHED_OFF.reason)


class PAN2Pipeline:
    """Text -> latents -> uint8 frames for one PAN2 checkpoint.

    ``denoiser`` / ``frame_decoder``: the strategies it samples and decodes with (None: the
    single-process ones ``config`` selects, `default_denoiser` / `default_frame_decoder`).
    """

    def __init__(self, *, dit: PAN2DiT, vae: WanVAE, text_encoder: TextEncoder | None,
                 scheduler_config: SchedulerConfig, config: PAN2PipelineConfig, model_id: str,
                 expand_timesteps: bool = True, default_timesteps: tuple[int, ...] | None = None,
                 denoiser: Denoiser | None = None, frame_decoder: FrameDecoder | None = None):
        self.dit = dit
        self.vae = vae
        self.text_encoder = text_encoder
        self.scheduler_config = scheduler_config
        self.config = config
        self.model_id = model_id
        # Wan2.2 TI2V feeds per-token timesteps (first-frame tokens at 0 when an image conditions).
        self.expand_timesteps = expand_timesteps
        # A step-distilled checkpoint's own DMD timesteps (see model_dmd_timesteps); a job's
        # timesteps win. With them the checkpoint's default sampler is dmd.
        self.default_timesteps = default_timesteps
        self.denoiser = default_denoiser(dit, config) if denoiser is None else denoiser
        self.frame_decoder = default_frame_decoder(vae, config) if frame_decoder is None else frame_decoder
        # The adapters merged into the DiT's weights. One object, shared by the twins
        # `with_strategies` makes (a group's parallel pipeline), as they share the DiT.
        self.loras = MergedLoras(dit) if dit is not None else None
        self.precision = DiTPrecision(dit, torch.device(config.device)) if dit is not None else None
        if dit is not None:
            # The fused-kernel switch, per pipeline (there is no process-wide one): this DiT's op
            # table is the fused-where-possible one or the plain-torch one.
            dit.set_ops(ROUTED_OPS if config.dit_fused_kernels else TORCH_OPS)
            dit.set_residual_dtype(torch.float32 if config.dit_fp32_residual else None)

    # ----------------------------------------------------------------------------------------
    # Loading
    @classmethod
    def from_pretrained(cls, path: str | Path, config: PAN2PipelineConfig | None = None) -> "PAN2Pipeline":
        """Load a diffusers-layout checkpoint folder, or ``"tiny"`` for the embedded tiny model."""
        config = config or PAN2PipelineConfig()
        if str(path) == TINY_MODEL:
            from .tiny import tiny_model_folder

            root = tiny_model_folder()
            name = TINY_NAME
        else:
            root = Path(path).expanduser().resolve()
            name = root.name
        if not root.is_dir():
            raise ModelFolderError(f"{root}: checkpoint folder does not exist")
        index = read_json(root / "model_index.json")
        dit_config = _config_of(resolve_component(root, "transformer"), PAN2DiTConfig)
        # FlashAttention-4's import (seconds) runs on a thread while the weights are read below.
        start_attention_import(config.device, config.dtype, head_dim=dit_config.attention_head_dim,
                               compile_cache=cache_root() / "flash-attn-4")
        # Each component's load is a phase of its own (pan2render.phases; timed only when the
        # caller records, e.g. the runner's load), the device synchronized at its end: the casts
        # and copies it queued belong to it.
        on_cuda = "cuda" in (torch.device(config.device).type, torch.device(config.text_encoder_device).type)
        sync = torch.cuda.synchronize if on_cuda else None
        with _quick_thread_switches():
            with phase("DiT", sync=sync):
                dit = load_dit(root, device=config.device, dtype=config.dtype)
            with phase("VAE", sync=sync):
                vae = load_vae(root, device=config.device, dtype=config.vae_dtype)
            # umT5-XXL has ~5.7B parameters: bf16 on a GPU as Wan runs it, fp32 on the CPU.
            text_dtype = config.dtype if torch.device(config.text_encoder_device).type == "cuda" else torch.float32
            with phase("text encoder", sync=sync):
                text = TextEncoder.from_pretrained(root, device=config.text_encoder_device, dtype=text_dtype)
        sched_file = root / "scheduler" / "scheduler_config.json"
        try:
            scheduler_config = SchedulerConfig.from_dict(read_json(sched_file), source=str(sched_file)) \
                if sched_file.is_file() else SchedulerConfig()
        except ValueError as e:
            raise ModelFolderError(str(e)) from e
        default_timesteps = model_dmd_timesteps(root, scheduler_config.num_train_timesteps)
        model_id = checkpoint_id(root, name=name, dmd_timesteps=default_timesteps)
        # FlashAttention-4's import may still be running: `warm_up` (or the first forward) waits.
        return cls(dit=dit, vae=vae, text_encoder=text, scheduler_config=scheduler_config, config=config,
                   model_id=model_id, expand_timesteps=bool(index.get("expand_timesteps", True)),
                   default_timesteps=default_timesteps)

    def with_strategies(self, *, denoiser: Denoiser | None = None,
                        frame_decoder: FrameDecoder | None = None) -> "PAN2Pipeline":
        """A pipeline over the same models and config with these strategies (None: keep this one's).
        The models are shared, not copied: use the returned pipeline in place of this one."""
        twin = copy.copy(self)
        if denoiser is not None:
            twin.denoiser = denoiser
        if frame_decoder is not None:
            twin.frame_decoder = frame_decoder
        return twin

    # ----------------------------------------------------------------------------------------
    # Adapters
    def read_lora(self, source: str | Path | bytes, *, name: str | None = None) -> LoraWeights:
        """A LoRA file (path or bytes) read and checked against this pipeline's DiT, its factors on
        the pipeline's device (so switching to it copies nothing from the host)."""
        return read_lora(source, linears=linear_shapes(self.dit), name=name).to(self.device)

    def set_loras(self, adapters: Sequence[tuple[LoraWeights, float]]) -> bool:
        """Sample with these adapters (each with its scale) merged into the DiT from now on; ``[]``
        for none. The previous set is unmerged exactly first (the checkpoint's weights bit for bit),
        and nothing happens when the set is the same, so a batch switches adapters between jobs
        without reloading the checkpoint. Returns whether the weights changed. In a group every
        rank calls it with the same list before the job's ``sample``."""
        if self.loras is None:
            raise RuntimeError("this pipeline was built without a DiT")
        return self.loras.set(adapters)

    def describe(self) -> dict[str, object]:
        """How this pipeline runs a job, as plain JSON values (recorded beside every video): the
        ranks, how guided and unguided steps use them, the decode path, the DiT's dtype, the
        scheduler config."""
        steps = self.denoiser.describe()
        return {
            "ranks": steps["ranks"],
            "guided_steps": steps["guided_steps"],
            "unguided_steps": steps["unguided_steps"],
            "decode": self.frame_decoder.describe(),
            "dit_dtype": str(self.config.dtype).removeprefix("torch."),
            "scheduler": asdict(self.scheduler_config),
        }

    @property
    def device(self) -> torch.device:
        return torch.device(self.config.device)

    @property
    def preview_map(self) -> RgbMap:
        """The latent -> RGB map this model's previews use (`pan2render.models.preview.rgb_map_for`):
        the one ``pan2-render calibrate`` fitted for it, else one fitted on its VAE alone the first
        time it is asked for (a few small decodes, then kept on disk). Read again each time, so that
        a warm worker takes up a map ``calibrate`` fitted since."""
        return rgb_map_for(self)

    @property
    def attention_backend(self) -> str:
        """The DiT's attention backend in words (for the load reply and the group's layout line)."""
        return describe_attention(self.device, self.config.dtype, self.dit.config.attention_head_dim)

    @property
    def text_encoder_id(self) -> str:
        if self.text_encoder is None:
            raise RuntimeError("this pipeline was built without a text encoder; pass prompt_embeds")
        return self.text_encoder.encoder_id

    # ----------------------------------------------------------------------------------------
    # Conditioning
    def encode_prompt(self, prompt: str) -> torch.Tensor:
        """Prompt -> float32 CPU embeddings ``[512, text_dim]``."""
        if self.text_encoder is None:
            raise RuntimeError("this pipeline was built without a text encoder; pass prompt_embeds")
        return self.text_encoder.encode(prompt)

    def _context(self, embeds: torch.Tensor | None, prompt: str | None) -> torch.Tensor:
        if embeds is None:
            if prompt is None:
                raise ValueError("give either a prompt or its embeddings")
            embeds = self.encode_prompt(prompt)
        if embeds.dim() == 2:
            embeds = embeds[None]
        want = self.dit.config.text_dim
        if embeds.dim() != 3 or embeds.shape[0] != 1 or embeds.shape[-1] != want:
            raise ValueError(f"prompt embeddings must be [512, {want}] or [1, 512, {want}], "
                             f"got {list(embeds.shape)}")
        return embeds.to(self.device, self.config.dtype)

    def encode_image(self, image: np.ndarray | torch.Tensor, *, height: int, width: int) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` image -> normalised first-frame latent ``[1, 48, 1, h, w]``.

        The image is resized to cover ``height x width`` keeping its aspect, then centre-cropped.
        """
        img = torch.as_tensor(np.asarray(image))
        if img.dtype != torch.uint8 or img.dim() != 3 or img.shape[-1] != 3:
            raise ValueError(f"image must be uint8 [H, W, 3], got {img.dtype} {list(img.shape)}")
        x = img.permute(2, 0, 1)[None].float() / 127.5 - 1.0  # [1, 3, H, W] in [-1, 1]
        scale = max(height / x.shape[-2], width / x.shape[-1])
        size = (max(height, round(x.shape[-2] * scale)), max(width, round(x.shape[-1] * scale)))
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
        top, left = (size[0] - height) // 2, (size[1] - width) // 2
        x = x[..., top:top + height, left:left + width].clamp(-1, 1)
        vae_dtype = next(self.vae.parameters()).dtype
        with torch.no_grad():
            z = self.vae.encode(x[:, :, None].to(self.device, vae_dtype))  # [1, 48, 1, h, w]
        return self.vae.normalize_latents(z.float())

    # ----------------------------------------------------------------------------------------
    # Sampling
    @torch.no_grad()
    def sample(
        self,
        *,
        prompt: str | None = None,
        negative_prompt: str = "",
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        image: np.ndarray | torch.Tensor | None = None,
        height: int,
        width: int,
        frames: int,
        steps: int | None = None,
        guidance: float,
        seed: int,
        flow_shift: float | None = None,
        sampler: str | None = None,
        timesteps: Sequence[int] | None = None,
        cache: str = CACHE_NONE,
        cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
        cache_max_skips: int = DEFAULT_CACHE_MAX_SKIPS,
        cache_retention: float = DEFAULT_CACHE_RETENTION,
        guidance_until: float = DEFAULT_GUIDANCE_UNTIL,
        precision: str = BF16,
        progress: ProgressFn | None = None,
        resume_from: SamplerState | None = None,
        checkpoint_every_s: float = 0.0,
        on_checkpoint: Callable[[SamplerState], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        preview_every_s: float = 0.0,
        on_preview: Callable[[PreviewLatents], None] | None = None,
        preview_frames: int = PREVIEW_FRAMES,
        record: RatioRecorder | None = None,
    ) -> torch.Tensor:
        """Sample latents: float32 CPU ``[48, T, h, w]`` in the normalised latent space.

        ``sampler`` None: the checkpoint's default (dmd when it lists DMD timesteps, else what
        its scheduler class stands for). ``timesteps`` (dmd only) default to the checkpoint's;
        with dmd, ``steps`` may be left out (it is the number of timesteps). ``cache`` ..
        ``precision``: the fast lanes (`pan2render.lanes.FastLanes`; the defaults are the exact
        path); `sampling_plan` says what they run. ``record``: an exact run whose block residuals
        it measures (`pan2render.models.calibration.calibrate`).

        Step checkpoints (`pan2render.models.sampler_state`), all off by default and free when off:
        ``on_checkpoint(state)`` is called between two steps once ``checkpoint_every_s`` seconds
        of sampling have passed since the last call (0: never); ``should_stop()`` is polled
        between every two steps, and when it returns True on any rank of the group every rank
        stops at that boundary, calls ``on_checkpoint`` (where given) and raises
        `SamplingPreempted` with the state. In a group give ``should_stop`` on every rank or on
        none (agreeing is collective); every rank holds the same state, so ``on_checkpoint`` is
        needed on one only. ``resume_from``: a state of this same request (checked: model,
        sampler, steps, shape, seed, guidance, schedule; `StepCheckpointError` otherwise); the
        sampling continues after its step and returns what the uninterrupted one would have. A
        step cache keeps block residuals the state does not hold: with ``cache`` set, resuming is
        refused (the caller samples from the start).

        Previews (`pan2render.models.preview`), off by default and free when off: ``on_preview``
        gets the clean latents the model predicts (x0) for ``preview_frames`` latent frames, on the
        CPU, between two steps once ``preview_every_s`` seconds of sampling have passed since the
        last (0: never). They only read the sampling's tensors: its latents are the same bits with
        previews on or off. In a group, give it on one rank (every rank holds the same latents).
        """
        lanes = FastLanes(cache=cache, cache_threshold=cache_threshold, cache_max_skips=cache_max_skips,
                          cache_retention=cache_retention, guidance_until=guidance_until, precision=precision)
        self.precision.check(lanes.precision)  # before any work: never a silent bf16 render
        for fld, message in lane_problems(sampler=self.default_sampler if sampler is None else sampler,
                                          cache=lanes.cache):
            raise ValueError(f"invalid sampling request: {fld}: {message}")
        sampler = self.default_sampler if sampler is None else sampler
        if sampler == DMD:
            timesteps = self.default_timesteps if timesteps is None else tuple(timesteps)
            if steps is None and timesteps is not None:
                steps = len(timesteps)
        elif timesteps is not None:
            timesteps = tuple(timesteps)
        req = SampleRequest(height=height, width=width, frames=frames, steps=steps, guidance=guidance,
                            seed=seed, sampler=sampler, flow_shift=flow_shift, timesteps=timesteps,
                            geometry=Geometry.of(self.vae.config, self.dit.config))
        cond = self._context(prompt_embeds, prompt)
        guided = req.guidance > 1.0
        uncond = self._context(negative_prompt_embeds, negative_prompt) if guided else None

        hooks = StepHooks(checkpoint_every_s=checkpoint_every_s, on_checkpoint=on_checkpoint,
                          should_stop=should_stop)
        previews = PreviewHook(every_s=preview_every_s, on_preview=on_preview, frames=preview_frames)

        z_dim = self.vae.config.z_dim
        shape = (1, z_dim, req.latent_frames, req.height // 16, req.width // 16)
        # The noise comes from a CPU generator so it is identical on every device and every rank.
        gen = torch.Generator(device="cpu").manual_seed(req.seed)

        first_frame = None
        if image is not None and not self.expand_timesteps:
            raise ValueError(f"{self.model_id}: this checkpoint's model_index.json has expand_timesteps "
                             f"false, so it was not trained for first-frame conditioning; drop the image")
        if image is not None:
            first_frame = self.encode_image(image, height=req.height, width=req.width)

        sampler = make_sampler(req.sampler, self.scheduler_config)
        if isinstance(sampler, FlowDMDSampler):
            # Its fresh noise continues the job's CPU generator: the same on every device and rank.
            sampler.set_dmd_timesteps(req.timesteps, generator=gen, flow_shift=req.flow_shift)
        else:
            sampler.set_timesteps(req.steps, flow_shift=req.flow_shift)
        timesteps = sampler.timesteps
        key = CheckpointKey(model_id=self.model_id, sampler=req.sampler, total_steps=len(timesteps),
                            latent_shape=shape, seed=req.seed, guidance=float(req.guidance))
        if resume_from is None:
            latents = torch.randn(shape, generator=gen, dtype=torch.float32).to(self.device)
            if first_frame is not None:
                latents[:, :, :1] = first_frame
            start = 0
        else:
            if not lanes.steps_exact:
                raise StepCheckpointError("a step cache's kept residuals are not in a step checkpoint: "
                                          "a cached sampling starts from its first step")
            latents = resume_state(resume_from, key=key, sampler=sampler, generator=gen, device=self.device)
            start = resume_from.step
        with self.precision.applied(lanes.precision):
            velocity = self._velocity(req, lanes, cond, uncond, conditioned=first_frame is not None, record=record)
            return self._run_steps(sampler, velocity, latents, first_frame, shape, progress, start=start,
                                   hooks=hooks, capture=lambda lat: capture_state(key, lat, sampler, gen),
                                   previews=previews)

    def _velocity(self, req: SampleRequest, lanes: FastLanes, cond: torch.Tensor, uncond: torch.Tensor | None, *,
                  conditioned: bool,
                  record: RatioRecorder | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The exact path's velocity (today's denoiser) unless a fast lane changes which forwards run."""
        if record is not None:
            plan = plan_sampling(FastLanes(precision=lanes.precision), steps=req.steps, guided=uncond is not None)
            return fast_lane_velocity(self.denoiser.branch_forwards(cond, uncond), plan, req.guidance,
                                      compute={b: record.stack(b) for b in Branch})
        if lanes.steps_exact:
            return self.denoiser.prepare(cond, uncond, req.guidance)
        plan = self._plan(lanes, steps=req.steps, guided=uncond is not None, conditioned=conditioned)
        return fast_lane_velocity(self.denoiser.branch_forwards(cond, uncond), plan, req.guidance)

    def _run_steps(self, sampler: FlowSampler, velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   latents: torch.Tensor, first_frame: torch.Tensor | None, shape: tuple[int, ...],
                   progress: ProgressFn | None, *, start: int, hooks: StepHooks,
                   capture: Callable[[torch.Tensor], SamplerState], previews: PreviewHook) -> torch.Tensor:
        """The sampling loop from step ``start``: one velocity per timestep, the sampler's step, the
        first frame kept, the step-checkpoint and preview hooks between two steps."""
        timesteps = sampler.timesteps
        hooks.start()
        previews.start()
        for i in range(start, len(timesteps)):
            t = timesteps[i]
            timestep = self._timestep_for(t, shape, conditioned=first_frame is not None)
            # x_i, kept for a preview (the step returns a new tensor; nothing writes into this one)
            before = latents if previews.active else None
            noise_pred = velocity(latents.to(self.config.dtype), timestep)
            latents = sampler.step(noise_pred.float(), t, latents)
            if first_frame is not None:
                # Re-impose the conditioning frame after every step, as the official Wan2.2 code does.
                latents[:, :, :1] = first_frame
            if not bool(torch.isfinite(latents).all()):
                raise FloatingPointError(
                    f"non-finite latents at step {i + 1} of {len(timesteps)} (timestep {float(t):.1f}); "
                    f"try a lower guidance or another seed")
            if progress is not None:
                progress(i + 1, len(timesteps))
            if previews.active and i + 1 < len(timesteps):
                previews.at_boundary(step=i + 1, total_steps=len(timesteps), latent_frames=shape[2],
                                     estimate=functools.partial(_x0_frames, before, noise_pred,
                                                                sampler.sigmas[i].item(), first_frame))
            if hooks.active and i + 1 < len(timesteps):
                hooks.at_boundary(functools.partial(capture, latents), self.denoiser.any_rank)
        return latents[0].float().cpu()

    def sampling_plan(self, *, steps: int | None, guidance: float, sampler: str | None = None,
                      timesteps: Sequence[int] | None = None, conditioned: bool = False,
                      **lanes: Any) -> SamplingPlan:
        """What `sample` runs for a job with these arguments (``lanes``: the fast-lane keywords):
        per step, which guidance branch computes, reuses its cached residual or does not run.
        Deterministic: the same on every rank and every call. ``conditioned``: a first frame given."""
        sampler = self.default_sampler if sampler is None else sampler
        if sampler == DMD:
            timesteps = self.default_timesteps if timesteps is None else timesteps
            steps = len(timesteps) if timesteps is not None else steps
        if not is_int(steps):
            raise ValueError(f"steps={steps!r}: expected an integer >= 1")
        return self._plan(FastLanes.of(lanes), steps=steps, guided=guidance > 1.0, conditioned=conditioned)

    def _plan(self, lanes: FastLanes, *, steps: int, guided: bool, conditioned: bool) -> SamplingPlan:
        calibration = None
        if lanes.cache != CACHE_NONE:
            calibration = calibration_for(self.model_id, self.dit.config.to_dict(), conditioned=conditioned)
        return plan_sampling(lanes, steps=steps, guided=guided, calibration=calibration)

    @property
    def default_sampler(self) -> str:
        """The sampler a request gets when it names none."""
        return DMD if self.default_timesteps is not None else self.scheduler_config.default_sampler

    def _timestep_for(self, t: torch.Tensor, shape: tuple[int, ...], *, conditioned: bool) -> torch.Tensor:
        """``[1]`` for plain text-to-video, ``[1, L]`` per token when the first frame is given."""
        t = t.to(self.device, torch.float32).reshape(1)
        if not conditioned:
            return t
        _, _, frames, h, w = shape
        pt, ph, pw = self.dit.config.patch_size
        per_frame = (h // ph) * (w // pw)
        ts = t.expand(frames // pt * per_frame).clone()
        ts[:per_frame] = 0.0  # first-frame tokens are clean
        return ts[None]

    # ----------------------------------------------------------------------------------------
    # Warm-up
    @torch.no_grad()
    def warm_up(self, *, height: int, width: int, frames: int, guidance: float,
                decode: Callable[[torch.Tensor], object] | None = None) -> None:
        """A decode and one sampling step at this size, through the same paths a job takes (the
        guidance split and Ulysses in a group): the first-call costs (FlashAttention-4's compile,
        Triton compiles, cuDNN autotuning per shape, the fast decoder's plans) are paid here, at
        load, not inside the first job's stages. CUDA only (nothing is compiled or tuned on the
        CPU). In a group every rank calls it, as every rank runs a job's calls.

        The decode comes first: it needs only the VAE, so where FlashAttention-4's import (started
        by `from_pretrained` on a thread) is still running, it runs meanwhile. It
        decodes ``SHAPE_COVERING_LATENT_FRAMES`` latent frames: a decode of those runs every shape a
        decode of the whole video does (``vae_plan``), in a fraction of its time. ``decode``: what a
        job's decode runs on its normalised latents ``[48, T, h, w]`` (default
        ``self.decode(latents, on_device=True)``); the runner passes its own, which also converts
        the frames to yuv420p and copies them to the host, so that no first call of those is left
        to the first job either. The step's guidance is the denoiser's `warm_up_guidance` (one
        forward where a guided step is two of the same shapes), its sampler euler (any sampler's
        step runs the same forward, and euler needs no timestep list).

        Timed as the phases "warm-up decode", "attention warm-up" and "warm-up sampling"
        (``pan2render.phases``)."""
        if self.device.type == "cuda":
            self._warm_up(height=height, width=width, frames=frames, guidance=guidance, decode=decode)

    def _warm_up(self, *, height: int, width: int, frames: int, guidance: float,
                 decode: Callable[[torch.Tensor], object] | None) -> None:
        """`warm_up`'s steps, on any device (the tests run them on the CPU)."""
        on_cuda = self.device.type == "cuda"
        sync = torch.cuda.synchronize if on_cuda else None
        req = SampleRequest(height=height, width=width, frames=frames, steps=1, guidance=guidance, seed=0,
                            sampler="euler", geometry=Geometry.of(self.vae.config, self.dit.config))
        lat = torch.zeros(self.vae.config.z_dim, min(SHAPE_COVERING_LATENT_FRAMES, req.latent_frames),
                          req.height // 16, req.width // 16)  # [48, T', h, w]
        with phase("warm-up decode", sync=sync):
            if decode is None:
                self.decode(lat, on_device=True)
            else:
                decode(lat)
        with phase("attention warm-up", sync=sync):
            self.warm_up_attention()
        ctx = torch.zeros(512, self.dit.config.text_dim)  # [512, text_dim]: no prompt needed
        with phase("warm-up sampling", sync=sync):
            self.sample(prompt_embeds=ctx, negative_prompt_embeds=ctx, height=height, width=width,
                        frames=frames, steps=1, guidance=self.denoiser.warm_up_guidance(guidance), seed=0,
                        sampler="euler")
        if on_cuda:
            torch.cuda.synchronize()

    def warm_up_attention(self) -> None:
        """Compile (or load from disk) FlashAttention-4's kernel where it runs, after its import
        ends; a no-op elsewhere. `warm_up` calls it; without it the first forward does."""
        warm_up_attention(self.device, self.config.dtype, heads=self.dit.config.num_attention_heads,
                          head_dim=self.dit.config.attention_head_dim,
                          compile_cache=cache_root() / "flash-attn-4")

    # ----------------------------------------------------------------------------------------
    # Decoding
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, on_device: bool = False) -> torch.Tensor | None:
        """Normalised latents ``[48, T, h, w]`` (or ``[1, 48, T, h, w]``) -> uint8 CPU ``[F, H, W, 3]``
        (None where the frame decoder leaves no frames: ranks other than 0 of a group's split decode).
        ``on_device``: leave the frames on the pipeline's device (the caller converts them there
        before its own host copy)."""
        if latents.dim() == 4:
            latents = latents[None]
        if latents.dim() != 5 or latents.shape[0] != 1 or latents.shape[1] != self.vae.config.z_dim:
            raise ValueError(f"latents must be [{self.vae.config.z_dim}, T, h, w], got {list(latents.shape)}")
        if not bool(torch.isfinite(latents).all()):
            raise FloatingPointError("non-finite values in the latents to decode")
        z = self.vae.denormalize_latents(latents.to(self.device, torch.float32))
        frames = self.frame_decoder.decode(z)
        if frames is None or on_device:
            return frames
        return frames.cpu()  # the one device -> host copy


def _x0_frames(x: torch.Tensor, v: torch.Tensor, sigma: float, first_frame: torch.Tensor | None,
               frames: tuple[int, ...]) -> torch.Tensor:
    """The clean estimate of a step (``x`` its input latents ``[1, C, T, h, w]``, ``v`` its velocity)
    for ``frames`` alone: ``[C, len(frames), h, w]`` float32 on their device, the conditioning frame
    (where given) as it is. The sampler's own arithmetic on a slice: nothing it holds is written."""
    index = torch.tensor(frames, device=x.device)
    x0 = clean_estimate(x[0].index_select(1, index).float(), v[0].index_select(1, index).float(), sigma)
    if first_frame is not None and frames[0] == 0:
        x0[:, 0] = first_frame[0, :, 0]
    return x0


@contextlib.contextmanager
def _quick_thread_switches(seconds: float = 0.0005) -> Iterator[None]:
    """Python's thread switch interval lowered (default 5 ms) while a load runs: the weight
    readers take the GIL only between reads, and with an import running on another thread each of
    those takes would otherwise wait up to a whole interval."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def load_vae(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> WanVAE:
    """The Wan2.2 VAE from a checkpoint root or its ``vae/`` folder (safetensors only)."""
    folder = resolve_component(path, "vae")
    config = _config_of(folder, WanVAEConfig)
    return instantiate(lambda: WanVAE(config), folder, device=device, dtype=dtype)


def load_dit(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> PAN2DiT:
    """The PAN2 DiT from a checkpoint root or its ``transformer/`` folder (safetensors only)."""
    folder = resolve_component(path, "transformer")
    config = _config_of(folder, PAN2DiTConfig)
    return instantiate(lambda: PAN2DiT(config), folder, device=device, dtype=dtype,
                       keep_in_fp32=DIT_KEEP_IN_FP32 if dtype != torch.float32 else ())


def _config_of(folder: Path, cls):
    raw = read_json(folder / "config.json")
    try:
        return cls.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ModelFolderError(f"{folder / 'config.json'}: {e}") from e


def model_dmd_timesteps(root: Path, num_train_timesteps: int) -> tuple[int, ...] | None:
    """The checkpoint's own DMD timesteps (``dmd_denoising_steps``), or None when it lists none."""
    listed = listed_dmd_timesteps(root)
    if listed is None:
        return None
    path, value = listed
    problem = timesteps_problem(value, num_train_timesteps=num_train_timesteps)
    if problem is not None:
        raise ModelFolderError(f"{path}: {DMD_TIMESTEPS_KEY} {problem}")
    return tuple(value)


__all__ = ["PAN2Pipeline", "PAN2PipelineConfig", "SampleRequest", "apply_guidance", "default_denoiser",
           "default_frame_decoder", "load_dit", "load_vae", "make_denoiser", "to_uint8_frames"]
