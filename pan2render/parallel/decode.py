"""``vae_decode_kernel_parallel``: one VAE decode split over a sequence-parallel group.

Layout chosen: **by time, pipelined by layers**. The decoder is cut into N contiguous spans of
about equal work (`plan_layers`: MACs of the convs and the mid-block attention plus a model of the
elementwise traffic, at the job's latent size; or measured seconds per unit via ``costs``); span k
runs on rank N-1-k, so rank 0 runs the last span (the high-resolution head) and writes the frames:
the video is born on rank 0 and never gathered. Latent frames stream through the spans one at a
time: while rank 0 decodes frame t's tail, rank 1 already runs frame t+1's first layers, and the
next chunk's transfer is posted before the current chunk's layers so it overlaps them. Every layer
and its 2-frame causal cache live on exactly one rank, so the causal cache is "handed on" by
construction and the result is exactly the single-GPU decode (same ops on the same inputs;
tests/parallel compare it to 1e-5).

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
residual, or an up block's input, when the cut falls inside one).

Both decoders split the same way: the reference `WanVAE` (its modules, one `CausalCache` per
rank) and the fast Hopper decoder (`pan2render.kernels.vae_decode.FastWanDecoder`, its layer
methods and per-layer history dict). The ranks first agree (`agree_fast_decode`): the fast one
only if every rank can run it, else all take the reference path, the reason logged once.

Results: rank 0 gets uint8 frames ``[F, H, W, 3]`` (or a float video ``[B, 3, F, H, W]``),
every other rank None.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from pan2render.kernels.vae_decode import to_uint8_frames
from pan2render.models.vae import CausalCache, WanVAE, unpatchify

from .group import SequenceGroup, all_reduce_and

log = logging.getLogger(__name__)

__all__ = ["LayerSpan", "agree_fast_decode", "decode_on_group", "pipelined_decode", "plan_layers", "split_layers"]

_HEADER = 32  # int64 slots of a transfer header: [count, (key, ndim, *shape) per tensor]
# What travels between units: the activation, a residual block's residual between its two
# halves, an up block's input until its shortcut is added after the upsampler.
_STATE_KEYS = ("x", "res", "x_in")
State = dict[str, Tensor]
_MAX_IN_FLIGHT = 2  # chunks a rank may have sent but not yet seen received (bounds memory)
_LOGGED: set[str] = set()
# What the split uses of kernels/vae_decode.py (checked before use, so a change there makes the
# group fall back to the reference decoder, saying why, instead of failing mid-decode).
_FAST_MODULE_API = ("FastWanDecoder", "CACHE_T", "_decoder_for")
_FAST_DECODER_API = ("begin_decode", "end_decode", "unit_names", "run_unit", "settle", "_post_quant", "_write",
                     "time_factor", "space_factor", "dtype")


# ---- the layer plan ---------------------------------------------------------------------------


# Bytes moved by the elementwise work around the convs (norms, SiLU, residuals, copies) cost time
# too, and matter more in the high-resolution, narrow layers: one byte counts as this many MACs,
# the H200's bf16 matmul rate over its copy bandwidth (781 TFLOP/s / 4.25 TB/s, measured on one H200).
MACS_PER_BYTE = 92.0


@dataclass(frozen=True)
class LayerSpan:
    """One unit of the decoder the pipeline can cut between, with its work per latent frame."""

    name: str  # "conv_in", "mid", "up{i}.res{j}.a" / ".b" (conv1 / conv2 of a residual block),
    # "up{i}.up" (upsampler + the block's duplicate-upsample shortcut), "head"
    macs: float  # multiply-accumulates per (non-first) latent frame at the job's size
    bytes: float = 0.0  # bf16 bytes of elementwise traffic per latent frame (rough model)

    @property
    def cost(self) -> float:
        """What the cut balances: MACs plus the elementwise traffic in MAC-equivalents."""
        return self.macs + MACS_PER_BYTE * self.bytes


def plan_layers(vae: WanVAE, *, height: int, width: int) -> list[LayerSpan]:
    """The decoder as cuttable units in call order, with a cost each, for latents ``h x w``."""
    dec = vae.decoder
    area, frames = height * width, 1  # latent positions and frames per chunk at the current stage

    def conv(module: torch.nn.Module, positions: float) -> float:
        return float(module.weight.numel()) * positions

    def traffic(module: torch.nn.Module, positions: float) -> float:
        # norm + SiLU read/write and the conv's read of its input, the conv's write, bias/residual.
        cout, cin = module.weight.shape[:2]
        return 2.0 * (3 * cin + 4 * cout) * positions

    c0 = dec.conv_in.weight.shape[0]
    mid = sum(conv(r.conv1, area) + conv(r.conv2, area) for r in dec.mid_block.resnets)
    mid_bytes = sum(traffic(r.conv1, area) + traffic(r.conv2, area) for r in dec.mid_block.resnets)
    attn = dec.mid_block.attentions[0]
    mid += conv(attn.to_qkv, area) + conv(attn.proj, area) + 2.0 * area * area * c0  # QK^T and PV
    mid_bytes += 2.0 * area * area * 4  # the fp32 score matrix, written and read
    plan = [LayerSpan("conv_in", conv(dec.conv_in, area), traffic(dec.conv_in, area)),
            LayerSpan("mid", mid, mid_bytes)]
    for i, block in enumerate(dec.up_blocks):
        for j, res in enumerate(block.resnets):
            # Two units per residual block (conv1 | conv2), so a cut can fall between its convs.
            positions = area * frames
            macs = conv(res.conv1, positions)
            if isinstance(res.conv_shortcut, torch.nn.Conv3d):
                macs += conv(res.conv_shortcut, positions)
            plan.append(LayerSpan(f"up{i}.res{j}.a", macs, traffic(res.conv1, positions)))
            plan.append(LayerSpan(f"up{i}.res{j}.b", conv(res.conv2, positions), traffic(res.conv2, positions)))
        if block.upsampler is not None:
            macs = moved = 0.0
            if block.upsampler.temporal:
                macs += conv(block.upsampler.time_conv, area * frames)
                moved += traffic(block.upsampler.time_conv, area * frames)
                frames *= 2
            area *= 4
            resample = block.upsampler.resample[1]
            macs += conv(resample, area * frames)
            cout, cin = resample.weight.shape[:2]
            moved += 2.0 * (2 * cin + 3 * cout) * area * frames  # nearest copy, conv, shortcut add
            plan.append(LayerSpan(f"up{i}.up", macs, moved))
    plan.append(LayerSpan("head", conv(dec.conv_out, area * frames), traffic(dec.conv_out, area * frames)))
    return plan


def split_layers(plan: list[LayerSpan], parts: int) -> list[int]:
    """Cut ``plan`` into ``parts`` contiguous non-empty spans minimising the largest span's work.

    Returns the ``parts + 1`` boundaries (span k is ``plan[b[k]:b[k+1]]``).
    """
    n = len(plan)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut a decoder of {n} layer units into {parts} pipeline stages; use <= {n} ranks")
    prefix = [0.0]
    for unit in plan:
        prefix.append(prefix[-1] + unit.cost)
    inf = float("inf")
    # best[k][i]: least max-span work cutting plan[:i] into k spans; cut[k][i]: where span k starts.
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


# ---- the two decoders as runnable units ----------------------------------------------------


class _ReferenceUnits:
    """The units on the reference `WanVAE` (layout ``[B, C, T, H, W]``, this rank's `CausalCache`)."""

    def __init__(self, vae: WanVAE, z: Tensor) -> None:
        self.vae, self.dec = vae, vae.decoder
        self.dtype = next(vae.parameters()).dtype
        self.z = z
        self.x: Tensor | None = None  # post_quant_conv(z), made by the first stage only
        self.cache = CausalCache()
        self.patch = vae.config.patch_size

    def begin_chunk(self) -> None:
        self.cache.rewind()

    def first_input(self, t: int) -> State:
        if self.x is None:
            self.x = self.vae.post_quant_conv(self.z.to(self.dtype))  # pointwise: all frames at once
        return {"x": self.x[:, :, t : t + 1]}

    def run(self, name: str, state: State, *, first: bool) -> State:
        dec, cache, x = self.dec, self.cache, state.pop("x")
        if name == "conv_in":
            return {"x": dec.conv_in(x, cache)}
        if name == "mid":
            return {"x": dec.mid_block(x, cache)}
        if name == "head":
            return {"x": dec.conv_out(F.silu(dec.norm_out(x)), cache)}
        block_id, part, *half = name.split(".")
        block = dec.up_blocks[int(block_id[2:])]
        if part == "up":  # ResidualUpBlock's tail: upsampler + duplicate-upsample shortcut of its input
            return {"x": block.upsampler(x, cache) + block.avg_shortcut(state.pop("x_in"), first_chunk=first)}
        res = block.resnets[int(part[3:])]
        if part == "res0" and half == ["a"] and block.avg_shortcut is not None:
            state["x_in"] = x  # the up block's input, for its shortcut after the upsampler
        if half == ["a"]:  # ResidualBlock.forward, first half
            state["res"] = res.conv_shortcut(x)
            state["x"] = res.conv1(F.silu(res.norm1(x)), cache)
        else:
            state["x"] = res.conv2(res.dropout(F.silu(res.norm2(x))), cache) + state.pop("res")
        return state

    def new_output(self, z: Tensor, out_dtype: torch.dtype) -> Tensor:
        b, _, n, h, w = z.shape
        cfg = self.vae.config
        frames, s = cfg.decoded_frames(n), cfg.scale_factor_spatial
        if out_dtype == torch.uint8:
            return torch.empty(frames, s * h, s * w, 3, dtype=torch.uint8, device=z.device)
        return torch.empty(b, 3, frames, s * h, s * w, dtype=out_dtype, device=z.device)

    def write(self, y: Tensor, out: Tensor, start: int) -> int:
        video = unpatchify(y, patch=self.patch).clamp_(-1.0, 1.0)  # [B, 3, f, H, W]
        stop = start + video.shape[2]
        if out.dtype == torch.uint8:
            out[start:stop] = to_uint8_frames(video[0])
        else:
            out[:, :, start:stop] = video
        return stop - start

    def finish_span(self, state: State) -> State:
        return state

    def close(self) -> None:
        self.cache.clear()


class _FastUnits:
    """The same units on the fast decoder: `FastWanDecoder.run_unit`, the steps its own decode
    runs (rows ``[B, T, H, W, C]``, bf16, history per layer name), so the split and the single-GPU
    decode cannot drift apart."""

    def __init__(self, vae: WanVAE, z: Tensor) -> None:
        from pan2render.kernels import vae_decode as fast

        self.fast = fast
        self.dec = fast._decoder_for(vae, z.device)
        self.dtype = self.dec.dtype
        self.z = z
        self.zp: Tensor | None = None
        self.dec.begin_decode()  # the default FastDecodeConfig's layer variants, as fast_decode

    def begin_chunk(self) -> None:
        pass

    def first_input(self, t: int) -> State:
        if self.zp is None:
            self.zp = self.dec._post_quant(self.z)  # [B, 2 + T, h, w, z]: 2 zero frames in front
        return {"x": self.zp[:, t : t + 1 + self.fast.CACHE_T]}

    def run(self, name: str, state: State, *, first: bool) -> State:
        return self.dec.run_unit(name, state, first=first)

    def finish_span(self, state: State) -> State:
        """Before a chunk's state leaves this rank (or is written): add a pending resnet sum."""
        return self.dec.settle(state)

    def new_output(self, z: Tensor, out_dtype: torch.dtype) -> Tensor:
        b, _, n, h, w = z.shape
        frames, s = 1 + self.dec.time_factor * (n - 1), self.dec.space_factor
        if out_dtype == torch.uint8:
            return torch.empty(frames, s * h, s * w, 3, dtype=torch.uint8, device=z.device)
        return torch.empty(b, 3, frames, s * h, s * w, dtype=out_dtype, device=z.device)

    def write(self, y: Tensor, out: Tensor, start: int) -> int:
        self.dec._write(y, out, start)
        return y.shape[1]

    def close(self) -> None:
        self.dec.end_decode()


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
            values += [_STATE_KEYS.index(k), t.dim(), *t.shape]
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
        layout.append((_STATE_KEYS[values[pos]], tuple(values[pos + 2 : pos + 2 + ndim])))
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
    stats: dict[str, Any] | None = None,
    costs: list[float] | None = None,
) -> Tensor | None:
    """Decode raw latents ``[1, z, T, h, w]`` (the same on every rank) over the group.

    Rank 0 returns uint8 ``[F, H, W, 3]`` (``out_dtype=torch.uint8``) or the video
    ``[1, 3, F, H, W]`` in ``out_dtype``, clamped to [-1, 1]; other ranks return None. ``fast``
    must be the same on every rank (see `agree_fast_decode`). ``stats`` (optional) receives this
    rank's units and its busy seconds (CUDA events around its layers; waits excluded); with
    ``stats["per_unit"] = True`` also ``unit_s``, seconds per unit (for measured ``costs``).
    ``costs`` (one per `plan_layers` unit, the same on every rank) replaces the cost model in the cut.
    """
    if z.dim() != 5 or z.shape[0] != 1:
        raise ValueError(f"latents of shape {tuple(z.shape)}: the split decode takes one video [1, z, T, h, w]")
    n = group.world_size
    stage = n - 1 - group.rank  # rank 0 runs the last stage, so the frames are born there
    plan = plan_layers(vae, height=z.shape[3], width=z.shape[4])
    if costs is not None:
        if len(costs) != len(plan):
            raise ValueError(f"costs has {len(costs)} entries; the decoder has {len(plan)} units")
        plan = [LayerSpan(unit.name, macs=float(c)) for unit, c in zip(plan, costs)]
    bounds = split_layers(plan, n)
    mine = [unit.name for unit in plan[bounds[stage] : bounds[stage + 1]]]
    src = group.global_rank(group.rank + 1) if stage > 0 else None
    dst = group.global_rank(group.rank - 1) if stage < n - 1 else None
    pending: deque[tuple[list[Any], list[Tensor]]] = deque()
    prefetched: tuple[list[Any], State] | None = None
    layout: Layout = []
    sent_layout: Layout = []
    timing = stats is not None
    events: list[tuple[Any, Any]] = []
    per_unit = timing and bool(stats.get("per_unit"))
    unit_events: list[list[Any]] = []
    start = 0
    # The fast decoder autotunes cuDNN as its own decode does (benchmark on, TF32 as configured).
    flags = torch.backends.cudnn.flags(enabled=True, benchmark=fast, deterministic=False,
                                       allow_tf32=torch.backends.cudnn.allow_tf32)
    units: _ReferenceUnits | _FastUnits = (_FastUnits if fast else _ReferenceUnits)(vae, z)
    try:
        out = units.new_output(z, out_dtype) if dst is None else None
        with flags:
            for t in range(z.shape[2]):
                units.begin_chunk()
                if src is None:
                    state = units.first_input(t)
                elif prefetched is None:  # chunks 0 and 1: layout first (chunk 1's holds for the rest)
                    layout = _recv_layout(src, group, device=z.device)
                    works, state = _irecv(layout, src, group, dtype=units.dtype, device=z.device)
                    for work in works:
                        work.wait()
                else:
                    works, state = prefetched
                    for work in works:  # on NCCL: the compute stream waits, the host does not
                        work.wait()
                    prefetched = None
                if src is not None and 1 <= t < z.shape[2] - 1:
                    # Post the next chunk's receives before this chunk's layers, so the transfer
                    # overlaps them (chunks >= 1 all have the same shapes).
                    prefetched = _irecv(layout, src, group, dtype=units.dtype, device=z.device)
                if timing:
                    events.append((_mark(z.device), None))
                marks = [_mark(z.device)] if per_unit else []
                for name in mine:
                    state = units.run(name, state, first=t == 0)
                    if marks:
                        marks.append(_mark(z.device))
                state = units.finish_span(state)
                if marks and t > 0:  # steady-state chunks only (the first one is 1 frame)
                    unit_events.append(marks)
                if dst is None:
                    assert out is not None
                    start += units.write(state["x"], out, start)
                if timing:
                    events[-1] = (events[-1][0], _mark(z.device))
                if dst is not None:
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
    finally:
        units.close()
    if stats is not None:
        stats["units"] = mine
        if timing:
            stats["busy_s"] = sum(_elapsed(a, b) for a, b in events)
            if unit_events:
                stats["unit_s"] = [sum(_elapsed(m[i], m[i + 1]) for m in unit_events) for i in range(len(mine))]
    if out is not None and out_dtype == torch.uint8:
        assert start == out.shape[0], (start, out.shape)
    return out


