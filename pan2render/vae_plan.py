"""The Wan2.2 VAE decoder described once: its steps in call order, as typed units with a cost.

Every decode runs this plan. The reference decoder (``pan2render.models.vae.WanVAE``) and the fast
one (``pan2render.kernels.vae_decode.FastWanDecoder``) each implement `UnitDecoder`: they start a
`DecodeRun` for some latents, and the run executes any unit of the plan on a chunk's state. The
single-process decode (`decode_frames`) runs every unit on one process; the split decode over a
GPU group (``pan2render.parallel.decode``) runs a contiguous span of units per rank and hands the
state on, cutting where the units' costs balance. Neither knows a decoder's internals, and neither
parses names: a unit is its kind, its block and its index.

This module is shared by ``models`` and ``kernels`` (which must not import ``models``), so it holds
no modules and no weights; the plan is built from the VAE's config keys (``WanVAEConfig`` or
diffusers' ``vae/config.json`` dict).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import torch

# What a chunk's state may hold between units (and what travels between ranks): the activation;
# a residual block's shortcut between its two halves; an up block's input, kept for the
# duplicate-upsample shortcut added after its upsampler.
STATE_KEYS: tuple[str, ...] = ("x", "res", "x_in")
State = dict[str, Any]
RGB_CHANNELS = 3

# A decode runs one latent frame per chunk (`decode_frames`). Chunk 0 takes the first frame's path
# through the units (the temporal upsamplers pass it alone); every later chunk runs the units on
# the same shapes as chunk 1 (one latent frame in, causal histories of a fixed size). So a decode of
# this many latent frames runs every conv, GEMM and kernel shape that a decode of any length at the
# same height and width runs (tests/kernels/test_vae_decode.py holds the decoders to it): a warm-up
# decode of it pays the per-shape first-call costs (cuDNN autotuning, Triton specialisations) of a
# whole video's. Only what spans all frames at once grows with the length: the post-quant 1x1
# (one GEMM over every frame) and the output buffers.
SHAPE_COVERING_LATENT_FRAMES = 2

# Bytes moved by the elementwise work around the convs (norms, SiLU, residuals, copies) cost time
# too, and matter more in the high-resolution, narrow layers: one byte counts as this many MACs,
# the H200's bf16 matmul rate over its copy bandwidth (docs/performance.md, split decode).
MACS_PER_BYTE = 92.0


class UnitKind(enum.Enum):
    """What a unit computes (the modules named are the reference decoder's, diffusers' names)."""

    CONV_IN = "conv_in"  # conv_in: post-quant latents -> the mid block's width (causal 3x3x3)
    RES_IN = "res_in"  # a residual block's first half: norm1, SiLU, conv1; and its shortcut of the input
    RES_OUT = "res_out"  # the second half: norm2, SiLU, dropout, conv2, + the shortcut
    ATTENTION = "attention"  # the mid block's per-frame single-head attention, + residual
    UPSAMPLE = "upsample"  # an up block's upsampler + the duplicate-upsample shortcut of the block's input
    HEAD = "head"  # norm_out, SiLU, conv_out -> patchified RGB


@dataclass(frozen=True)
class DecodeUnit:
    """One step of the decoder, the smallest piece a split decode can put on a rank.

    Units compare (and hash) by what they compute: kind, block and index, not by cost.
    """

    kind: UnitKind
    block: int | None = None  # the up block (0: lowest resolution); None: the mid block, conv_in, head
    index: int = 0  # RES_IN / RES_OUT: the residual block within its block
    # Work per latent frame after the first, at the plan's latent size (what the split balances).
    macs: float = field(default=0.0, compare=False)  # multiply-accumulates of the convs and matmuls
    bytes: float = field(default=0.0, compare=False)  # bf16 bytes of elementwise traffic (rough model)

    @property
    def cost(self) -> float:
        """MACs plus the elementwise traffic in MAC-equivalents."""
        return self.macs + MACS_PER_BYTE * self.bytes

    @property
    def name(self) -> str:
        """A label for logs and benchmarks ("conv_in", "mid.res0.a", "mid.attn", "up2.res1.b",
        "up2.up", "head"); never parsed."""
        if self.kind in (UnitKind.CONV_IN, UnitKind.HEAD):
            return self.kind.value
        where = "mid" if self.block is None else f"up{self.block}"
        if self.kind is UnitKind.ATTENTION:
            return f"{where}.attn"
        if self.kind is UnitKind.UPSAMPLE:
            return f"{where}.up"
        return f"{where}.res{self.index}.{'a' if self.kind is UnitKind.RES_IN else 'b'}"


@dataclass(frozen=True)
class DecoderPlan:
    """The decoder's units in call order, costed for latents of ``height x width``."""

    units: tuple[DecodeUnit, ...]
    time_factor: int  # decoded frames per latent frame after the first
    space_factor: int  # pixels per latent pixel
    height: int = 1
    width: int = 1

    def decoded_frames(self, latent_frames: int) -> int:
        """``1 + time_factor (T - 1)``: the first latent frame decodes to one frame."""
        return 1 + self.time_factor * (latent_frames - 1)

    def with_costs(self, costs: list[float]) -> DecoderPlan:
        """The same units with measured costs (one per unit, e.g. seconds) in place of the model."""
        if len(costs) != len(self.units):
            raise ValueError(f"{len(costs)} costs for a decoder of {len(self.units)} units")
        units = tuple(
            DecodeUnit(u.kind, u.block, u.index, macs=float(c)) for u, c in zip(self.units, costs)
        )
        return DecoderPlan(units, self.time_factor, self.space_factor, self.height, self.width)


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def decoder_plan(config: Any, *, height: int = 1, width: int = 1) -> DecoderPlan:
    """The plan of the decoder ``config`` describes (a ``WanVAEConfig`` or a diffusers
    ``vae/config.json`` dict), costed for latents of ``height x width``."""
    base = _get(config, "decoder_base_dim") or _get(config, "base_dim")
    dim_mult = list(_get(config, "dim_mult"))
    num_res = int(_get(config, "num_res_blocks"))
    up_t = list(_get(config, "temperal_downsample"))[::-1]  # the decoder upsamples in reverse order
    z_dim, out_channels = int(_get(config, "z_dim")), int(_get(config, "out_channels"))
    patch = int(_get(config, "patch_size") or 1)
    dims = [base * dim_mult[-1]] + [base * m for m in dim_mult[::-1]]  # mid block, then each up block

    def conv(cout: int, cin: int, taps: int, positions: float) -> tuple[float, float]:
        # MACs, and bytes of: norm + SiLU read/write, the conv's read of its input, its write, bias/residual.
        return float(cout * cin * taps) * positions, 2.0 * (3 * cin + 4 * cout) * positions

    def res_units(block: int | None, index: int, cin: int, cout: int, positions: float) -> list[DecodeUnit]:
        macs, moved = conv(cout, cin, 27, positions)
        if cin != cout:  # the 1x1x1 shortcut conv
            macs += float(cout * cin) * positions
        macs2, moved2 = conv(cout, cout, 27, positions)
        return [DecodeUnit(UnitKind.RES_IN, block, index, macs, moved),
                DecodeUnit(UnitKind.RES_OUT, block, index, macs2, moved2)]  # fmt: skip

    area, frames = float(height * width), 1  # latent positions and frames per chunk at the current stage
    c0 = dims[0]
    units = [DecodeUnit(UnitKind.CONV_IN, None, 0, *conv(c0, z_dim, 27, area))]
    units += res_units(None, 0, c0, c0, area)
    attn_macs = 4.0 * c0 * c0 * area + 2.0 * area * area * c0  # to_qkv + proj, then QK^T and PV
    attn_bytes = 2.0 * area * area * 4  # the fp32 score matrix, written and read
    units.append(DecodeUnit(UnitKind.ATTENTION, None, 0, attn_macs, attn_bytes))
    units += res_units(None, 1, c0, c0, area)
    last = len(dim_mult) - 1
    time_factor = space_factor = 1
    for i in range(last + 1):
        cin, cout = dims[i], dims[i + 1]
        for j in range(num_res + 1):
            units += res_units(i, j, cin if j == 0 else cout, cout, area * frames)
        if i == last:
            continue
        macs = moved = 0.0
        if up_t[i]:  # the causal (3, 1, 1) time conv: C -> 2C channels, i.e. each frame -> 2
            macs, moved = conv(2 * cout, cout, 3, area * frames)
            frames *= 2
            time_factor *= 2
        area *= 4
        space_factor *= 2
        macs += float(cout * cout * 9) * area * frames  # the 3x3 conv after nearest x2
        moved += 2.0 * (2 * cout + 3 * cout) * area * frames  # nearest copy, conv, shortcut add
        units.append(DecodeUnit(UnitKind.UPSAMPLE, i, 0, macs, moved))
    units.append(DecodeUnit(UnitKind.HEAD, None, 0, *conv(out_channels, dims[-1], 27, area * frames)))
    return DecoderPlan(tuple(units), time_factor, space_factor * patch, height, width)


