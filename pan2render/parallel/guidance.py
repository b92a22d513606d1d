"""Guidance parallelism: a guided step's two DiT passes on the two halves of an even group.

A classifier-free-guided step is two whole forwards, conditional and unconditional, coupled only
by the final combine. In a group of N = 2M ranks, ranks 0..M-1 run the conditional pass and ranks
M..2M-1 the unconditional one, each half sequence-parallel (Ulysses, `parallelize_dit`) over its
own M ranks when M > 1; one all-gather of the two velocities then gives every rank both, and
every rank combines them with the single-process formula (`apply_guidance`), so the sampler steps
identically everywhere and the latents equal one process's.

Why: Ulysses over the whole group splits every forward N ways but pays, per forward, two
all-to-alls per block, the packing copies around them and attention at 1/N of the heads (a
smaller, less efficient cuDNN call); on 2 H200s a guided step reached 1.83-1.86x of one GPU that
way. Splitting the branches instead leaves each half the work of one whole forward at M ranks
(M = 1 for a group of 2: the plain model, no exchange inside the forward) plus one exchange of the
velocity (~10 MB in bf16 at 704x1248x121) per step. Measured on 2 H200s in one run
(docs/performance-history.md, sequence-parallel groups, third session): one GPU 1.678 s per
guided step, Ulysses over both 0.911 s (1.843x), split 0.859 s (1.953x). Memory: a rank holds the
activations of one branch over 1/M of the tokens, as much as one GPU running that branch alone
when M = 1 (11.37 GiB per rank there, weights included, vs 10.81 with Ulysses and 11.54 on one GPU).

Unguided steps (guidance 1) have one pass and keep Ulysses over the whole group.

Fast lanes (`GuidanceSplitDenoiser.branch_forwards`): a step with both branches runs split as
above, a gated step (the conditional branch alone) Ulysses over the whole group. A step cache keeps
each branch's block residual for the whole sequence (`pan2render.models.step_cache`), so the
whole group can reuse what half 0 computed; the ranks of half 1, which never ran the conditional
branch, receive its residual from rank 0 the first time a gated step reuses it (one broadcast per
job at most). Every rank follows the same plan, so every rank takes part in the same collectives.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from pan2render.lanes import Branch
from pan2render.models.dit import BlockStack, PAN2DiT
from pan2render.models.step_cache import KeepResidual, ResidualSlot, ReuseResidual
from pan2render.models.strategies import BranchForwards, Denoiser, VelocityFn, apply_guidance

from .group import SequenceGroup, broadcast_from_first
from .ulysses import parallelize_dit

__all__ = ["GuidanceSplit", "GuidanceSplitDenoiser", "guidance_split_for"]

BRANCHES = ("conditional", "unconditional")


class GuidanceSplit:
    """The guided denoiser of an even group: this rank's half runs one branch (see the module doc).

    Built once per pipeline on every rank of ``group`` (collectively: for halves of more than one
    rank it creates their process groups), then ``denoiser(cond, uncond, guidance)`` once per job,
    on every rank with identical arguments.
    """

    def __init__(self, model: PAN2DiT, group: SequenceGroup) -> None:
        n = group.world_size
        if n < 2 or n % 2:
            raise ValueError(f"guidance parallelism needs an even group of at least 2 ranks, got {n}")
        self.group = group
        self.half_size = n // 2
        self.branch = group.rank // self.half_size  # 0: conditional, 1: unconditional
        self.half = _half_group(group, self.branch, self.half_size)
        self.dit = parallelize_dit(model, self.half)  # the plain model for halves of 1

    @property
    def branch_name(self) -> str:
        return BRANCHES[self.branch]

    def denoiser(self, cond: Tensor, uncond: Tensor, guidance: float) -> VelocityFn:
        """``(latents, timestep) -> guided velocity``, the same on every rank. Only this half's text
        K/V are prepared: the other branch's context never runs here."""
        context = self.dit.prepare_context(cond if self.branch == 0 else uncond)

        def guided(x: Tensor, t: Tensor) -> Tensor:
            mine = self.dit(x, t, context)  # this branch's velocity, whole, on every rank of the half
            pred, pred_uncond = self._exchange(mine)
            return apply_guidance(pred, pred_uncond, guidance)

        return guided

    def branch_forwards(self, cond: Tensor, uncond: Tensor, *, whole: BranchForwards) -> BranchForwards:
        """Both branches split over the halves; the conditional branch alone through ``whole``
        (Ulysses over the group). See the module doc for the residual handed to half 1."""
        context = self.dit.prepare_context(cond if self.branch == 0 else uncond)
        mine = Branch(self.branch)
        held_by_half: set[int] = set()  # ids of the slots whose residual only half 0 holds

        def forwards(x: Tensor, t: Tensor, *, needs: Mapping[Branch, BlockStack | None]) -> dict[Branch, Tensor]:
            if set(needs) == {Branch.COND, Branch.UNCOND}:
                pred, pred_uncond = self._exchange(self.dit(x, t, context, blocks=needs[mine]))
                kept = needs[Branch.COND]
                if isinstance(kept, KeepResidual):
                    held_by_half.add(id(kept.slot))
                return {Branch.COND: pred, Branch.UNCOND: pred_uncond}
            if set(needs) != {Branch.COND}:
                raise ValueError(f"a step runs the conditional branch, alone or with the other; got {set(needs)}")
            stack = needs[Branch.COND]
            slot = stack.slot if isinstance(stack, (KeepResidual, ReuseResidual)) else None
            if isinstance(stack, ReuseResidual) and id(stack.slot) in held_by_half:
                self._share(stack.slot, device=x.device)
            if slot is not None:
                held_by_half.discard(id(slot))
            return whole(x, t, needs=needs)

        return forwards

    def _share(self, slot: ResidualSlot, *, device: torch.device) -> None:
        """Rank 0's kept residual on every rank of the group (half 1 never computed it)."""
        comm = device if self.group.backend == "nccl" else torch.device("cpu")
        shared = broadcast_from_first(slot.residual if self.group.rank == 0 else None, self.group, device=comm)
        slot.residual = shared.to(device)

    def _exchange(self, mine: Tensor) -> tuple[Tensor, Tensor]:
        """(conditional, unconditional) velocities from this rank's: one all-gather over the group,
        then the first rank of each half stands for its half (every rank of a half holds the same)."""
        mine = mine.contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.group.world_size)]
        dist.all_gather(parts, mine, group=self.group.group)
        return parts[0], parts[self.half_size]


