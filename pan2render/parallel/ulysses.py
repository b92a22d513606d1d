"""Ulysses sequence parallelism for the PAN2 DiT, applied to the plain model from outside.

``parallelize_dit(model, group)`` returns a `SequenceParallelDiT`: same call signature as
`PAN2DiT` (``forward(x, timestep, context)``, ``prepare_context``, ``config``), same full output on
every rank. Inside, in this order (DeepSpeed-Ulysses, arXiv:2309.14509):

1. every rank patchifies the whole latent (one cheap strided conv) and keeps its shard of the
   token sequence: ``s = ceil(L / N)`` tokens from ``rank * s``; the last shard(s) are padded with
   zero tokens up to ``s``, so every all-to-all moves equal chunks;
2. the blocks run on the shard. Everything in a block is per token except self-attention: AdaLN
   modulation (the per-token timestep index sliced to the shard), Q/K RMSNorm (across all heads,
   i.e. over one token's 3072 features), RoPE (the shard's rows of the table, computed for its
   position offset), cross-attention (every rank holds the whole text K/V), the feed-forward;
3. self-attention (`UlyssesAttention`, each block's ``attn1.attention_fn`` during the forward): one
   all-to-all turns (all heads, my tokens) into (my heads, all tokens) for q, k and v together;
   the padding tokens, which sit at the end of the padded global sequence, are sliced off before
   the attention call, so they are never attended to and never attend; the output is padded back
   and a second all-to-all returns (all heads, my tokens). Everything stays token-major. q, k, v
   arrive already in the send layout (``head_groups``: the Q/K kernel and the v projection write
   it), and q's and k's exchanges overlap the v projection; one unpacking copy remains on the way
   out. (Splitting a rank's heads into groups whose exchanges overlap the other groups' attention
   measured no gain on NVLink: docs/performance.md, sequence-parallel groups);
4. the head (final AdaLN + proj_out) runs on the shard; an all-gather concatenates the shards and
   drops the padding; every rank unpatchifies the same full velocity, so the sampler steps
   identically everywhere and every rank ends with the same latents.

Heads must divide by the group size (24 heads: groups of 2, 3, 4, 6, 8). The wrapper installs
its `UlyssesAttention` on the blocks only for the duration of its own forward and puts the plain
``attn1.attention_fn`` back after, so the model stays plain outside it: the attention backend is
whatever ``attn1.attention_fn`` is at call time, and several wrappers over different groups can
share one model (`pan2render.parallel.guidance` runs the same model whole-group for unguided steps
and over half the group for each guidance branch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pan2render.models.dit import AttentionOp, BlockStack, ContextCache, PAN2DiT, TimestepConditioning, TokenWindow
from pan2render.models.strategies import BranchForwards, SeparateGuidance, VelocityFn

from .group import SequenceGroup, all_gather_seq, any_rank, comm_device

__all__ = ["SequenceParallelDiT", "ShardLayout", "UlyssesAttention", "UlyssesDenoiser", "parallelize_dit"]

AttentionFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's tokens sit in the sequence of one forward call."""

    num_tokens: int  # L, the real sequence length
    world_size: int  # N
    rank: int

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad shard layout: {self.num_tokens} tokens, rank {self.rank} of {self.world_size}")

    @property
    def shard(self) -> int:
        """Tokens per rank after padding: ceil(L / N)."""
        return -(-self.num_tokens // self.world_size)

    @property
    def padded(self) -> int:
        """The padded sequence length N * shard (padding at the end)."""
        return self.shard * self.world_size

    @property
    def start(self) -> int:
        """First real token of this rank (clamped to L for an all-padding shard)."""
        return min(self.rank * self.shard, self.num_tokens)

    @property
    def length(self) -> int:
        """Real tokens on this rank (shard minus its padding)."""
        return min(self.start + self.shard, self.num_tokens) - self.start


class UlyssesAttention(AttentionOp):
    """Self-attention of the whole sequence computed from sequence shards (see the module doc).

    An `AttentionOp`: q, k, v ``[B, H, s, D]`` (this rank's padded shard, all heads) ->
    ``[B, H, s, D]``. ``v`` may also be a zero-argument callable
    returning it (``accepts_lazy_v``): `SelfAttention` then passes its v projection unevaluated,
    and q's and k's exchanges run on the communication stream while the v GEMM computes (two
    thirds of the inbound all-to-all hidden behind it).
    """

    accepts_lazy_v = True  # see the class doc

    def __init__(self, inner: AttentionFn, *, group: SequenceGroup, layout: ShardLayout) -> None:
        self.inner = inner
        self.group = group
        self.layout = layout  # of the forward in progress (the wrapper installs one per forward)

    @property
    def head_groups(self) -> int:
        """q, k, v come as ``[N, B, s, H/N, D]`` contiguous, the send buffer itself (measured on 2
        H200s: the packing copies of q, k, v were ~30 ms of a 0.91 s guided step)."""
        return self.group.world_size

    def __call__(self, q: Tensor, k: Tensor, v: Tensor | Callable[[], Tensor]) -> Tensor:
        layout = self.layout
        n = self.group.world_size
        if q.dim() == 5:  # [N, B, s, H/N, D]: already the send layout (head_groups)
            if q.shape[0] != n:
                raise RuntimeError(f"head-grouped q {tuple(q.shape)} needs {n} groups")
            batch, shard, head_dim = q.shape[1], q.shape[2], q.shape[4]
            heads = n * q.shape[3]
        else:
            batch, heads, shard, head_dim = q.shape
        if shard != layout.shard:
            raise RuntimeError(f"attention got a shard of {shard} tokens, expected {layout.shard}")
        hn = heads // n  # heads per rank

        # Everything stays token-major ([.., tokens, heads, D] in memory), the layout cuDNN reads as
        # strided views (bench: head-major repacking cost ~9% of a group step). (all heads, my
        # tokens) -> (my heads, all tokens): send [N, B, s, H/N, D], as it lies when it came
        # head-grouped, else packed from the token-major view [B, s, N, H/N, D] (one copy).
        def post(t: Tensor) -> _Pending:
            if t.dim() == 5:  # the send buffer as it lies: no packing copy
                return _all_to_all(t, self.group)
            return _all_to_all(_token_major(t).unflatten(2, (n, hn)).permute(2, 0, 1, 3, 4), self.group)

        sent_q, sent_k = post(q), post(k)  # in flight while v is computed (when it comes lazily)
        sent_v = post(v() if callable(v) else v)
        # [N (source rank = token block), B, s, H/N, D] -> [B, H/N, L, D] token-major views; the
        # padding is the tail of the padded sequence: sliced off, never attended.
        q_all, k_all, v_all = (_all_tokens(p.wait(), layout.num_tokens) for p in (sent_q, sent_k, sent_v))
        del sent_q, sent_k, sent_v
        out = self.inner(q_all, k_all, v_all)  # [B, H/N, L, D]
        del q_all, k_all, v_all
        back = out.transpose(1, 2)  # [B, L, H/N, D]
        if layout.padded > layout.num_tokens:
            back = F.pad(back, (0, 0, 0, 0, 0, layout.padded - layout.num_tokens))
        # (my heads, all tokens) -> (all heads, my tokens): chunk j = token block j.
        back = back.unflatten(1, (n, shard)).transpose(0, 1)  # [N, B, s, H/N, D]
        received = _all_to_all(back, self.group).wait()  # [N (source rank = head group), B, s, H/N, D]
        del out, back
        # Built as [B, s, H, D] so the caller's transpose(1, 2).flatten(2) is a view, not a copy.
        rows = received.permute(1, 2, 0, 3, 4)  # [B, s, N, H/N, D]
        return rows.reshape(batch, shard, heads, head_dim).transpose(1, 2)  # [B, H, s, D]


def _token_major(t: Tensor) -> Tensor:
    """``[B, H, L, D]`` -> ``[B, L, H, D]`` (a view when t is a token-major view, else a copy)."""
    return t.transpose(1, 2)


def _all_tokens(recv: Tensor, num_tokens: int) -> Tensor:
    """Received token blocks ``[N, B, s, h, D]`` -> ``[B, h, L, D]`` (token-major, padding dropped)."""
    n, batch, shard, heads, head_dim = recv.shape
    if batch == 1:
        rows = recv.view(1, n * shard, heads, head_dim)  # the blocks are consecutive: no copy
    else:
        rows = recv.transpose(0, 1).reshape(batch, n * shard, heads, head_dim)
    return rows[:, :num_tokens].transpose(1, 2)


class _Pending:
    """An all-to-all in flight; ``wait()`` returns its output (on NCCL the compute stream waits)."""

    def __init__(self, out: Tensor, work: object) -> None:
        self.out, self.work = out, work

    def wait(self) -> Tensor:
        self.work.wait()  # type: ignore[attr-defined]
        return self.out


def _all_to_all(x: Tensor, group: SequenceGroup) -> _Pending:
    """Asynchronous `all_to_all_dim0`: chunk j of ``x`` (dim 0) to rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    return _Pending(out, dist.all_to_all_single(out, x, group=group.group, async_op=True))


class SequenceParallelDiT(nn.Module):
    """A `PAN2DiT` run sequence-parallel over a process group; made by `parallelize_dit`."""

    def __init__(self, model: PAN2DiT, group: SequenceGroup) -> None:
        super().__init__()
        heads = model.config.num_attention_heads
        if heads % group.world_size:
            raise ValueError(
                f"num_attention_heads={heads} does not divide by the group size {group.world_size}: Ulysses "
                f"gives each rank whole heads; use a group size that divides {heads}"
            )
        self.model = model
        self.group = group
        self.config = model.config

    def prepare_context(self, context: Tensor) -> ContextCache:
        """The text K/V of every block; the same on every rank (cross-attention stays local)."""
        return self.model.prepare_context(context)

    def forward(self, x: Tensor, timestep: Tensor, context: Tensor | ContextCache, *,
                blocks: BlockStack | None = None) -> Tensor:
        """Same contract as `PAN2DiT.forward`; the full ``[B, C, T, h, w]`` result on every rank.
        ``blocks`` sees this rank's shard, with the window that assembles the whole sequence."""
        m = self.model
        grid = m.token_grid(x.shape)
        batch, num_tokens = x.shape[0], math.prod(grid)
        cache = context if isinstance(context, ContextCache) else m.prepare_context(context)
        if cache.batch_size != batch:
            raise ValueError(f"context batch {cache.batch_size} != latent batch {batch}")
        layout = ShardLayout(num_tokens=num_tokens, world_size=self.group.world_size, rank=self.group.rank)
        time = m.embed_timesteps(timestep, batch_size=batch, num_tokens=num_tokens, dtype=cache.dtype)
        local_time = _shard_time(time, layout)
        rope = _shard_rope(m.rope(grid, start=layout.start, length=layout.length, device=x.device), layout)
        tokens = m.patchify(x)[:, layout.start : layout.start + layout.length]  # [B, <=s, dim]
        tokens = _pad_rows(tokens, layout.shard, dim=1)  # [B, s, dim]
        window = TokenWindow(num_tokens=num_tokens, start=layout.start, length=layout.length, rows=layout.shard,
                             gather=lambda part: all_gather_seq(part, self.group, dim=1)[:, :num_tokens])
        with self._sharded_attention(layout):
            tokens = m.run_blocks(tokens, time=local_time, context=cache, rope=rope, blocks=blocks, window=window)
        out = m.head(tokens, time=local_time)  # [B, s, C * pt * ph * pw]
        full = all_gather_seq(out, self.group, dim=1)[:, :num_tokens]  # [B, L, C * pt * ph * pw]
        return m.unpatchify(full, grid)

    @contextlib.contextmanager
    def _sharded_attention(self, layout: ShardLayout) -> Iterator[None]:
        """Every block's self-attention goes through `UlyssesAttention` for this forward only; the
        plain ``attention_fn`` (the backend) is restored after, whatever happens."""
        layers = [block.attn1 for block in self.model.blocks]
        plain = [layer.attention_fn for layer in layers]
        if any(isinstance(fn, UlyssesAttention) for fn in plain):
            raise RuntimeError("nested sequence-parallel forward: this DiT's blocks are already sharded by "
                               "another wrapper's forward in progress")
        try:
            for layer, fn in zip(layers, plain):
                layer.attention_fn = UlyssesAttention(fn, group=self.group, layout=layout)
            yield
        finally:
            for layer, fn in zip(layers, plain):
                layer.attention_fn = fn


def _pad_rows(x: Tensor, rows: int, *, dim: int, value: float = 0.0) -> Tensor:
    missing = rows - x.shape[dim]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, missing]
    return F.pad(x, pad, value=value)


