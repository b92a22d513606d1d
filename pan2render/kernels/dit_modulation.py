"""Fused LayerNorm + AdaLN modulation (and residual + gate before it) for the PAN2 / Wan2.2 DiT block.

The math follows diffusers' ``WanTransformerBlock`` (transformer_wan.py, diffusers 0.42.1), where a
block with modulation rows (shift, scale, gate, c_shift, c_scale, c_gate) does

    n = (LayerNorm(h.float(), eps=1e-6, no affine) * (1 + scale) + shift).to(bf16)   # before attn1
    h = (h.float() + attn1(n) * gate).to(bf16)                                       # residual + gate
    n = LayerNorm(h.float(), weight, bias).to(bf16)                                  # norm2, affine
    h = h + attn2(n)                                                                 # plain residual
    n = (LayerNorm(h.float()) * (1 + c_scale) + c_shift).to(bf16)                    # before the FFN
    h = (h.float() + ffn(n).float() * c_gate).to(bf16)                               # then the next
                                                                                     # block's norm1

One Triton kernel covers every step, exposed as the four ops of ``pan2render.models.dit_ops`` it
replaces, with their signatures; those plain-torch functions are the references (the model runs
them wherever the kernel cannot run, and tests/kernels/test_dit_modulation.py compares the two):

- :func:`modulated_norm`: ``n = LN(x) * (1 + scale) + shift``;
- :func:`residual_layer_norm` / :func:`residual_modulated_norm`: ``x' = round(x + y [* gate])``,
  then the affine / modulated norm of the rounded ``x'`` (rounded first, exactly as the unfused
  code sees it): one read of x and y, one write of x' and of the normed row;
- :func:`gated_residual`: ``x' = round(x + y [* gate])`` alone (the block's last residual).

Per-token timesteps (Wan2.2 TI2V: the first latent frame is clean, t=0) without a per-token table,
in the conventions of ``pan2render.models.dit_ops``: each modulation row (shift, scale, gate) is a
``[U, D]`` table with one row per DISTINCT timestep value (any row stride, e.g. a ``unbind`` of the
block's ``[U, 6, D]`` table), and ``index`` (int) maps tokens to rows: ``[B]`` (per sample) or
``[B, L]`` (per token); the kernel gathers each token's row itself. All math is fp32; x / y are
loaded in their dtype, x' is stored in x's dtype and the normed row in ``out_dtype`` (default x's).
"""

from __future__ import annotations

import torch

