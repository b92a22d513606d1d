"""Fused Q/K RMSNorm (across all heads) + RoPE for the PAN2 / Wan2.2 DiT self-attention.

The math follows diffusers' ``WanAttnProcessor`` (transformer_wan.py, diffusers 0.42.1):

    q = RMSNorm(q, over heads*head_dim, eps, weight_q)         # [B, L, heads*head_dim]
    q = q.unflatten(-1, (heads, head_dim))                      # [B, L, heads, head_dim]
    pairs (q[..., 2i], q[..., 2i+1]) rotate by the angle of token l, pair i

with the angles given per token: tables ``[L, head_dim // 2]`` as the model's ``RotaryPosEmbed``
makes them for exactly these L tokens (the 3-D t/h/w split is already in the table; a sequence
shard passes its own rows). diffusers rounds to bf16 after the norm and again after the rotation;
the kernel keeps fp32 from load to store (one rounding), so it is at least as close to an fp32
reference.

:func:`qk_norm_rope` is ``pan2render.models.dit_ops.qk_norm_rope`` fused, same signature and
result; that plain-torch function is the reference (the model runs it wherever the kernel cannot
run, and tests/kernels/test_dit_qk_norm_rope.py compares the two). The kernel reads q and k once
and writes them once (one launch, one program per token row and tensor).
"""

from __future__ import annotations

import torch