def _shard_time(time: TimestepConditioning, layout: ShardLayout) -> TimestepConditioning:
    """The conditioning for this shard; padding tokens take row 0 (any valid row: they are dropped)."""
    if time.index.ndim == 1:  # one timestep per sample: nothing per token
        return time
    index = time.index[:, layout.start : layout.start + layout.length]
    return dataclasses.replace(time, index=_pad_rows(index, layout.shard, dim=1))


def _shard_rope(rope: tuple[Tensor, Tensor], layout: ShardLayout) -> tuple[Tensor, Tensor]:
    """RoPE rows ``[length, D/2]`` padded to ``[s, D/2]`` with the identity rotation (cos 1, sin 0)."""
    cos, sin = rope
    return _pad_rows(cos, layout.shard, dim=0, value=1.0), _pad_rows(sin, layout.shard, dim=0)


def parallelize_dit(model: PAN2DiT, group: dist.ProcessGroup | SequenceGroup | None) -> PAN2DiT | SequenceParallelDiT:
    """Apply Ulysses sequence parallelism to a plain `PAN2DiT` and return the wrapper to call (the
    model itself is left plain: the wrapper shards its self-attention during its own forward only).
    A group of one returns the model itself.

    ``group``: an initialised torch.distributed group (None: WORLD). Every rank must call the
    returned module with identical arguments; every rank gets the full output.
    """
    seq = group if isinstance(group, SequenceGroup) else SequenceGroup.of(group)
    if seq.world_size == 1:
        return model
    return SequenceParallelDiT(model, seq)