def _half_group(group: SequenceGroup, branch: int, size: int) -> SequenceGroup:
    """This rank's half as a `SequenceGroup` (a process group of its own when it has > 1 rank)."""
    rank = group.rank % size
    if size == 1:
        return SequenceGroup(group=None, rank=0, world_size=1)  # no collective ever runs on it
    handle = None
    # Every rank asks for both halves in the same order, as torch requires of overlapping creators
    # with local synchronization (only a half's own ranks then wait for each other).
    for b in range(2):
        ranks = [group.global_rank(r) for r in range(b * size, (b + 1) * size)]
        created = dist.new_group(ranks, use_local_synchronization=True)
        if b == branch:
            handle = created
    return SequenceGroup(group=handle, rank=rank, world_size=size)


def guidance_split_for(model: PAN2DiT, group: SequenceGroup, *, enabled: bool) -> GuidanceSplit | None:
    """The split for ``group`` when it applies (``enabled`` and an even group), else None: the guided
    steps then run both branches Ulysses-parallel over the whole group."""
    if not enabled or group.world_size < 2 or group.world_size % 2:
        return None
    return GuidanceSplit(model, group)


class GuidanceSplitDenoiser:
    """The `Denoiser` of an even group with the split: guided steps through ``split`` (one branch per
    half), unguided steps (one pass, nothing to split) through ``unguided``, Ulysses over the whole
    group."""

    def __init__(self, split: GuidanceSplit, *, unguided: Denoiser) -> None:
        if unguided.ranks != split.group.world_size:
            raise ValueError(f"the unguided denoiser runs on {unguided.ranks} ranks, the split on "
                             f"{split.group.world_size}: both must use the whole group")
        self.split = split
        self.unguided = unguided

    @property
    def ranks(self) -> int:
        return self.split.group.world_size

    def prepare(self, cond: Tensor, uncond: Tensor | None, guidance: float) -> VelocityFn:
        if uncond is None:
            return self.unguided.prepare(cond, None, guidance)
        return self.split.denoiser(cond, uncond, guidance)

    def branch_forwards(self, cond: Tensor, uncond: Tensor | None) -> BranchForwards:
        whole = self.unguided.branch_forwards(cond, None)
        if uncond is None:
            return whole
        return self.split.branch_forwards(cond, uncond, whole=whole)

    def warm_up_guidance(self, guidance: float) -> float:
        return guidance  # guided and unguided steps run different paths

    def any_rank(self, flag: bool) -> bool:
        return self.unguided.any_rank(flag)  # the whole group, as every step is

    def describe(self) -> dict[str, object]:
        half = self.split.half_size
        return {**self.unguided.describe(),
                "guided_steps": f"one branch per half of the group ({half} rank(s) each, Ulysses within a half)"}
