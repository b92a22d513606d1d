"""An in-process stand-in for ``PAN2Pipeline`` with the same methods, for runner tests.

It lives in the package (not under ``tests/``) so Ray worker processes can import it by name:
``PAN2_RENDER_PIPELINE=pan2render.runner.worker.fake_pipeline:load_fake_pipeline`` makes the driver hand it to
every worker. It is deterministic (same seed -> same latents -> same frames), cheap, and can be
slowed down per sampling step (``PAN2_FAKE_STEP_SECONDS``) so a test can kill a driver mid-batch.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from pan2render.lanes import CACHE_NONE, FastLanes, SamplingPlan, plan_sampling, published_calibration
from pan2render.models.preview import PREVIEW_FRAMES, PreviewHook, PreviewLatents, RgbMap
from pan2render.models.sampler_state import CheckpointKey, SamplerState, SamplingPreempted, StepCheckpointError
from pan2render.models.samplers import StepState
from pan2render.parallel import parallelize_pipeline
from pan2render.phases import phase
from pan2render.vae_plan import SHAPE_COVERING_LATENT_FRAMES

FAKE_FACTORY = "pan2render.runner.worker.fake_pipeline:load_fake_pipeline"
TEXT_DIM = 16
LATENT_CHANNELS = 48
# The map of the stand-in's decode (its first three channels, x40 around mid-grey): its previews
# are its frames at the latent grid.
FAKE_RGB_MAP = RgbMap(weight=tuple(tuple(40 / 127.5 if c == k else 0.0 for k in range(3)) if c < 3 else (0.0,) * 3
                                   for c in range(LATENT_CHANNELS)),
                      bias=(128 / 127.5 - 1,) * 3, source="the fake pipeline's decode")


class FakePipeline:
    def __init__(self, model: str, *, step_seconds: float = 0.0, nan: bool = False):
        self.nan = nan
        self.model_id = "fake-" + hashlib.sha256(model.encode()).hexdigest()[:8]
        self.text_encoder_id = "fake-text-v1"
        self.step_seconds = step_seconds
        self.loras: list[tuple[float, float]] = []  # (adapter, scale) merged, as set_loras leaves them

    preview_map = FAKE_RGB_MAP

    def describe(self) -> dict[str, object]:
        return {"ranks": 1, "guided_steps": "one rank", "unguided_steps": "one rank",
                "decode": "fake", "scheduler": {"num_train_timesteps": 1000}}

    def read_lora(self, source: bytes, *, name: str | None = None) -> float:
        """A stand-in adapter: its effect on the latents (a number from its bytes)."""
        return int.from_bytes(hashlib.sha256(source).digest()[:2], "little") / 65536.0

    def set_loras(self, adapters: list[tuple[float, float]]) -> bool:
        changed = adapters != self.loras
        self.loras = list(adapters)
        return changed

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
        g = torch.Generator().manual_seed(seed)
        return torch.randn(512, TEXT_DIM, generator=g)  # float32 [512, text_dim]

    def sample(self, *, prompt_embeds: torch.Tensor, negative_prompt_embeds: torch.Tensor | None = None,
               image: Any = None, height: int, width: int, frames: int, steps: int | None, guidance: float,
               seed: int, flow_shift: float = 5.0, sampler: str = "unipc",
               timesteps: tuple[int, ...] | None = None,
               progress: Callable[[int, int], None] | None = None, resume_from: SamplerState | None = None,
               checkpoint_every_s: float = 0.0, on_checkpoint: Callable[[SamplerState], None] | None = None,
               should_stop: Callable[[], bool] | None = None, preview_every_s: float = 0.0,
               on_preview: Callable[[PreviewLatents], None] | None = None, preview_frames: int = PREVIEW_FRAMES,
               **_: Any) -> torch.Tensor:
        """As PAN2Pipeline.sample, step checkpoints and previews included (a state is its latents and
        step; a preview shows its latents, which are their own clean estimate here)."""
        if steps is None:  # dmd: as many steps as timesteps
            if timesteps is None:
                raise ValueError("sampler dmd needs timesteps")
            steps = len(timesteps)
        if height % 16 or width % 16 or (frames - 1) % 4:
            raise ValueError(f"bad size {height}x{width}x{frames}")
        g = torch.Generator().manual_seed(seed)
        lat = torch.randn(LATENT_CHANNELS, (frames - 1) // 4 + 1, height // 16, width // 16, generator=g)
        lat = lat + prompt_embeds.mean() + sum(a * scale for a, scale in self.loras)
        if image is not None:  # the contract: uint8 [H, W, 3] (an array, not a path)
            img = torch.as_tensor(image)
            if img.dtype != torch.uint8 or img.ndim != 3 or img.shape[2] != 3:
                raise ValueError(f"image must be uint8 [H, W, 3], got {img.dtype} {list(img.shape)}")
            lat[:, 0] += img.float().mean() / 255.0
        key = CheckpointKey(model_id=self.model_id, sampler=sampler, total_steps=steps,
                            latent_shape=(1, *lat.shape), seed=seed, guidance=float(guidance))
        start = 0
        if resume_from is not None:
            if resume_from.key != replace(key, spec_hash=resume_from.key.spec_hash):
                raise StepCheckpointError("cannot resume from this step checkpoint: stale: another request")
            lat, start = resume_from.latents[0].clone(), resume_from.step
        last_checkpoint = time.monotonic()
        previews = PreviewHook(every_s=preview_every_s, on_preview=on_preview, frames=preview_frames)
        previews.start()
        for step in range(start + 1, steps + 1):
            if self.step_seconds:
                time.sleep(self.step_seconds)
            lat = lat * (1.0 - 0.5 / steps)
            if progress is not None:
                progress(step, steps)
            if step == steps:
                break
            previews.at_boundary(step=step, total_steps=steps, latent_frames=lat.shape[1],
                                 estimate=functools.partial(_frames_of, lat))
            due = checkpoint_every_s > 0 and time.monotonic() - last_checkpoint >= checkpoint_every_s
            stop = should_stop is not None and should_stop()
            if due or stop:
                state = SamplerState(key=key, latents=lat[None].clone(), schedule=torch.zeros(steps + 1),
                                     generator=torch.Generator().get_state(),
                                     sampler=StepState(step=step, tensors={}, counters={}))
                if on_checkpoint is not None:
                    on_checkpoint(state)
                last_checkpoint = time.monotonic()
                if stop:
                    raise SamplingPreempted(state)
        if not FastLanes.of(_).exact:  # a fast lane: a little off the exact latents, deterministically
            lat = lat + 0.05 * torch.randn(lat.shape, generator=torch.Generator().manual_seed(seed + 1))
        if self.nan:
            lat[0, 0, 0, 0] = float("nan")
        return lat  # float32 [48, T, h, w]

    def sampling_plan(self, *, steps: int | None, guidance: float, conditioned: bool = False,
                      timesteps: tuple[int, ...] | None = None, **lanes: Any) -> SamplingPlan:
        steps = len(timesteps) if steps is None and timesteps is not None else steps
        assert steps is not None
        fast = FastLanes.of(lanes)
        calibration = None if fast.cache == CACHE_NONE else published_calibration(conditioned=conditioned)
        return plan_sampling(fast, steps=steps, guided=guidance > 1.0, calibration=calibration)

    def decode(self, latents: torch.Tensor, *, on_device: bool = False) -> torch.Tensor:
        c, t, h, w = latents.shape
        frames = 1 + 4 * (t - 1)
        base = latents[:3].repeat_interleave(4, dim=1)[:, :frames]  # [3, frames, h, w]
        base = torch.nn.functional.interpolate(base, scale_factor=16, mode="nearest")  # [3, F, H, W]
        rgb = (base.permute(1, 2, 3, 0) * 40 + 128).clamp(0, 255).to(torch.uint8)
        return rgb.contiguous()  # uint8 [frames, H, W, 3]


def _frames_of(lat: torch.Tensor, frames: tuple[int, ...]) -> torch.Tensor:
    return lat[:, list(frames)]  # [48, len(frames), h, w]


@parallelize_pipeline.register
def _replicated(pipe: FakePipeline, group: object) -> FakePipeline:
    """In a group the stand-in runs the same computation on every rank (same seed, same result)."""
    return pipe


def load_fake_pipeline(model: str, device: str) -> FakePipeline:
    return FakePipeline(model, step_seconds=float(os.environ.get("PAN2_FAKE_STEP_SECONDS", "0")))


def load_nan_pipeline(model: str, device: str) -> FakePipeline:
    """Always produces a NaN in its latents (the non-finite failure path)."""
    return FakePipeline(model, nan=True)


class WarmingPipeline(FakePipeline):
    """With ``PAN2Pipeline.warm_up``'s contract (which on the CPU does nothing): the decode it is
    given on ``SHAPE_COVERING_LATENT_FRAMES`` latent frames of zeros at the warm-up size, then one
    sampling step, each a phase. Keeps the latents it handed to ``decode``."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.warm_decoded: list[torch.Tensor] = []

    def warm_up(self, *, height: int, width: int, frames: int, guidance: float,
                decode: Callable[[torch.Tensor], object] | None = None) -> None:
        lat = torch.zeros(48, min(SHAPE_COVERING_LATENT_FRAMES, (frames - 1) // 4 + 1), height // 16, width // 16)
        with phase("warm-up decode"):
            self.warm_decoded.append(lat)
            if decode is None:
                self.decode(lat, on_device=True)
            else:
                decode(lat)
        with phase("warm-up sampling"):
            self.sample(prompt_embeds=torch.zeros(512, TEXT_DIM), height=height, width=width, frames=frames,
                        steps=1, guidance=guidance, seed=0)


_WARMING: dict[str, WarmingPipeline] = {}


def load_warming_pipeline(model: str, device: str) -> WarmingPipeline:
    """A `WarmingPipeline`, the same object for a model for the life of the process (a test reads
    what its warm-up decoded)."""
    return _WARMING.setdefault(model, WarmingPipeline(model))


class _OutOfMemoryPipeline(FakePipeline):
    def sample(self, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.60 GiB (fake)")


def load_oom_pipeline(model: str, device: str) -> FakePipeline:
    """Runs out of (device) memory in every sampling call, as torch reports it."""
    return _OutOfMemoryPipeline(model)


class _ShortDecodePipeline(FakePipeline):
    def decode(self, latents: torch.Tensor, *, on_device: bool = False) -> torch.Tensor:
        return super().decode(latents, on_device=on_device)[:-1]  # uint8 [frames - 1, H, W, 3]


def load_short_decode_pipeline(model: str, device: str) -> FakePipeline:
    """Its decode returns one frame fewer than the latents hold (a decoder that loses a frame)."""
    return _ShortDecodePipeline(model)


class _OwnEncoderPipeline(FakePipeline):
    """A text encoder of each model's own: its id and its embeddings depend on the model, as a
    checkpoint with another umT5 gives."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.text_encoder_id = "fake-text-" + hashlib.sha256(model.encode()).hexdigest()[:8]

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        return super().encode_prompt(f"{self.text_encoder_id}\x00{prompt}")


def load_own_encoder_pipeline(model: str, device: str) -> FakePipeline:
    return _OwnEncoderPipeline(model)
