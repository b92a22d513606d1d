"""Plain-torch reference ops of the PAN2 DiT block: one function per step a kernel may fuse.

The DiT (`pan2render.models.dit`) calls these only through a `DiTOps` table held by the model, so
the fused-kernel switch (`PAN2PipelineConfig.dit_fused_kernels`) swaps the table and never touches
the model. A kernel that replaces one of these (``pan2render.kernels.dit_modulation``,
``pan2render.kernels.dit_qk_norm_rope``) takes the same arguments and must return the same values
(dtype included): these functions are the only references, the ones the model runs wherever a
kernel cannot and the ones the kernel tests compare against.

Conventions (shapes):
- ``x`` hidden states ``[B, L, dim]`` in the compute dtype (fp32 or bf16).
- Modulation rows (``shift``, ``scale``, ``gate``) are ``[U, dim]`` fp32, one row per DISTINCT
  timestep value of the batch; ``index`` (int64) maps tokens to rows: ``[B]`` when the timestep is
  per sample, ``[B, L]`` when it is per token (first-frame conditioning gives the image tokens
  timestep 0). A per-token ``[B, L, 6, dim]`` table is never built; a fused kernel gathers the row
  per token itself.
- RoPE tables ``freqs_cos`` / ``freqs_sin`` are ``[L, head_dim // 2]`` fp32, one angle per
  interleaved pair ``(x[2i], x[2i + 1])`` (diffusers stores the same values repeated twice).

Numerics: norms, modulation and gated residuals are computed in fp32, as in diffusers'
WanTransformerBlock. The residual update keeps ``x``'s dtype; a norm returns ``out_dtype`` (the
dtype of the linear it feeds; default ``x``'s dtype). With ``x`` in the compute dtype this is
diffusers' rounding exactly (the stream rounded to bf16 after every residual add), so our DiT
matches WanTransformer3DModel in fp32 and bf16 alike. ``PAN2DiT.set_residual_dtype(torch.float32)``
keeps ``x`` in fp32 instead and passes the bf16 linears their inputs through ``out_dtype``: that is
where we differ from diffusers on purpose (rel. L2 vs fp32 1.46e-2 -> 3.35e-3, docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from pan2render.kernels.attention import attention as _chosen_attention
from pan2render.kernels.dit_fused import routed_dit_ops

__all__ = [
    "DiTOps",
    "TORCH_OPS",
    "apply_rope",
    "attention",
    "gated_residual",
    "head_groups_layout",
    "layer_norm",
    "modulated_norm",
    "per_token",
    "qk_norm_rope",
    "residual_layer_norm",
    "residual_modulated_norm",
    "rms_norm_heads",
]


def per_token(rows: Tensor, index: Tensor) -> Tensor:
    """Pick each token's modulation row: rows ``[U, dim]``, index ``[B]`` or ``[B, L]``.

    Returns ``[B, 1, dim]`` (broadcasts over the sequence) or ``[B, L, dim]``.
    """
    picked = rows[index]
    return picked.unsqueeze(1) if index.ndim == 1 else picked


def modulated_norm(
    x: Tensor, *, shift: Tensor, scale: Tensor, index: Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> Tensor:
    """AdaLN: ``LayerNorm(x) * (1 + scale) + shift`` (no affine), in fp32, cast to ``out_dtype``
    (default x's dtype).

    x ``[B, L, dim]``; shift / scale ``[U, dim]`` fp32; index ``[B]`` or ``[B, L]``.
    """
    normed = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * (1 + per_token(scale, index)) + per_token(shift, index)).to(out_dtype or x.dtype)


def layer_norm(
    x: Tensor, *, weight: Tensor | None, bias: Tensor | None, eps: float, out_dtype: torch.dtype | None = None
) -> Tensor:
    """The cross-attention input norm (affine LayerNorm in fp32), cast to ``out_dtype`` (default
    x's dtype); identity (still cast) when weight is None.

    ``weight is None`` is the ``cross_attn_norm=False`` layout, where diffusers uses nn.Identity.
    """
    if weight is None:
        return x.to(out_dtype or x.dtype)
    bias_f = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias_f, eps).to(out_dtype or x.dtype)


def gated_residual(x: Tensor, y: Tensor, *, gate: Tensor | None, index: Tensor) -> Tensor:
    """Residual update ``x + y * gate`` in fp32, cast to x's dtype; ``gate=None`` is ``x + y``.

    x, y ``[B, L, dim]``; gate ``[U, dim]`` fp32 or None (the cross-attention residual). y may be
    bf16 under an fp32 x (the fp32 residual stream): the sum is still x's dtype.
    """
    if gate is None:
        return (x + y).to(x.dtype)  # a no-op cast unless y's dtype is wider than x's
    return (x.float() + y.float() * per_token(gate, index)).type_as(x)


def residual_layer_norm(
    x: Tensor,
    y: Tensor,
    *,
    gate: Tensor | None,
    index: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Gated residual, then the affine norm of the result: returns ``(x_new, normed)``, x_new in
    x's dtype, normed in ``out_dtype`` (default x's dtype).

    One fused pass in a kernel (self-attention residual -> cross-attention input norm).
    """
    x = gated_residual(x, y, gate=gate, index=index)
    return x, layer_norm(x, weight=weight, bias=bias, eps=eps, out_dtype=out_dtype)


def residual_modulated_norm(
    x: Tensor,
    y: Tensor,
    *,
    gate: Tensor | None,
    index: Tensor,
    shift: Tensor,
    scale: Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Gated residual, then AdaLN of the result: returns ``(x_new, normed)``, x_new in x's dtype,
    normed in ``out_dtype`` (default x's dtype).

    One fused pass in a kernel (cross-attention residual -> feed-forward input norm).
    """
    x = gated_residual(x, y, gate=gate, index=index)
    return x, modulated_norm(x, shift=shift, scale=scale, index=index, eps=eps, out_dtype=out_dtype)


def rms_norm_heads(x: Tensor, *, weight: Tensor, num_heads: int, eps: float) -> Tensor:
    """RMSNorm across ALL heads (Wan's ``rms_norm_across_heads``), then split heads.

    x ``[B, L, heads * head_dim]`` -> ``[B, L, heads, head_dim]``, dtype kept (torch.nn.RMSNorm).
    """
    return F.rms_norm(x, (x.shape[-1],), weight, eps).unflatten(-1, (num_heads, -1))


def apply_rope(x: Tensor, *, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotate interleaved pairs: x ``[B, L, H, D]``, freqs ``[L, D // 2]`` fp32 -> ``[B, L, H, D]``.

    Math in fp32 (fp32 tables promote), stored back in x's dtype, as diffusers does.
    """
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)  # [B, L, H, D/2] each: even / odd lanes
    cos = freqs_cos[:, None, :]  # [L, 1, D/2]
    sin = freqs_sin[:, None, :]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # [B, L, H, D/2, 2]
    return rotated.flatten(-2).type_as(x)


def qk_norm_rope(
    q: Tensor,
    k: Tensor,
    *,
    norm_q_weight: Tensor,
    norm_k_weight: Tensor,
    freqs_cos: Tensor,
    freqs_sin: Tensor,
    num_heads: int,
    eps: float,
    head_groups: int = 1,
) -> tuple[Tensor, Tensor]:
    """Self-attention Q/K prologue: RMSNorm across heads + 3-D RoPE + head-major layout.

    q, k ``[B, L, heads * head_dim]`` (projection outputs); freqs ``[L, head_dim // 2]`` for
    exactly these L tokens (a sequence shard passes its own slice). Returns q, k as
    ``[B, heads, L, head_dim]``, the layout `attention` takes; with ``head_groups`` G > 1 as
    ``[G, B, L, heads / G, head_dim]`` contiguous instead (`head_groups_layout`).
    """
    q = rms_norm_heads(q, weight=norm_q_weight, num_heads=num_heads, eps=eps)
    k = rms_norm_heads(k, weight=norm_k_weight, num_heads=num_heads, eps=eps)
    q = apply_rope(q, freqs_cos=freqs_cos, freqs_sin=freqs_sin)
    k = apply_rope(k, freqs_cos=freqs_cos, freqs_sin=freqs_sin)
    if head_groups > 1:
        return head_groups_layout(q, head_groups), head_groups_layout(k, head_groups)
    return q.transpose(1, 2), k.transpose(1, 2)


def head_groups_layout(x: Tensor, groups: int) -> Tensor:
    """``[B, L, heads, head_dim]`` -> ``[G, B, L, heads / G, head_dim]`` contiguous: group g holds
    heads ``[g * heads / G, (g + 1) * heads / G)``. The layout a sequence-parallel attention asks
    for (``attention_fn.head_groups``): chunk g of its all-to-all goes to rank g as it lies."""
    heads = x.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} heads do not split into {groups} head groups")
    return x.unflatten(2, (groups, heads // groups)).permute(2, 0, 1, 3, 4).contiguous()


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Unmasked softmax attention: q ``[B, H, Lq, D]``, k / v ``[B, H, Lk, D]`` -> ``[B, H, Lq, D]``.

    The single place the DiT attends. Sequence parallelism (Ulysses) wraps this call with its
    all-to-alls (see `SelfAttention.attention_fn`); the backend choice lives behind it too.
    """
    return _chosen_attention(q, k, v)  # pan2render.kernels.attention picks the SDPA backend


@dataclass(frozen=True)
class DiTOps:
    """The swappable steps of a DiT block; the defaults are the plain-torch references above.

    `ROUTED_OPS` (below) has kernel entries with the same signatures; the pipeline hands one table
    or the other to `PAN2DiT.set_ops` (``PAN2PipelineConfig.dit_fused_kernels``), and
    ``dataclasses.replace`` makes a table fusing only some ops. Attention is not in here: it is
    swapped per attention module (`attention_fn`) because sequence parallelism wraps self-attention only.
    """

    modulated_norm: Callable[..., Tensor] = modulated_norm
    residual_layer_norm: Callable[..., tuple[Tensor, Tensor]] = residual_layer_norm
    residual_modulated_norm: Callable[..., tuple[Tensor, Tensor]] = residual_modulated_norm
    gated_residual: Callable[..., Tensor] = gated_residual
    qk_norm_rope: Callable[..., tuple[Tensor, Tensor]] = qk_norm_rope


TORCH_OPS = DiTOps()

# The table the model uses by default (PAN2PipelineConfig.dit_fused_kernels=True): each entry runs
# its fused Triton kernel where it can run on these tensors (CUDA, no grad, not compiling; see
# pan2render.kernels.dit_fused) and the reference above otherwise.
ROUTED_OPS = DiTOps(**routed_dit_ops({f.name: getattr(TORCH_OPS, f.name) for f in fields(DiTOps)}))