try:  # CPU-only installs may lack triton: the model then runs the dit_ops reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _qk_norm_rope_kernel(
        q_ptr,
        k_ptr,
        qo_ptr,
        ko_ptr,
        wq_ptr,
        wk_ptr,
        cos_ptr,
        sin_ptr,
        seq,
        q_stride_b,
        q_stride_l,
        k_stride_b,
        k_stride_l,
        o_stride_b,
        o_stride_l,
        o_stride_h,
        o_stride_g,
        group_heads,
        eps,
        HALF: tl.constexpr,  # head_dim // 2: pairs per head
        N_PAIRS: tl.constexpr,  # heads * head_dim // 2
        BLOCK: tl.constexpr,  # next power of two >= N_PAIRS
    ):
        # One program = one token row of q (axis 1 == 0) or of k (axis 1 == 1): all heads at once,
        # since the RMS is taken over heads*head_dim.
        row = tl.program_id(0)
        which = tl.program_id(1)
        b = row // seq
        l = row % seq
        if which == 0:
            x_ptr = q_ptr + b.to(tl.int64) * q_stride_b + l * q_stride_l
            o_ptr = qo_ptr
            w_ptr = wq_ptr
        else:
            x_ptr = k_ptr + b.to(tl.int64) * k_stride_b + l * k_stride_l
            o_ptr = ko_ptr
            w_ptr = wk_ptr
        o_ptr = o_ptr + b.to(tl.int64) * o_stride_b + l.to(tl.int64) * o_stride_l

        # The row as [pairs, 2]: contiguous (vectorised) loads, then split into even / odd lanes.
        j = tl.arange(0, BLOCK)
        lane = tl.arange(0, 2)
        offs = 2 * j[:, None] + lane[None, :]  # [BLOCK, 2]
        mask = offs < 2 * N_PAIRS
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        ms = tl.sum(tl.sum(x * x, axis=1), axis=0) / (2 * N_PAIRS)
        rstd = 1.0 / tl.sqrt(ms + eps)
        x = x * rstd * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x0, x1 = tl.split(x)  # [BLOCK] each

        # Token l's angles: row l of the per-token tables, pair jp of every head.
        jp = j % HALF
        pmask = j < N_PAIRS
        c = tl.load(cos_ptr + l * HALF + jp, mask=pmask, other=1.0)
        s = tl.load(sin_ptr + l * HALF + jp, mask=pmask, other=0.0)
        y = tl.join(x0 * c - x1 * s, x0 * s + x1 * c)  # [BLOCK, 2]
        # Output element (head h, channel 2*jp + lane) at (h // G) * o_stride_g + (h % G) * o_stride_h
        # + 2 * jp + lane: token-major [B, L, H, D] (one group, G = heads) or head groups
        # [H/G, B, L, G, D] (the all-to-all's send layout), by the strides.
        head = j // HALF
        o_offs = ((head // group_heads).to(tl.int64) * o_stride_g + (head % group_heads) * o_stride_h)[:, None]
        o_offs = o_offs + (2 * jp)[:, None] + lane[None, :]
        tl.store(o_ptr + o_offs, y.to(o_ptr.dtype.element_ty), mask=mask)


# One row of q at the DiT size is 3072 channels = 1536 pairs; a block holds all pairs of a row in
# registers. 8192 pairs (16 K channels) is far above any Wan config and keeps registers in check.
_MAX_PAIRS = 8192


def _num_warps(block: int) -> int:
    return 4 if block <= 512 else 8  # 1536 pairs at the DiT size: 8 warps, 12 channels per thread


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    norm_q_weight: torch.Tensor,
    norm_k_weight: torch.Tensor,
    freqs_cos: torch.Tensor,
    freqs_sin: torch.Tensor,
    num_heads: int,
    eps: float,
    head_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``dit_ops.qk_norm_rope``: q, k ``[B, L, heads * head_dim]`` (last dim contiguous; rows
    may be strided, e.g. chunks of a fused QKV projection), freqs ``[L, head_dim // 2]`` for exactly
    these L tokens -> q, k as ``[B, heads, L, head_dim]`` in q's dtype (views of a contiguous
    ``[B, L, heads, head_dim]``, the layout the projections write); with ``head_groups`` G > 1 as
    ``[G, B, L, heads / G, head_dim]`` contiguous (group g = heads [g*heads/G, (g+1)*heads/G)):
    the send buffer of a sequence-parallel all-to-all, written in place.
    """
    if triton is None:
        raise RuntimeError("qk_norm_rope needs triton; install it or use pan2render.models.dit_ops.qk_norm_rope")
    if q.shape != k.shape or q.ndim != 3:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must both be [B, L, heads*head_dim]")
    batch, seq, dim = q.shape
    if dim % num_heads != 0:
        raise ValueError(f"q's last dim {dim} is not divisible by num_heads={num_heads}")
    head_dim = dim // num_heads
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous last dim (stride 1); call .contiguous() first")
    for name, table in (("freqs_cos", freqs_cos), ("freqs_sin", freqs_sin)):
        if tuple(table.shape) != (seq, head_dim // 2):
            raise ValueError(f"{name} has shape {tuple(table.shape)}; expected one row per token and one column "
                             f"per pair: [{seq}, {head_dim // 2}]")
    n_pairs = num_heads * head_dim // 2
    if n_pairs > _MAX_PAIRS:
        raise ValueError(f"heads*head_dim={2 * n_pairs} exceeds the kernel's cap {2 * _MAX_PAIRS}; "
                         "use pan2render.models.dit_ops.qk_norm_rope")
    if head_groups < 1 or num_heads % head_groups:
        raise ValueError(f"head_groups={head_groups} must divide num_heads={num_heads}")
    block = triton.next_power_of_2(n_pairs)
    cos = freqs_cos.to(device=q.device, dtype=torch.float32).contiguous()
    sin = freqs_sin.to(device=q.device, dtype=torch.float32).contiguous()
    group = num_heads // head_groups
    if head_groups > 1:
        shape = (head_groups, batch, seq, group, head_dim)
    else:
        shape = (batch, seq, num_heads, head_dim)
    q_out = torch.empty(shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(shape, dtype=k.dtype, device=k.device)
    if batch * seq > 0:
        # (batch, token, head-in-group, group) strides of the output, whichever layout.
        if head_groups > 1:
            o_strides = (q_out.stride(1), q_out.stride(2), q_out.stride(3), q_out.stride(0))
        else:
            o_strides = (*q_out.stride()[:3], 0)
        _qk_norm_rope_kernel[(batch * seq, 2)](
            q,
            k,
            q_out,
            k_out,
            norm_q_weight,
            norm_k_weight,
            cos,
            sin,
            seq,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            *o_strides,
            group,
            eps,
            HALF=head_dim // 2,
            N_PAIRS=n_pairs,
            BLOCK=block,
            num_warps=_num_warps(block),
        )
    if head_groups > 1:
        return q_out, k_out
    return q_out.transpose(1, 2), k_out.transpose(1, 2)  # [B, H, L, D] views of [B, L, H, D]