class UlyssesDenoiser:
    """The `Denoiser` of a group running every forward Ulysses-parallel over the whole group: a
    guided step's two branches one after the other, each over all ranks."""

    def __init__(self, model: PAN2DiT, group: SequenceGroup) -> None:
        self.group = group
        self.model = model
        self.dit = parallelize_dit(model, group)
        # The single-process strategy, run over the Ulysses wrapper instead of the plain model.
        self.local = SeparateGuidance(self.dit)

    @property
    def ranks(self) -> int:
        return self.group.world_size

    def prepare(self, cond: Tensor, uncond: Tensor | None, guidance: float) -> VelocityFn:
        return self.local.prepare(cond, uncond, guidance)

    def branch_forwards(self, cond: Tensor, uncond: Tensor | None) -> BranchForwards:
        return self.local.branch_forwards(cond, uncond)

    def warm_up_guidance(self, guidance: float) -> float:
        return self.local.warm_up_guidance(guidance)

    def any_rank(self, flag: bool) -> bool:
        device = next(self.model.parameters()).device
        return any_rank(flag, self.group, device=comm_device(self.group, device))

    def describe(self) -> dict[str, object]:
        where = f"Ulysses over {self.ranks} ranks"
        return {"ranks": self.ranks, "guided_steps": f"both branches {where}", "unguided_steps": where}
