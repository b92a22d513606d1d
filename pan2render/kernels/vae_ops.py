"""Triton kernels of the fast Wan2.2 VAE decoder, each with its plain-torch reference beside it.

The ``*_reference`` functions are the one reference of each op: the kernel tests compare against
them, the fast decoder's build check (``vae_decode.fast_decode_available``) runs one, and the
reference decoder (``pan2render.models.vae``) computes its norms and residual adds with them. They
live here, not in ``models/``, because that build check needs one at run time and ``kernels/``
does not import ``models/``.

All kernels work on channels-last rows: an activation ``[B, C, T, H, W]`` is stored physically as
``[B, T, H, W, C]``, so every (b, t, h, w) position is one contiguous row of C values and a norm
over C is a row reduction. Storage is bf16 (fp32 in the CPU tests), arithmetic fp32, one rounding
at the store.

- ``rms_norm_act``: ``y = act(normalize(x + bias) * sqrt(C) * gamma)`` over C, written to any
  row-contiguous destination (the decoder points it at the frames after the 2-frame causal cache
  inside a conv's input buffer, so the norm, SiLU, the previous conv's bias and the cache
  concatenation cost one read and one write). ``normalize`` is ``F.normalize`` (eps 1e-12), as
  diffusers' ``WanRMS_norm``.
  With ``residual``, the row first becomes ``x + bias + residual``, rounded to x's dtype and
  written back into x (the resnet's output, still needed as the next residual), and that rounded
  sum is normalised: the resnet's closing add costs no pass of its own.
- ``add_bias_residual_``: ``y += bias + r`` in place (the second conv's bias and the residual),
  where the sum is not followed by a norm (before an upsampler, the attention's output).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:  # CPU-only installs may lack triton: the references still work, the kernels do not.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

NORM_EPS = 1e-12  # F.normalize's default, used by diffusers' WanRMS_norm
MAX_CHANNELS = 4096  # one row must fit one program's registers; the Wan2.2 decoder needs <= 1024
# (elements per program, warps) of each row kernel: rows per program = elements / padded C.
# Chosen with the tile sweep of scripts/bench_vae_decode.py (--tile-sweep); the figures are in
# docs/performance.md ("VAE decode kernel", "What was tried": row-kernel tiles).
ROW_TILES: dict[str, tuple[int, int]] = {"norm": (2048, 4), "add": (2048, 4), "combine": (2048, 4)}


def _row_blocks(channels: int, kernel: str = "norm") -> tuple[int, int]:
    """(BLOCK_C, ROWS) for a row kernel over ``channels`` values per row."""
    if not 1 <= channels <= MAX_CHANNELS:
        raise ValueError(
            f"channels={channels}: the VAE row kernels take 1..{MAX_CHANNELS} channels per row; "
            "use the reference path for wider layers"
        )
    block_c = triton.next_power_of_2(channels)
    return block_c, max(1, ROW_TILES[kernel][0] // block_c)


def _check_rows(name: str, t: torch.Tensor, rows: int, channels: int) -> None:
    if t.numel() != rows * channels or not t.is_contiguous():
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} (contiguous={t.is_contiguous()}): expected a "
            f"contiguous tensor of {rows} rows x {channels} channels"
        )


# ---- RMS norm (+ input bias, + SiLU) --------------------------------------------------------


def rms_norm_act_reference(
    x: torch.Tensor,
    gamma: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    silu: bool,
    residual: torch.Tensor | None = None,
    dim: int = -1,
) -> torch.Tensor:
    """Plain torch: the norm over ``dim`` (the kernel's rows ``[..., C]``: -1; the reference
    decoder's ``[B, C, T, H, W]``: 1), same shape, fp32 math, ONE rounding to x's dtype at the
    end. ``gamma`` and ``bias`` broadcast against x along ``dim`` (``[C]`` for rows, the VAE's
    ``[C, 1, 1, 1]`` for channels first). With ``residual`` the input is ``(x + bias + residual)``
    rounded to x's dtype (out of place here; the kernel also writes that sum back into x).

    Where diffusers' ``WanRMS_norm`` rounds a 16-bit input after the normalisation, again after
    each scale and after the SiLU, this rounds once: equal in fp32, closer to fp32 in bf16."""
    v = x.float()
    if residual is not None:
        v = add_bias_residual_reference(x, bias=bias, residual=residual).float()
    elif bias is not None:
        v = v + bias.float()
    y = F.normalize(v, dim=dim, eps=NORM_EPS) * math.sqrt(v.shape[dim]) * gamma.float()
    if silu:
        y = F.silu(y)
    return y.to(x.dtype)


if triton is not None:

    @triton.jit
    def _rms_norm_act_kernel(
        x_ptr,
        bias_ptr,
        res_ptr,
        gamma_ptr,
        out_ptr,
        hist_ptr,
        hist_start,
        n_rows,
        C,
        scale,
        eps,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        HAS_HIST: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK_C: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < C
        mask = (rows < n_rows)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            x = tl.where(mask, x + b[None, :], 0.0)
        if HAS_RES:  # the resnet's closing add: round the sum as the unfused add would, keep it
            x += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            x_sum = x.to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + offs, x_sum, mask=mask)
            x = x_sum.to(tl.float32)
        norm = tl.sqrt(tl.sum(x * x, axis=1))
        inv = scale / tl.maximum(norm, eps)
        g = tl.load(gamma_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = x * inv[:, None] * g[None, :]
        if SILU:
            y = y * tl.sigmoid(y)
        y = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, y, mask=mask)
        if HAS_HIST:  # rows from hist_start on are also the conv's history for the next chunk
            hrow = rows - hist_start
            hmask = mask & (hrow >= 0)[:, None]
            tl.store(hist_ptr + hrow.to(tl.int64)[:, None] * C + cols[None, :], y, mask=hmask)

    @triton.jit
    def _add_bias_residual_kernel(
        y_ptr,
        bias_ptr,
        r_ptr,
        n_rows,
        C,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        BLOCK_C: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < C
        mask = (rows < n_rows)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            y += tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_act(
    x: torch.Tensor,
    gamma: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    silu: bool,
    out: torch.Tensor | None = None,
    hist: torch.Tensor | None = None,
    hist_start: int = 0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``rms_norm_act_reference``: ``x`` contiguous ``[..., C]``; ``out`` (optional) any
    contiguous tensor with the same number of elements (e.g. a frame range of a conv buffer).
    ``hist`` (optional, contiguous rows): rows ``r >= hist_start`` of the result are also stored
    at row ``r - hist_start`` of it (the next chunk's conv history; ``hist_start`` may be < 0).
    ``residual`` (optional, contiguous, x's size): x becomes ``x + bias + residual`` IN PLACE
    (rounded to x's dtype) and the norm is taken of that; ``out`` must not overlap x then."""
    if triton is None:
        raise RuntimeError("rms_norm_act needs triton; install it or use rms_norm_act_reference")
    channels = x.shape[-1]
    rows = x.numel() // channels
    _check_rows("x", x, rows, channels)
    if out is None:
        out = torch.empty_like(x)
    _check_rows("out", out, rows, channels)
    if gamma.numel() != channels or (bias is not None and bias.numel() != channels):
        raise ValueError(f"gamma/bias must have {channels} values (one per channel)")
    if residual is not None:
        _check_rows("residual", residual, rows, channels)
        if out.data_ptr() == x.data_ptr():
            raise ValueError("with a residual, x receives the sum: out must be another tensor")
    if hist is not None:
        h_rows = hist.numel() // channels
        _check_rows("hist", hist, h_rows, channels)
        if not (rows - hist_start == h_rows and hist_start > -h_rows):
            raise ValueError(f"hist holds {h_rows} rows: rows {hist_start}..{rows} of {rows} do not fit it")
    block_c, n_per = _row_blocks(channels)
    grid = (triton.cdiv(rows, n_per),)
    _rms_norm_act_kernel[grid](
        x,
        bias if bias is not None else gamma,  # dummy pointer when HAS_BIAS is off
        residual if residual is not None else x,  # dummy pointer when HAS_RES is off
        gamma,
        out,
        hist if hist is not None else out,
        hist_start,
        rows,
        channels,
        math.sqrt(channels),
        NORM_EPS,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        HAS_HIST=hist is not None,
        SILU=silu,
        BLOCK_C=block_c,
        ROWS=n_per,
        num_warps=ROW_TILES["norm"][1],
    )
    return out


# ---- y += bias + residual ------------------------------------------------------------------


def add_bias_residual_reference(
    y: torch.Tensor, *, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """Plain torch, out of place: ``y + bias + residual`` in fp32, rounded once to y's dtype.
    ``bias`` broadcasts over the last dim (rows); the reference decoder's own adds (a resnet's
    closing add, the attention's and the upsampler's shortcuts) pass no bias (their convs add it),
    so any layout works there."""
    v = y.float()
    if bias is not None:
        v = v + bias.float()
    if residual is not None:
        v = v + residual.float()
    return v.to(y.dtype)


def add_bias_residual_(
    y: torch.Tensor, *, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """Triton, in place on contiguous rows ``y [..., C]``; ``residual`` contiguous, y's size."""
    if triton is None:
        raise RuntimeError("add_bias_residual_ needs triton; use add_bias_residual_reference")
    channels = y.shape[-1]
    rows = y.numel() // channels
    _check_rows("y", y, rows, channels)
    if residual is not None:
        _check_rows("residual", residual, rows, channels)
    if bias is not None and bias.numel() != channels:
        raise ValueError(f"bias has {bias.numel()} values: expected {channels} (one per channel)")
    if bias is None and residual is None:
        return y
    block_c, n_per = _row_blocks(channels, "add")
    _add_bias_residual_kernel[(triton.cdiv(rows, n_per),)](
        y,
        bias if bias is not None else y,
        residual if residual is not None else y,
        rows,
        channels,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        BLOCK_C=block_c,
        ROWS=n_per,
        num_warps=ROW_TILES["add"][1],
    )
    return y


# ---- nearest-x2 upsampling + 3x3 conv as four 2x2 phase convolutions -------------------------
#
# With U = nearest_x2(X) (U[2h + i] = X[h]) and Y = conv3x3(U, W, pad 1), output row 2h + py
# only ever sees two distinct input rows: py = 0 -> X[h-1] (tap 0), X[h] (taps 1+2);
# py = 1 -> X[h] (taps 0+1), X[h+1] (tap 2); columns alike. So each output parity (py, px) is a
# 2x2 convolution of the low-resolution X: 4 taps instead of 9, at a quarter of the positions
# (the upsample's work shrinks to 4/9). All four run as ONE conv2d(X, [4*Cout, Cin, 2, 2], padding=1) whose
# output O[N, H+1, W+1, 4*Cout] holds phase (py, px) at rows h+py, columns w+px and channel block
# 2*py+px; ``upsample_phase_combine`` interleaves the phases into Y[N, 2H, 2W, Cout] and adds the
# conv bias and the duplicate-upsample shortcut in the same pass.

_PHASE_ROWS = (((1, 0, 0), (0, 1, 1)), ((1, 1, 0), (0, 0, 1)))  # [parity][2x2 tap][3x3 tap]  # fmt: skip


def phase_weights(w3x3: torch.Tensor) -> torch.Tensor:
    """``[Cout, Cin, 3, 3]`` -> the four 2x2 phase kernels stacked as ``[4*Cout, Cin, 2, 2]``
    (block 2*py+px), summed in fp32."""
    a = torch.tensor(_PHASE_ROWS, dtype=torch.float32, device=w3x3.device)  # [2, 2, 3]
    w = w3x3.float()
    blocks = [torch.einsum("ik,jl,ockl->ocij", a[py], a[px], w) for py in (0, 1) for px in (0, 1)]
    return torch.cat(blocks, dim=0)


def upsample_phase_combine_reference(
    o: torch.Tensor, bias: torch.Tensor, x_in: torch.Tensor, index: torch.Tensor, *, r: int
) -> torch.Tensor:
    """Plain torch. ``o [N, H+1, W+1, 4*Cout]`` phase conv output; ``x_in [N // r, H, W, Cin]`` the
    shortcut source (frame n of the output uses source frame n // r and time phase n % r);
    ``index [r, 2, 2, Cout]`` int: the source channel of each (time, row, column) phase.
    Returns ``Y [N, 2H, 2W, Cout] = interleave(o) + bias + shortcut``: the phases and the shortcut
    are moved, not computed, and the sum is `add_bias_residual_reference` (fp32, one rounding to
    o's dtype), the same add the reference decoder runs after its upsampler."""
    n, hp, wp, c4 = o.shape
    h, w, cout = hp - 1, wp - 1, c4 // 4
    y = o.new_empty(n, h, 2, w, 2, cout)  # [N, H, py, W, px, Cout]: output row 2h + py, column 2w + px
    shortcut = x_in.new_empty(n, h, 2, w, 2, cout)
    src = x_in.repeat_interleave(r, dim=0)  # [N, H, W, Cin]
    for py in (0, 1):
        for px in (0, 1):
            y[:, :, py, :, px] = o[:, py : py + h, px : px + w, (2 * py + px) * cout : (2 * py + px + 1) * cout]
            for a in range(r):
                shortcut[a::r, :, py, :, px] = src[a::r].index_select(-1, index[a, py, px].long())
    return add_bias_residual_reference(
        y.view(n, 2 * h, 2 * w, cout), bias=bias, residual=shortcut.view(n, 2 * h, 2 * w, cout)
    )


if triton is not None:

    @triton.jit
    def _upsample_phase_combine_kernel(
        o_ptr,
        bias_ptr,
        x_ptr,
        idx_ptr,
        y_ptr,
        n_rows,
        H,
        W,
        C,
        CIN,
        R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * ROWS + tl.arange(0, ROWS)  # output pixel (n, yy, xx) in [N, 2H, 2W]
        cols = tl.arange(0, BLOCK_C)
        rmask = rows < n_rows
        cmask = cols < C
        mask = rmask[:, None] & cmask[None, :]
        xx = rows % (2 * W)
        t = rows // (2 * W)
        yy = t % (2 * H)
        n = t // (2 * H)
        px = xx % 2
        py = yy % 2
        w = xx // 2
        h = yy // 2
        a = n % R
        o_row = ((n.to(tl.int64) * (H + 1) + h + py) * (W + 1) + w + px) * (4 * C) + (2 * py + px) * C
        v = tl.load(o_ptr + o_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        phase = (a * 2 + py) * 2 + px
        ch = tl.load(idx_ptr + phase[:, None] * C + cols[None, :], mask=mask, other=0)
        x_row = (((n // R).to(tl.int64) * H + h) * W + w) * CIN
        v += tl.load(x_ptr + x_row[:, None] + ch, mask=mask, other=0.0).to(tl.float32)
        y_off = rows.to(tl.int64)[:, None] * C + cols[None, :]
        tl.store(y_ptr + y_off, v.to(y_ptr.dtype.element_ty), mask=mask)


def upsample_phase_combine(
    o: torch.Tensor, bias: torch.Tensor, x_in: torch.Tensor, index: torch.Tensor, *, r: int
) -> torch.Tensor:
    """Triton ``upsample_phase_combine_reference`` (``index`` int32, contiguous inputs)."""
    if triton is None:
        raise RuntimeError("upsample_phase_combine needs triton; use the reference")
    n, hp, wp, c4 = o.shape
    h, w, cout = hp - 1, wp - 1, c4 // 4
    if c4 != 4 * cout or x_in.shape[:3] != (n // r, h, w) or n % r:
        raise ValueError(
            f"phase output {tuple(o.shape)} and shortcut source {tuple(x_in.shape)} with r={r}: "
            "expected o [N, H+1, W+1, 4C] and x_in [N/r, H, W, Cin]"
        )
    if index.shape != (r, 2, 2, cout) or index.dtype != torch.int32:
        raise ValueError(f"index {tuple(index.shape)} {index.dtype}: expected [{r}, 2, 2, {cout}] int32")
    for name, t in (("o", o), ("x_in", x_in), ("index", index)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    y = o.new_empty(n, 2 * h, 2 * w, cout)
    block_c, n_per = _row_blocks(cout, "combine")
    rows = n * 4 * h * w
    _upsample_phase_combine_kernel[(triton.cdiv(rows, n_per),)](
        o, bias, x_in, index, y, rows, h, w, cout, x_in.shape[-1],
        R=r, BLOCK_C=block_c, ROWS=n_per, num_warps=ROW_TILES["combine"][1],
    )  # fmt: skip
    return y