# ---- the interface every decoder implements ------------------------------------------------------


@runtime_checkable
class DecodeRun(Protocol):
    """One decode of latents ``[B, z, T, h, w]`` in progress, run unit by unit; a context manager:
    entering it claims the decoder (one decode at a time) and sets what its kernels need, leaving
    it drops every causal history, also on error.

    A chunk is one latent frame. For each chunk ``t`` in order, the first rank's state is
    ``latent_input(t)``; every unit of the plan then runs on it in plan order (the same units in the
    same order every chunk: a unit's causal history is its own). ``first`` is True on chunk 0
    (the temporal upsamplers let the video's first frame through alone). A state holds tensors
    under `STATE_KEYS` in ``state_dtype`` once `settle` has run; only a settled state may leave the
    run (be sent to another rank or written). Units consume their input state.
    """

    plan: DecoderPlan  # the units, costed at these latents' size
    latent_frames: int  # T
    state_dtype: torch.dtype  # dtype of a settled state's tensors (what a receiving rank allocates)

    def __enter__(self) -> DecodeRun: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def latent_input(self, t: int) -> State:
        """The state of chunk ``t`` before the first unit (the post-quant conv applied)."""
        ...

    def run_unit(self, unit: DecodeUnit, state: State, *, first: bool) -> State:
        """Run one unit of the plan on a chunk's state; returns the state for the next unit."""
        ...

    def settle(self, state: State) -> State:
        """The state with any deferred work done, every value a plain tensor."""
        ...

    def new_output(self, out_dtype: torch.dtype) -> torch.Tensor:
        """The video to write into: uint8 ``[F, H, W, 3]`` (batch 1) or ``[B, 3, F, H, W]``."""
        ...

    def write(self, state: State, out: torch.Tensor, start: int) -> int:
        """Write the settled state after the last unit as frames ``start ..`` of ``out``
        (unpatchified, clamped to [-1, 1], uint8 by the pipeline's formula); returns the count."""
        ...


