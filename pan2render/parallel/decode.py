"""``vae_decode_kernel_parallel``: one VAE decode split over a sequence-parallel group.

Layout chosen: **by time, pipelined by layers**. The decoder's plan (``pan2render.vae_plan``: its
units in call order, each costed by the MACs of its convs and matmuls plus a model of the
elementwise traffic, at the job's latent size) is cut into N contiguous spans of about equal work
(`split_units`); span k runs on rank N-1-k, so rank 0 runs the last span (the high-resolution
head) and writes the frames: the video is born on rank 0 and never gathered. Latent frames stream
through the spans one at a time: while rank 0 decodes frame t's tail, rank 1 already runs frame
t+1's first layers, and the next chunk's transfer is posted before the current chunk's layers so
it overlaps them. Every unit and its 2-frame causal history live on exactly one rank, so the
causal cache is "handed on" by construction and the result is exactly the single-GPU decode
(same ops on the same inputs; tests/parallel compare it to 1e-5).

Why not the alternatives (the Wan2.2 decoder at 704x1248x121, latent 44x78):
- rows with a halo: the mid-block attention is global over each frame (3432 positions), so a row
  shard needs the whole frame there, and the ~28 convs after it give a receptive field of ~12
  latent rows. With 2 ranks (22 rows each) and the halo trimmed after every up block a rank still
  computes ~57% of the work: <= 1.75x before communication, worse for 4 and 8 ranks;
- time split with the cache handed on between ranks: frame t needs every layer's history after
  frame t-1, i.e. the whole decode of frames < t; handing the cache on serialises the ranks.
The pipeline's losses are the fill/drain bubble (about (N-1) of T=31 chunks) and the imbalance of
the cut (units are single convs: the model's best 2-way cut at 704x1248 is 4.5% over an even
split); per chunk it moves the activation at the cut between neighbours (plus a residual block's
shortcut, or an up block's input, when the cut falls inside one).

`split_decode` takes any decoder that implements ``vae_plan.UnitDecoder`` and uses nothing else
of it: the reference `WanVAE` and the fast Hopper decoder
(``pan2render.kernels.vae_decode.FastWanDecoder``) both do. `pipelined_decode` picks one of the
two; the ranks first agree (`agree_fast_decode`: the one decision of
``kernels.vae_decode.choose_decode_path``, with this group's all-gather as its agreement): the fast
one only if every rank can run it, else all take the reference path, the reason logged once.
`SplitDecoder` is the pipeline's frame decoder around it.

Results: rank 0 gets uint8 frames ``[F, H, W, 3]`` (or a float video ``[B, 3, F, H, W]``),
every other rank None.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pan2render.kernels.vae_decode import Agreement, DecodePath, choose_decode_path, fast_decoder_for
from pan2render.models.vae import WanVAE
from pan2render.vae_plan import STATE_KEYS, DecodeUnit, State, UnitDecoder

from .group import SequenceGroup, all_reduce_and, comm_device

__all__ = ["SplitDecoder", "agree_fast_decode", "group_agreement", "pipelined_decode", "split_decode", "split_units"]

_HEADER = 32  # int64 slots of a transfer header: [count, (key, ndim, *shape) per tensor]
_MAX_IN_FLIGHT = 2  # chunks a rank may have sent but not yet seen received (bounds memory)


# ---- the cut ------------------------------------------------------------------------------------


def split_units(units: Sequence[DecodeUnit], parts: int) -> list[int]:
    """Cut ``units`` into ``parts`` contiguous non-empty spans minimising the largest span's cost.

    Returns the ``parts + 1`` boundaries (span k is ``units[b[k]:b[k+1]]``).
    """
    n = len(units)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut a decoder of {n} units into {parts} pipeline stages; use <= {n} ranks")
    prefix = [0.0]
    for unit in units:
        prefix.append(prefix[-1] + unit.cost)
    inf = float("inf")
    # best[k][i]: least max-span work cutting units[:i] into k spans; cut[k][i]: where span k starts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


# ---- moving a chunk's state between neighbouring ranks ----------------------------------------


Layout = list[tuple[str, tuple[int, ...]]]  # (state key, shape) per tensor, keys sorted


def _layout(state: State) -> Layout:
    return [(k, tuple(state[k].shape)) for k in sorted(state)]


def _send(state: State, dst: int, group: SequenceGroup, *, header: bool) -> tuple[list[Any], list[Tensor]]:
    """Send a chunk's state (asynchronously), preceded by a header with its layout when ``header``."""
    names = sorted(state)
    tensors = [state[k].contiguous() for k in names]
    keep, works = list(tensors), []
    if header:
        values = [len(tensors)]
        for k, t in zip(names, tensors):
            values += [STATE_KEYS.index(k), t.dim(), *t.shape]
        if len(values) > _HEADER:
            raise RuntimeError(f"transfer header of {len(values)} ints exceeds {_HEADER}")
        head = torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64, device=tensors[0].device)
        keep.append(head)
        works.append(dist.isend(head, dst, group=group.group))
    works += [dist.isend(t, dst, group=group.group) for t in tensors]
    return works, keep  # the tensors stay referenced until their sends complete


