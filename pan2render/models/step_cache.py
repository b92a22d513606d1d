"""The fast-lane velocity function: a `SamplingPlan` (``pan2render.lanes``) run over any denoiser.

A denoiser (``pan2render.models.strategies``, ``pan2render.parallel``) gives its
`BranchForwards`: per step, the velocity of each guidance branch asked for, every branch's forward
handed a `BlockStack` (``pan2render.models.dit``). `fast_lane_velocity` asks for what the plan says
and combines it:

- a branch that computes runs its blocks through `KeepResidual`, which keeps the block residual
  ``blocks(x) - x`` of the whole sequence in the branch's `ResidualSlot` (a sequence-parallel
  forward gathers its shards: any layout of the group can reuse it);
- a branch that reuses runs `ReuseResidual`: ``x + kept residual``, no block;
- a guided step combines both branches as `apply_guidance` does; a gated one (after
  ``guidance_until``) adds ``(guidance - 1)`` times the last guided step's ``cond - uncond`` to the
  conditional velocity.

With nothing to reuse and no step gated the result is the exact path's, bit for bit: a computing
forward returns its blocks' output as it is (the residual is a copy taken beside it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..lanes import Action, Branch, SamplingPlan
from .dit import BlockStack, TokenWindow
from .strategies import BranchForwards, VelocityFn, apply_guidance

__all__ = ["KeepResidual", "RatioRecorder", "ResidualSlot", "ReuseResidual", "fast_lane_velocity"]


@dataclass
class ResidualSlot:
    """One branch's kept block residual, ``[B, L, dim]`` for the whole sequence (None: none yet)."""

    residual: Tensor | None = None


@dataclass(frozen=True)
class KeepResidual:
    """A `BlockStack` that runs the blocks and keeps their residual in ``slot``."""

    slot: ResidualSlot

    def __call__(self, tokens: Tensor, run: Callable[[Tensor], Tensor], window: TokenWindow) -> Tensor:
        out = run(tokens)
        self.slot.residual = window.whole(out - tokens)
        return out


@dataclass(frozen=True)
class ReuseResidual:
    """A `BlockStack` that stands in for the blocks: the tokens plus ``slot``'s kept residual."""

    slot: ResidualSlot

    def __call__(self, tokens: Tensor, run: Callable[[Tensor], Tensor], window: TokenWindow) -> Tensor:
        if self.slot.residual is None:
            raise RuntimeError("a step reuses a block residual that no earlier step kept (a plan's first "
                               "evaluation of a branch always computes)")
        return tokens + window.part(self.slot.residual).to(tokens.dtype)


@dataclass
class RatioRecorder:
    """MagCache's calibration, taken on an exact run: per branch and step, the mean over tokens of
    ``||r_i|| / ||r_{i-1}||`` (each token's block residual norm against the step before's)."""

    ratios: dict[Branch, list[float]] = field(default_factory=lambda: {b: [] for b in Branch})
    _norms: dict[Branch, Tensor] = field(default_factory=dict)

    def stack(self, branch: Branch) -> BlockStack:
        def record(tokens: Tensor, run: Callable[[Tensor], Tensor], window: TokenWindow) -> Tensor:
            out = run(tokens)
            norms = window.whole(out - tokens).float().norm(dim=-1)  # [B, L]
            before = self._norms.get(branch)
            self.ratios[branch].append(1.0 if before is None else float((norms / before).mean()))
            self._norms[branch] = norms
            return out

        return record


def fast_lane_velocity(forwards: BranchForwards, plan: SamplingPlan, guidance: float, *,
                       compute: Mapping[Branch, BlockStack] | None = None) -> VelocityFn:
    """One job's ``(latents, timestep) -> velocity`` following ``plan``, one call per step in
    order. ``compute``: the block stack of each branch's computing steps (default `KeepResidual`
    when the plan reuses anything, else the plain blocks); `RatioRecorder` passes its own."""
    slots = {b: ResidualSlot() for b in Branch}
    reuses = any(a is Action.REUSE for step in plan.steps for a in step.values())
    stacks: dict[tuple[Branch, Action], BlockStack | None] = {}
    for b in Branch:
        stacks[b, Action.COMPUTE] = (compute or {}).get(b, KeepResidual(slots[b]) if reuses else None)
        stacks[b, Action.REUSE] = ReuseResidual(slots[b])
    gates = plan.guided and plan.guided_steps < len(plan)
    state: dict[str, object] = {"step": 0, "delta": None}

    def velocity(x: Tensor, t: Tensor) -> Tensor:
        i = state["step"]
        assert isinstance(i, int)
        if i >= len(plan):
            raise RuntimeError(f"the plan has {len(plan)} steps; the sampler asked for step {i + 1}")
        state["step"] = i + 1
        needs = {b: stacks[b, a] for b, a in plan.steps[i].items() if a is not Action.ABSENT}
        v = forwards(x, t, needs=needs)
        if not plan.guided:
            return v[Branch.COND]
        if Branch.UNCOND in v:
            if gates:
                state["delta"] = v[Branch.COND] - v[Branch.UNCOND]
            return apply_guidance(v[Branch.COND], v[Branch.UNCOND], guidance)
        delta = state["delta"]
        assert isinstance(delta, torch.Tensor)  # a plan guides its first step at least
        return v[Branch.COND] + (guidance - 1.0) * delta

    return velocity