try:  # CPU-only installs may lack triton: the model then runs the dit_ops references.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _norm_mod_kernel(
        x_ptr,
        y_ptr,
        x_out_ptr,
        n_out_ptr,
        w_ptr,
        b_ptr,
        shift_ptr,
        scale_ptr,
        gate_ptr,
        idx_ptr,
        seq,
        dim,
        x_sb,
        x_sl,
        y_sb,
        y_sl,
        shift_su,
        scale_su,
        gate_su,
        idx_sb,
        idx_sl,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        HAS_GATE: tl.constexpr,
        HAS_NORM: tl.constexpr,
        HAS_AFFINE: tl.constexpr,
        HAS_MOD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program = one token row of `dim` channels held in registers (dim 3072 -> BLOCK 4096).
        row = tl.program_id(0)
        b = row // seq
        l = row % seq
        d = tl.arange(0, BLOCK)
        mask = d < dim
        u = tl.load(idx_ptr + b * idx_sb + l * idx_sl).to(tl.int64)  # this token's timestep row
        x = tl.load(x_ptr + b * x_sb + l * x_sl + d, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            y = tl.load(y_ptr + b * y_sb + l * y_sl + d, mask=mask, other=0.0).to(tl.float32)
            if HAS_GATE:
                y = y * tl.load(gate_ptr + u * gate_su + d, mask=mask, other=0.0).to(tl.float32)
            # Round the new residual stream to its storage dtype first: the norm below must see
            # exactly what the unfused code (and the next residual add) sees.
            x_new = (x + y).to(x_out_ptr.dtype.element_ty)
            tl.store(x_out_ptr + row.to(tl.int64) * dim + d, x_new, mask=mask)
            x = x_new.to(tl.float32)
        if HAS_NORM:
            mean = tl.sum(x, axis=0) / dim
            xc = tl.where(mask, x - mean, 0.0)
            var = tl.sum(xc * xc, axis=0) / dim
            n = xc * (1.0 / tl.sqrt(var + eps))
            if HAS_AFFINE:
                n = n * tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
                n = n + tl.load(b_ptr + d, mask=mask, other=0.0).to(tl.float32)
            if HAS_MOD:
                scale = tl.load(scale_ptr + u * scale_su + d, mask=mask, other=0.0).to(tl.float32)
                shift = tl.load(shift_ptr + u * shift_su + d, mask=mask, other=0.0).to(tl.float32)
                n = n * (1.0 + scale) + shift
            tl.store(n_out_ptr + row.to(tl.int64) * dim + d, n.to(n_out_ptr.dtype.element_ty), mask=mask)


# A row lives in registers; 16 K channels is far above any Wan config (3072 / 5120).
_MAX_DIM = 16384


def _block(dim: int) -> tuple[int, int]:
    if dim > _MAX_DIM:
        raise ValueError(f"dim={dim} exceeds the kernel's cap {_MAX_DIM}; use the pan2render.models.dit_ops reference")
    block = triton.next_power_of_2(dim)
    return block, (4 if block <= 1024 else 8)


def _check_rows(name: str, rows: torch.Tensor | None, dim: int) -> None:
    if rows is None:
        return
    if rows.ndim != 2 or rows.shape[1] != dim or rows.stride(1) != 1:
        raise ValueError(
            f"{name} has shape {tuple(rows.shape)} strides {rows.stride()}; expected [U, {dim}] with a "
            f"contiguous last dim"
        )


def _index_strides(index: torch.Tensor, batch: int, seq: int) -> tuple[int, int]:
    """(batch stride, token stride) of index [B] (token stride 0) or [B, L]."""
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index dtype {index.dtype} must be int32 or int64")
    if tuple(index.shape) == (batch,):
        return index.stride(0), 0
    if tuple(index.shape) == (batch, seq):
        return index.stride(0), index.stride(1)
    raise ValueError(f"index shape {tuple(index.shape)}: expected [{batch}] (per sample) or [{batch}, {seq}] "
                     f"(per token)")


def _launch(
    x: torch.Tensor,
    y: torch.Tensor | None,
    *,
    index: torch.Tensor,
    gate: torch.Tensor | None = None,
    norm: bool = True,
    shift: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One pass over the rows: ``x' = x + y [* gate]`` when y is given, then (``norm``) the
    LayerNorm of x' (or of x) with the affine ``weight, bias`` or the modulation ``shift, scale``.
    Returns (x' or None, normed or None)."""
    if triton is None:
        raise RuntimeError("the DiT modulation kernels need triton; install it or use pan2render.models.dit_ops")
    if x.ndim != 3:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [B, L, D]")
    batch, seq, dim = x.shape
    if y is not None and y.shape != x.shape:
        raise ValueError(f"y {tuple(y.shape)} must match x {tuple(x.shape)}")
    for name, t in (("x", x), ("y", y)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim (stride 1); call .contiguous() first")
    if (shift is None) != (scale is None):
        raise ValueError("pass both shift and scale for a modulated norm, or neither")
    if (weight is None) != (bias is None):
        raise ValueError("pass both weight and bias for an affine LayerNorm, or neither")
    for name, rows in (("shift", shift), ("scale", scale), ("gate", gate)):
        _check_rows(name, rows, dim)
    idx_sb, idx_sl = _index_strides(index, batch, seq)
    block, warps = _block(dim)
    x_out = torch.empty_like(x, memory_format=torch.contiguous_format) if y is not None else None
    n_out = torch.empty((batch, seq, dim), dtype=out_dtype or x.dtype, device=x.device) if norm else None
    if batch * seq == 0:
        return x_out, n_out
    dummy = x  # never read: its constexpr flag is off
    _norm_mod_kernel[(batch * seq,)](
        x,
        dummy if y is None else y,
        dummy if x_out is None else x_out,
        dummy if n_out is None else n_out,
        dummy if weight is None else weight,
        dummy if bias is None else bias,
        dummy if shift is None else shift,
        dummy if scale is None else scale,
        dummy if gate is None else gate,
        index,
        seq,
        dim,
        x.stride(0),
        x.stride(1),
        0 if y is None else y.stride(0),
        0 if y is None else y.stride(1),
        0 if shift is None else shift.stride(0),
        0 if scale is None else scale.stride(0),
        0 if gate is None else gate.stride(0),
        idx_sb,
        idx_sl,
        eps,
        HAS_RESIDUAL=y is not None,
        HAS_GATE=gate is not None,
        HAS_NORM=norm,
        HAS_AFFINE=weight is not None,
        HAS_MOD=shift is not None,
        BLOCK=block,
        num_warps=warps,
    )
    return x_out, n_out


# The ops, with pan2render.models.dit_ops' signatures and results (dtype included).


def modulated_norm(
    x: torch.Tensor,
    *,
    shift: torch.Tensor,
    scale: torch.Tensor,
    index: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fused ``dit_ops.modulated_norm``: ``LN(x) * (1 + scale) + shift`` -> ``out_dtype`` (default x's)."""
    _, normed = _launch(x, None, index=index, shift=shift, scale=scale, eps=eps, out_dtype=out_dtype)
    assert normed is not None
    return normed


def residual_layer_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    gate: torch.Tensor | None,
    index: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``dit_ops.residual_layer_norm`` (affine norm only: the reference takes the identity
    ``weight=None`` layout): returns (x' in x's dtype, normed in ``out_dtype``)."""
    if weight is None:
        raise ValueError("the fused residual_layer_norm needs the norm's weight and bias; weight=None is "
                         "the identity norm, which pan2render.models.dit_ops.residual_layer_norm runs")
    x_new, normed = _launch(x, y, index=index, gate=gate, weight=weight, bias=bias, eps=eps, out_dtype=out_dtype)
    assert x_new is not None and normed is not None
    return x_new, normed


def residual_modulated_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    gate: torch.Tensor | None,
    index: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``dit_ops.residual_modulated_norm``: returns (x' in x's dtype, normed in ``out_dtype``)."""
    x_new, normed = _launch(x, y, index=index, gate=gate, shift=shift, scale=scale, eps=eps, out_dtype=out_dtype)
    assert x_new is not None and normed is not None
    return x_new, normed


def gated_residual(x: torch.Tensor, y: torch.Tensor, *, gate: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor:
    """Fused ``dit_ops.gated_residual``: ``x + y [* gate]`` in fp32, stored in x's dtype."""
    x_new, _ = _launch(x, y, index=index, gate=gate, norm=False)
    assert x_new is not None
    return x_new