def _mark(device: torch.device) -> Any:
    """A point in time on ``device``'s stream: a recorded CUDA event, or the host clock on CPU."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed(a: Any, b: Any) -> float:
    """Seconds between two `_mark` points (synchronises on CUDA events)."""
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def _comm_device(group: SequenceGroup, device: torch.device) -> torch.device:
    if group.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device()) if device.type != "cuda" else device
    return torch.device("cpu")


def _can_run_fast(vae: WanVAE, device: torch.device, *, enabled: bool) -> tuple[bool, str]:
    """This rank's own answer: can it run the fast decoder's units here?"""
    if not enabled:
        return False, "vae_decode_kernel is off"
    try:
        from pan2render.kernels import vae_decode as fast
    except ImportError as e:
        return False, f"the fast decoder is not importable ({e})"
    ok, reason = fast.fast_decode_available(device)
    if not ok:
        return False, reason
    missing = [name for name in _FAST_MODULE_API if not hasattr(fast, name)]
    if missing:
        return False, f"pan2render.kernels.vae_decode lacks {missing}, which the split decode calls"
    try:
        dec = fast._decoder_for(vae, device)  # builds (and caches) its weight copy; raises on other layouts
    except (ValueError, KeyError, RuntimeError) as e:
        return False, f"the fast decoder cannot take this VAE ({e})"
    missing = [name for name in _FAST_DECODER_API if not hasattr(dec, name)]
    if missing:
        return False, f"FastWanDecoder lacks {missing}, which the split decode calls"
    planned = [unit.name for unit in plan_layers(vae, height=1, width=1)]
    if dec.unit_names() != planned:
        return False, f"the fast decoder's units {dec.unit_names()} differ from the split's plan {planned}"
    return True, ""


def agree_fast_decode(
    vae: WanVAE,
    group: SequenceGroup,
    *,
    device: torch.device,
    enabled: bool = True,
    can_run: Callable[..., tuple[bool, str]] | None = None,
) -> tuple[bool, str]:
    """Whether EVERY rank can run the fast decoder (one all-gather of a flag), and if not, why.

    Collective: every rank of the group must call it. The reason names the ranks that cannot and,
    on those ranks, their own reason. ``can_run`` replaces the local check (tests).
    """
    ok, why = (can_run or _can_run_fast)(vae, device, enabled=enabled)
    all_ok, flags = all_reduce_and(ok, group, device=_comm_device(group, device))
    if all_ok:
        return True, ""
    bad = [rank for rank, flag in enumerate(flags) if not flag]
    reason = f"rank(s) {bad} of {group.world_size} cannot run the fast decoder"
    return False, reason + (f"; rank {group.rank}: {why}" if not ok else "")


def decode_on_group(pipe: Any, z: Tensor) -> Tensor | None:
    """`PAN2Pipeline.decode`'s grouped path: raw latents ``[1, z, T, h, w]`` on the device ->
    uint8 frames ``[F, H, W, 3]`` on rank 0's device, None on the other ranks."""
    group: SequenceGroup = pipe.process_group
    fast, reason = agree_fast_decode(pipe.vae, group, device=z.device, enabled=bool(pipe.config.vae_decode_kernel))
    if not fast and reason not in _LOGGED:
        _LOGGED.add(reason)
        log.info("vae_decode_kernel_parallel: every rank takes the reference decoder: %s", reason)
    return pipelined_decode(pipe.vae, z, group, fast=fast, out_dtype=torch.uint8)
