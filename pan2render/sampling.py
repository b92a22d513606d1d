"""Sampler names, the video geometry, and the rules that tie a job's ``sampler``, ``timesteps`` and
``guidance`` together.

One torch-free place shared by batch validation (``pan2render.jobs``), the sampling request
(``pan2render.models.pipeline``), the model configs and the samplers themselves
(``pan2render.models.samplers``), so that a job the batch accepts is a job the pipeline runs, and
the reverse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def is_int(value: object) -> bool:
    """An int that is not a bool (YAML and JSON ``true`` must not pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Geometry:
    """How a video's pixels map to latent cells and DiT tokens: the VAE's compression, then the
    DiT's patch. A loaded model's comes from its configs (``Geometry.of``); ``WAN22`` is the one of
    every checkpoint the loader accepts, which a batch is checked against before any model loads."""

    vae_spatial: int = 16  # pixels per latent cell, each side (WanVAEConfig.scale_factor_spatial)
    vae_temporal: int = 4  # frames per latent frame after the first (WanVAEConfig.scale_factor_temporal)
    patch: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) latent cells per token (PAN2DiTConfig.patch_size)
    # Largest token-grid extent per axis that the DiT's RoPE table holds (PAN2DiTConfig.rope_max_seq_len):
    # a longer video has positions the table has no angles for.
    rope_extent: int = 1024

    @classmethod
    def of(cls, vae_config: Any, dit_config: Any) -> "Geometry":
        """From a ``WanVAEConfig`` and a ``PAN2DiTConfig`` (read by attribute: no torch here)."""
        return cls(vae_spatial=vae_config.scale_factor_spatial, vae_temporal=vae_config.scale_factor_temporal,
                   patch=tuple(dit_config.patch_size), rope_extent=dit_config.rope_max_seq_len)

    @property
    def spatial_multiple(self) -> int:
        """What height and width must be a multiple of: a whole number of tokens per side."""
        return math.lcm(self.vae_spatial * self.patch[1], self.vae_spatial * self.patch[2])

    def frames_ok(self, frames: int) -> bool:
        """The causal VAE keeps the first frame and packs every further ``vae_temporal`` into one."""
        return frames >= 1 and (frames - 1) % self.vae_temporal == 0

    def latent_frames(self, frames: int) -> int:
        return (frames - 1) // self.vae_temporal + 1

    @property
    def max_frames(self) -> int:
        """The most frames whose token grid fits the RoPE table along time (4093 for Wan2.2)."""
        return (self.rope_extent * self.patch[0] - 1) * self.vae_temporal + 1

    def tokens(self, *, frames: int, height: int, width: int) -> int:
        """The DiT's sequence length for a video of this size."""
        cell = self.vae_spatial
        return (self.latent_frames(frames) // self.patch[0] * (height // (cell * self.patch[1]))
                * (width // (cell * self.patch[2])))


WAN22 = Geometry()

# The samplers a job may name. "dmd" is the few-step sampler of step-distilled checkpoints
# (distribution matching distillation): it takes an explicit list of timesteps and no guidance.
SAMPLERS: tuple[str, ...] = ("unipc", "euler", "dmd")
DMD = "dmd"
# What diffusers' flow schedulers default to, and every Wan2.x checkpoint uses.
DEFAULT_NUM_TRAIN_TIMESTEPS = 1000


def timesteps_problem(timesteps: object, *, num_train_timesteps: int) -> str | None:
    """What is wrong with a DMD ``timesteps`` list (None if nothing): a non-empty list of integers
    in [1, num_train_timesteps], strictly decreasing (the first is the noisiest)."""
    allowed = (f"a non-empty list of integers in 1..{num_train_timesteps}, strictly decreasing, "
               "e.g. [1000, 757, 522]")
    if not isinstance(timesteps, (list, tuple)):
        return f"got {timesteps!r}; allowed: {allowed}"
    if not timesteps:
        return f"is empty; allowed: {allowed}"
    bad = [t for t in timesteps if isinstance(t, bool) or not isinstance(t, int)]
    if bad:
        return f"got {bad[0]!r} ({type(bad[0]).__name__}) in {list(timesteps)}; allowed: {allowed}"
    out = [t for t in timesteps if not 1 <= t <= num_train_timesteps]
    if out:
        return f"{out[0]} in {list(timesteps)} is out of range; allowed: {allowed}"
    for a, b in zip(timesteps, timesteps[1:]):
        if b >= a:
            return f"{list(timesteps)} is not strictly decreasing ({a} then {b}); allowed: {allowed}"
    return None


def combination_problems(*, sampler: str, timesteps: Sequence[int] | None, guidance: float
                         ) -> list[tuple[str, str]]:
    """(field, message) for every rule a sampler/timesteps/guidance combination breaks."""
    problems: list[tuple[str, str]] = []
    if sampler == DMD and guidance > 1:
        problems.append(("guidance", f"got {guidance:g} with sampler dmd; allowed: 1 (a step-distilled "
                                     "checkpoint runs without classifier-free guidance)"))
    if sampler != DMD and timesteps is not None:
        problems.append(("timesteps", f"set with sampler {sampler!r}; timesteps are for sampler dmd only "
                                      "(use steps with unipc or euler)"))
    return problems


# sigma_0 is nudged below 1 by this much so that log(1 - sigma_0) is finite (diffusers does the same,
# scheduling_unipc_multistep.py set_timesteps, "to avoid inf torch.log(alpha_si)").
SIGMA_MAX_NUDGE = 1e-6


def flow_sigma_values(*, num_steps: int, flow_shift: float, num_train_timesteps: int) -> list[float]:
    """The N shifted noise levels sigma_0 > ... > sigma_{N-1} of the flow-matching samplers (the
    final 0 not included), in float64: what ``models.samplers.flow_sigmas`` returns as a tensor.

    Mirrors numpy's linspace arithmetic (``i * step + start``, last point excluded) so that the
    int64 truncation of ``sigma * T`` gives diffusers' timesteps exactly.
    """
    start, stop = 1.0, 1.0 / num_train_timesteps
    step = (stop - start) / num_steps  # linspace(start, stop, N + 1): N intervals
    sigmas = []
    for i in range(num_steps):
        u = float(i) * step + start
        sigmas.append(flow_shift * u / (1 + (flow_shift - 1) * u))
    if sigmas and abs(sigmas[0] - 1.0) < SIGMA_MAX_NUDGE:
        sigmas[0] -= SIGMA_MAX_NUDGE
    return sigmas
