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
Two kernels cover every step:
- :func:`layernorm_modulate`: ``n = LN(x) [* w + b] [* (1 + scale) + shift]``;
- :func:`residual_layernorm_modulate`: ``h' = round(h + y [* gate])`` then (unless ``norm=False``,
  the block's last residual) the same norm of the rounded ``h'`` (rounded first, exactly as the
  unfused code sees it): one read of h and y, one write of h' and of the normed row.

Per-token timesteps (Wan2.2 TI2V: the first latent frame is clean, t=0) without a per-token table,
in the conventions of ``pan2render.models.dit_ops``: each modulation row (shift, scale, gate) is a
``[U, D]`` table with one row per DISTINCT timestep value (any row stride, e.g. a ``unbind`` of the
block's ``[U, 6, D]`` table), and ``index`` (int) maps tokens to rows: ``[B]`` (per sample) or
``[B, L]`` (per token); the kernel gathers each token's row itself. All math is fp32; x / y are
loaded in their dtype and outputs stored in x's dtype.
"""

from __future__ import annotations

import torch

try:  # CPU-only installs may lack triton: the references below still work, the kernels do not.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None


def per_token_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [U, D], index [B] or [B, L] -> [B, 1, D] or [B, L, D] fp32 (the reference's gather)."""
    picked = rows.float()[index.long()]
    return picked.unsqueeze(1) if index.ndim == 1 else picked


def layernorm_modulate_reference(
    x: torch.Tensor,
    *,
    shift: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Plain torch: ``LN(x) [* weight + bias] [* (1 + scale[index]) + shift[index]]`` -> x.dtype."""
    dim = x.shape[-1]
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    n = torch.nn.functional.layer_norm(x.float(), (dim,), w, b, eps)
    if shift is not None:
        assert scale is not None and index is not None
        n = n * (1 + per_token_rows(scale, index)) + per_token_rows(shift, index)
    return n.to(x.dtype)


def residual_layernorm_modulate_reference(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    gate: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    norm: bool = True,
    shift: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain torch: ``x' = (x + y [* gate[index]]).to(x.dtype)``; returns (x', norm-modulate(x') or None)."""
    if gate is None:
        x_new = (x.float() + y.float()).to(x.dtype)
    else:
        assert index is not None
        x_new = (x.float() + y.float() * per_token_rows(gate, index)).to(x.dtype)
    if not norm:
        return x_new, None
    normed = layernorm_modulate_reference(
        x_new, shift=shift, scale=scale, index=index, weight=weight, bias=bias, eps=eps
    )
    return x_new, normed


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
        HAS_INDEX: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program = one token row of `dim` channels held in registers (dim 3072 -> BLOCK 4096).
        row = tl.program_id(0)
        b = row // seq
        l = row % seq
        d = tl.arange(0, BLOCK)
        mask = d < dim
        if HAS_INDEX:
            u = tl.load(idx_ptr + b * idx_sb + l * idx_sl).to(tl.int64)  # this token's timestep row
        else:
            u = 0
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
        raise ValueError(f"dim={dim} exceeds the kernel's cap {_MAX_DIM}; use the reference")
    block = triton.next_power_of_2(dim)
    return block, (4 if block <= 1024 else 8)


def _check_rows(name: str, rows: torch.Tensor | None, dim: int) -> None:
    if rows is None:
        return
    if rows.ndim != 2 or rows.shape[1] != dim or rows.stride(1) != 1:
        raise ValueError(
            f"{name} has shape {tuple(rows.shape)} strides {rows.stride()}; expected [U, {dim}] with a contiguous last dim"
        )


def _index_strides(index: torch.Tensor | None, batch: int, seq: int) -> tuple[int, int]:
    """(batch stride, token stride) of index [B] (token stride 0) or [B, L]."""
    if index is None:
        return 0, 0
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index dtype {index.dtype} must be int32 or int64")
    if tuple(index.shape) == (batch,):
        return index.stride(0), 0
    if tuple(index.shape) == (batch, seq):
        return index.stride(0), index.stride(1)
    raise ValueError(f"index shape {tuple(index.shape)}: expected [{batch}] (per sample) or [{batch}, {seq}] (per token)")


def _launch(
    x: torch.Tensor,
    y: torch.Tensor | None,
    *,
    gate: torch.Tensor | None,
    index: torch.Tensor | None,
    norm: bool,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if triton is None:
        raise RuntimeError("the DiT modulation kernels need triton; install it or use the *_reference functions")
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
    if (shift is not None or gate is not None) and index is None:
        raise ValueError("modulation rows need an index ([B] or [B, L]) naming each token's row")
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
        dummy if index is None else index,
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
        HAS_INDEX=index is not None,
        BLOCK=block,
        num_warps=warps,
    )
    return x_out, n_out


def layernorm_modulate(
    x: torch.Tensor,
    *,
    shift: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton kernel for :func:`layernorm_modulate_reference`: x [B, L, D] -> [B, L, D] in x's dtype
    (or ``out_dtype``: an fp32 residual stream feeding bf16 linears)."""
    _, normed = _launch(
        x, None, gate=None, index=index, norm=True, shift=shift, scale=scale, weight=weight, bias=bias, eps=eps,
        out_dtype=out_dtype,
    )
    assert normed is not None
    return normed


def residual_layernorm_modulate(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    gate: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    norm: bool = True,
    shift: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton kernel for :func:`residual_layernorm_modulate_reference`: returns (x', normed or None);
    x' keeps x's dtype, normed is in ``out_dtype`` (default x's dtype)."""
    x_new, normed = _launch(
        x, y, gate=gate, index=index, norm=norm, shift=shift, scale=scale, weight=weight, bias=bias, eps=eps,
        out_dtype=out_dtype,
    )
    assert x_new is not None
    return x_new, normed