@runtime_checkable
class UnitDecoder(Protocol):
    """A decoder that runs the plan unit by unit."""

    def start_decode(self, z: torch.Tensor) -> DecodeRun:
        """A run for raw latents ``z [B, z_dim, T, h, w]`` (checked here); enter it to decode."""
        ...


def new_video(plan: DecoderPlan, z_shape: torch.Size, out_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The empty output of decoding latents of ``z_shape [B, z, T, h, w]``: uint8 ``[F, H, W, 3]``
    (one video) or ``[B, 3, F, H, W]`` in ``out_dtype``."""
    b, _, n, h, w = z_shape
    frames, s = plan.decoded_frames(n), plan.space_factor
    if out_dtype == torch.uint8:
        if b != 1:
            raise ValueError(f"uint8 output is one video [F, H, W, 3]: got batch {b}; decode one at a time")
        return torch.empty(frames, s * h, s * w, RGB_CHANNELS, dtype=torch.uint8, device=device)
    return torch.empty(b, RGB_CHANNELS, frames, s * h, s * w, dtype=out_dtype, device=device)


def decode_frames(run: DecodeRun, out: torch.Tensor) -> int:
    """Every chunk through every unit on this process, written into ``out``; returns the frames
    written. The run must have been entered."""
    start = 0
    for t in range(run.latent_frames):
        state = run.latent_input(t)
        for unit in run.plan.units:
            state = run.run_unit(unit, state, first=t == 0)
        start += run.write(run.settle(state), out, start)
        del state  # the chunk's output, before the next chunk allocates its own
    return start