def _recv_layout(src: int, group: SequenceGroup, *, device: torch.device) -> Layout:
    head = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(head, src, group=group.group)
    values = head.tolist()
    layout, pos = [], 1
    for _ in range(values[0]):
        ndim = values[pos + 1]
        layout.append((STATE_KEYS[values[pos]], tuple(values[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return layout


def _irecv(layout: Layout, src: int, group: SequenceGroup, *, dtype: torch.dtype,
           device: torch.device) -> tuple[list[Any], State]:
    """Post the receives of one chunk's state of a known layout; wait on the works before use."""
    state = {k: torch.empty(shape, dtype=dtype, device=device) for k, shape in layout}
    return [dist.irecv(state[k], src, group=group.group) for k, _ in layout], state


# ---- the split decode -----------------------------------------------------------------------


@torch.inference_mode()
def pipelined_decode(
    vae: WanVAE,
    z: Tensor,
    group: SequenceGroup,
    *,
    fast: bool,
    out_dtype: torch.dtype = torch.uint8,
) -> Tensor | None:
    """Decode raw latents ``[1, z, T, h, w]`` (the same on every rank) over the group, with the
    fast decoder of ``vae`` (``fast``, which must be the same on every rank: see
    `agree_fast_decode`) or with ``vae`` itself. See `split_decode`."""
    decoder: UnitDecoder = fast_decoder_for(vae, z.device) if fast else vae
    return split_decode(decoder, z, group, out_dtype=out_dtype)


@torch.inference_mode()
def split_decode(
    decoder: UnitDecoder, z: Tensor, group: SequenceGroup, *, out_dtype: torch.dtype = torch.uint8
) -> Tensor | None:
    """Decode raw latents ``[1, z, T, h, w]`` (the same on every rank) over the group, each rank
    running its span of ``decoder``'s plan (the same kind of decoder on every rank).

    Rank 0 returns uint8 ``[F, H, W, 3]`` (``out_dtype=torch.uint8``) or the video
    ``[1, 3, F, H, W]`` in ``out_dtype``, clamped to [-1, 1]; other ranks return None.
    """
    if z.dim() != 5 or z.shape[0] != 1:
        raise ValueError(f"latents of shape {tuple(z.shape)}: the split decode takes one video [1, z, T, h, w]")
    n = group.world_size
    stage = n - 1 - group.rank  # rank 0 runs the last stage, so the frames are born there
    src = group.global_rank(group.rank + 1) if stage > 0 else None
    dst = group.global_rank(group.rank - 1) if stage < n - 1 else None
    pending: deque[tuple[list[Any], list[Tensor]]] = deque()
    prefetched: tuple[list[Any], State] | None = None
    layout: Layout = []
    sent_layout: Layout = []
    start = 0
    with decoder.start_decode(z) as run:
        bounds = split_units(run.plan.units, n)
        mine = run.plan.units[bounds[stage] : bounds[stage + 1]]
        chunks = run.latent_frames
        out = run.new_output(out_dtype) if dst is None else None
        for t in range(chunks):
            if src is None:
                state = run.latent_input(t)
            elif prefetched is None:  # chunks 0 and 1: layout first (chunk 1's holds for the rest)
                layout = _recv_layout(src, group, device=z.device)
                works, state = _irecv(layout, src, group, dtype=run.state_dtype, device=z.device)
                for work in works:
                    work.wait()
            else:
                works, state = prefetched
                for work in works:  # on NCCL: the compute stream waits, the host does not
                    work.wait()
                prefetched = None
            if src is not None and 1 <= t < chunks - 1:
                # Post the next chunk's receives before this chunk's layers, so the transfer
                # overlaps them (chunks >= 1 all have the same shapes).
                prefetched = _irecv(layout, src, group, dtype=run.state_dtype, device=z.device)
            for unit in mine:
                state = run.run_unit(unit, state, first=t == 0)
            state = run.settle(state)  # before it leaves this rank or is written
            if out is not None:
                start += run.write(state, out, start)
            else:
                assert dst is not None
                if t >= 2 and _layout(state) != sent_layout:
                    raise RuntimeError(f"chunk {t} state {_layout(state)} differs from chunk 1's {sent_layout}")
                sent_layout = _layout(state)
                pending.append(_send(state, dst, group, header=t <= 1))
                while len(pending) > _MAX_IN_FLIGHT:
                    for work in pending.popleft()[0]:
                        work.wait()
            del state
        while pending:
            for work in pending.popleft()[0]:
                work.wait()
        if out is not None:
            assert start == run.plan.decoded_frames(chunks), (start, out.shape)
    return out


def group_agreement(group: SequenceGroup, device: torch.device) -> Agreement:
    """How the ranks of ``group`` agree on the decode path (`choose_decode_path`'s ``agree``): the
    fast decoder only if every rank can run it, else the reference decoder on every rank, with a
    reason that names the ranks that cannot (and, on those ranks, their own reason). One
    all-gather of a flag: collective, every rank of the group must take part."""

    def agree(mine: DecodePath) -> DecodePath:
        all_ok, flags = all_reduce_and(mine.fast, group, device=comm_device(group, device))
        if all_ok:
            return mine
        bad = [rank for rank, flag in enumerate(flags) if not flag]
        reason = f"rank(s) {bad} of {group.world_size} cannot run the fast decoder"
        return DecodePath(False, reason + ("" if mine.fast else f"; rank {group.rank}: {mine.reason}"))

    return agree


def agree_fast_decode(vae: WanVAE, group: SequenceGroup, *, device: torch.device, enabled: bool = True) -> DecodePath:
    """The decode path of the whole group (`choose_decode_path` with `group_agreement`): the same
    on every rank, a fallback's reason logged once per rank. Collective."""
    return choose_decode_path(vae, device, enabled=enabled, agree=group_agreement(group, device))


class SplitDecoder:
    """The `FrameDecoder` of a group with ``vae_decode_kernel_parallel``: one decode split by layers
    over the ranks (`pipelined_decode`); the frames on rank 0, None on the others. Every rank must
    call ``decode`` with the same latents. On the first decode the ranks agree on the decoder
    (`agree_fast_decode`: the fast one only if every rank can run it, with ``kernel`` the
    pipeline's ``vae_decode_kernel``), and keep that path for every later decode."""

    def __init__(self, vae: WanVAE, group: SequenceGroup, *, kernel: bool) -> None:
        self.vae = vae
        self.group = group
        self.kernel = kernel
        self.path: DecodePath | None = None  # agreed on the first decode

    def decode(self, z: Tensor) -> Tensor | None:
        if self.path is None:
            self.path = agree_fast_decode(self.vae, self.group, device=z.device, enabled=self.kernel)
        return pipelined_decode(self.vae, z, self.group, fast=self.path.fast, out_dtype=torch.uint8)

    def describe(self) -> str:
        split = f"split by layers over {self.group.world_size} ranks"
        return split if self.path is None else f"{split}, {self.path.describe()}"
