"""The two strategies a `PAN2Pipeline` is built from: how it denoises and how it decodes frames.

A pipeline holds one `Denoiser` and one `FrameDecoder`, given at construction. The single-process
implementations live here; the sequence-parallel ones (Ulysses, the guidance split, the decode split
over a group) live in `pan2render.parallel`, which imports these protocols and `apply_guidance` from
here and builds a parallel pipeline with `parallel.parallelize_pipeline`. Nothing in `models/` knows
about process groups.

- `Denoiser`: per job, ``prepare(cond, uncond, guidance)`` computes what depends only on the text
  (the cross-attention K/V) and returns a `VelocityFn`, ``(latents, timestep) -> velocity`` with
  classifier-free guidance applied, called once per sampling step. Implementation here:
  `SeparateGuidance` (each guidance branch its own batch-1 forward; one batch-2 forward measured
  equal within noise on an H200 at twice the activation peak: docs/performance.md, DiT).
  ``branch_forwards(cond, uncond)`` exposes the same forwards one guidance branch at a time
  (`BranchForwards`), each with the `BlockStack` a fast lane gives it: what
  `pan2render.models.step_cache.fast_lane_velocity` runs a job's `SamplingPlan` over.
- `FrameDecoder`: raw latents -> uint8 frames ``[F, H, W, 3]`` on the pipeline's device, or None on a
  process that does not hold the frames (ranks other than 0 of a group). Implementations here:
  `ReferenceDecoder` (`WanVAE.decode`) and `FastDecoder` (the fast decoder, with the reference as its
  fallback; which of the two runs is `kernels.vae_decode.choose_decode_path`'s decision).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Protocol

import torch
from torch import Tensor

from ..kernels.vae_decode import DecodePath, choose_decode_path, fast_decoder_for, log_fallback, to_uint8_frames
from ..lanes import Branch
from .dit import BlockStack
from .vae import WanVAE

__all__ = [
    "BranchForwards",
    "DiTModule",
    "Denoiser",
    "FastDecoder",
    "FrameDecoder",
    "ReferenceDecoder",
    "SeparateGuidance",
    "VelocityFn",
    "apply_guidance",
    "make_denoiser",
]

VelocityFn = Callable[[Tensor, Tensor], Tensor]  # (latents, timestep) -> velocity


def apply_guidance(pred: Tensor, pred_uncond: Tensor, guidance: float) -> Tensor:
    """Classifier-free guidance: the unconditional velocity moved ``guidance`` times the way the
    conditional one differs from it (diffusers' WanPipeline order of operations)."""
    return pred_uncond + guidance * (pred - pred_uncond)


class DiTModule(Protocol):
    """What a denoiser calls: `PAN2DiT`, or a wrapper with the same contract (a sequence-parallel one)."""

    def prepare_context(self, context: Tensor) -> object:
        """Text embeddings ``[B, S, text_dim]`` -> what ``__call__`` accepts as its context."""

    def __call__(self, x: Tensor, timestep: Tensor, context: object, *, blocks: BlockStack | None = None) -> Tensor:
        """Latents ``[B, C, T, h, w]``, timesteps ``[B]`` or ``[B, L]`` -> velocity, same shape as x;
        ``blocks``: what runs the block stack this once (`PAN2DiT.forward`)."""


class BranchForwards(Protocol):
    """One job's forwards, one guidance branch at a time (a `Denoiser`'s ``branch_forwards``)."""

    def __call__(self, x: Tensor, t: Tensor, *, needs: Mapping[Branch, BlockStack | None]) -> dict[Branch, Tensor]:
        """The velocity of each branch in ``needs`` (its forward run with that block stack; None:
        the plain blocks), the same on every rank. Collective in a group: every rank calls it with
        the same branches."""


class Denoiser(Protocol):
    """How a pipeline turns (latents, timestep, conditioning, guidance) into a velocity."""

    @property
    def ranks(self) -> int:
        """Processes that run every step together (1: this process alone)."""

    def prepare(self, cond: Tensor, uncond: Tensor | None, guidance: float) -> VelocityFn:
        """One job's velocity function. ``cond`` / ``uncond``: text embeddings ``[1, S, text_dim]``
        on the device; ``uncond`` None for an unguided job (``guidance`` is then unused)."""

    def branch_forwards(self, cond: Tensor, uncond: Tensor | None) -> BranchForwards:
        """One job's forwards branch by branch, for a fast lane's plan (``uncond`` None: unguided)."""

    def describe(self) -> dict[str, object]:
        """How steps use the ranks, as plain JSON values: ``ranks``, ``guided_steps``, ``unguided_steps``."""

    def warm_up_guidance(self, guidance: float) -> float:
        """The guidance of the one step a load's warm-up samples for jobs at ``guidance``: the
        cheapest that runs every kernel shape the steps of such a job run."""

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is True on any of the ranks that run the steps: how they agree to stop
        at the same step boundary. Collective in a group (every rank calls it at the same boundary)."""


class FrameDecoder(Protocol):
    """How a pipeline turns raw latents into frames."""

    def decode(self, z: Tensor) -> Tensor | None:
        """Denormalised latents ``[1, z_dim, T, h, w]`` (float32, on the pipeline's device) -> uint8
        frames ``[F, H, W, 3]`` on that device, or None on a process that does not hold them."""

    def describe(self) -> str:
        """The decode path in words (recorded beside every video)."""


class SeparateGuidance:
    """One forward per guidance branch: an unguided step is one batch-1 forward, a guided step two.
    ``dit`` may itself be parallel (`parallel.UlyssesDenoiser` runs this over a Ulysses wrapper)."""

    ranks = 1

    def __init__(self, dit: DiTModule) -> None:
        self.dit = dit

    def prepare(self, cond: Tensor, uncond: Tensor | None, guidance: float) -> VelocityFn:
        dit = self.dit
        cond_ctx = dit.prepare_context(cond)
        if uncond is None:
            return lambda x, t: dit(x, t, cond_ctx)
        uncond_ctx = dit.prepare_context(uncond)

        def guided(x: Tensor, t: Tensor) -> Tensor:
            return apply_guidance(dit(x, t, cond_ctx), dit(x, t, uncond_ctx), guidance)

        return guided

    def branch_forwards(self, cond: Tensor, uncond: Tensor | None) -> BranchForwards:
        dit = self.dit
        contexts = {Branch.COND: dit.prepare_context(cond)}
        if uncond is not None:
            contexts[Branch.UNCOND] = dit.prepare_context(uncond)

        def forwards(x: Tensor, t: Tensor, *, needs: Mapping[Branch, BlockStack | None]) -> dict[Branch, Tensor]:
            return {b: dit(x, t, contexts[b], blocks=stack) for b, stack in needs.items()}

        return forwards

    def describe(self) -> dict[str, object]:
        return {"ranks": 1, "guided_steps": "one rank", "unguided_steps": "one rank"}

    def warm_up_guidance(self, guidance: float) -> float:
        return 1.0  # a guided step is two forwards of an unguided step's shapes

    def any_rank(self, flag: bool) -> bool:
        return flag  # this process alone


def make_denoiser(dit: DiTModule, cond: Tensor, uncond: Tensor | None, guidance: float) -> VelocityFn:
    """One job's ``(latents, timestep) -> velocity`` for ``dit`` on this process, as a pipeline's
    `SeparateGuidance` runs it (for benchmarks that time the bare denoiser)."""
    return SeparateGuidance(dit).prepare(cond, uncond, guidance)


class ReferenceDecoder:
    """`WanVAE.decode` in the VAE's own dtype, then the uint8 conversion on the device."""

    def __init__(self, vae: WanVAE, *, why: str = "chosen") -> None:
        self.vae = vae
        self.why = why  # why this path and not the fast one, for describe()

    def decode(self, z: Tensor) -> Tensor:
        vae_dtype = next(self.vae.parameters()).dtype
        video = self.vae.decode(z.to(vae_dtype))  # [1, 3, F, H, W] in [-1, 1]
        return to_uint8_frames(video[0])

    def describe(self) -> str:
        return f"reference decoder ({self.why})"


class FastDecoder:
    """The fast decoder (`kernels.vae_decode.fast_decoder_for`) where it runs; the reference
    decoder where it cannot (another GPU, the CPU, a VAE it does not build). The path is chosen
    once, by `kernels.vae_decode.choose_decode_path`, which logs a fallback's reason once; a decode
    that fails on the fast path (a Triton kernel variant that does not build) runs the reference
    decoder, its reason logged the same way."""

    def __init__(self, vae: WanVAE, *, device: torch.device) -> None:
        self.vae = vae
        self.device = torch.device(device)
        self.reference = ReferenceDecoder(vae)
        self._path: DecodePath | None = None

    @property
    def path(self) -> DecodePath:
        """The decode path on this process, chosen on first use."""
        if self._path is None:
            self._path = choose_decode_path(self.vae, self.device)
        return self._path

    def decode(self, z: Tensor) -> Tensor:
        frames = self.decode_fast(z)
        return self.reference.decode(z) if frames is None else frames

    def decode_fast(self, z: Tensor) -> Tensor | None:
        """uint8 ``[F, H, W, 3]`` on the device from the fast decoder, or None to fall back."""
        if not self.path.fast:
            return None
        try:
            return fast_decoder_for(self.vae, self.device).decode(z, out_dtype=torch.uint8)
        except torch.cuda.OutOfMemoryError:
            raise  # the reference decoder needs more memory, not less
        except Exception as e:  # noqa: BLE001 - e.g. a Triton kernel variant that fails to build
            log_fallback(f"the fast decoder failed ({type(e).__name__}: {e})")
            return None

    def describe(self) -> str:
        return self.path.describe()
