"""Fused Q/K RMSNorm (across all heads) + 3-D RoPE for the PAN2 / Wan2.2 DiT self-attention.

The math follows diffusers' ``WanAttnProcessor`` (transformer_wan.py, diffusers 0.42.1):

    q = RMSNorm(q, over heads*head_dim, eps, weight_q)         # [B, L, heads*head_dim]
    q = q.unflatten(-1, (heads, head_dim))                      # [B, L, heads, head_dim]
    pairs (q[..., 2i], q[..., 2i+1]) rotate by angle pos_axis(i) * inv_freq(i)

with the head dim's pairs split over the (t, h, w) axes as ``WanRotaryPosEmbed`` does: for
head_dim 128 the first 22 pairs (44 channels) rotate with the frame index, the next 21 (42) with
the row, the last 21 (42) with the column. diffusers rounds to bf16 after the norm and again after
the rotation; the kernel keeps fp32 from load to store (one rounding), so it is at least as close
to an fp32 reference.

The kernel reads q and k once and writes them once (one launch, one program per token row and
tensor), and derives each token's (t, h, w) position from its global index ``offset + l``, so a
sequence-parallel rank runs it on its shard by passing the shard's first global token index.
"""

from __future__ import annotations

import torch

try:  # CPU-only installs may lack triton: the references below still work, the kernel does not.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Pairs per axis (t, h, w): h and w get 2*(head_dim//6) channels each, t the rest (44/42/42)."""
    if head_dim % 2 != 0 or head_dim < 6:
        raise ValueError(f"head_dim={head_dim} must be even and >= 6 for the 3-axis RoPE split")
    hw_dim = 2 * (head_dim // 6)
    t_dim = head_dim - 2 * hw_dim
    return t_dim // 2, hw_dim // 2, hw_dim // 2


def rope_tables(
    *, head_dim: int, max_len: int = 1024, theta: float = 10000.0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_len, head_dim // 2] fp32: row = position along an axis, column = pair.

    Columns [0, n_t) hold the t axis' frequencies, [n_t, n_t+n_h) the h axis', the rest the w
    axis' (each axis has its own frequency ladder over its own channel count, as diffusers'
    ``get_1d_rotary_pos_embed`` per axis). Computed in float64 and rounded once, like diffusers.
    """
    n_t, n_h, n_w = rope_split(head_dim)
    pos = torch.arange(max_len, dtype=torch.float64, device=device)
    cols = []
    for n_pairs in (n_t, n_h, n_w):
        axis_dim = 2 * n_pairs
        inv_freq = 1.0 / (theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float64, device=device) / axis_dim))
        cols.append(torch.outer(pos, inv_freq))  # [max_len, n_pairs]
    angles = torch.cat(cols, dim=1)  # [max_len, head_dim // 2]
    return angles.cos().float().contiguous(), angles.sin().float().contiguous()


def _split(head_dim: int, split: tuple[int, int, int] | None) -> tuple[int, int, int]:
    if split is None:
        return rope_split(head_dim)
    if sum(split) != head_dim // 2 or min(split) < 0:
        raise ValueError(f"split={split} must be 3 non-negative pair counts summing to head_dim//2={head_dim // 2}")
    return split


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    heads: int,
    cos: torch.Tensor,
    grid: tuple[int, int, int],
    offset: int,
) -> tuple[int, int, int]:
    if q.shape != k.shape or q.ndim != 3:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must both be [B, L, heads*head_dim]")
    batch, seq, dim = q.shape
    if dim % heads != 0:
        raise ValueError(f"q's last dim {dim} is not divisible by heads={heads}")
    head_dim = dim // heads
    if cos.shape[1] != head_dim // 2:
        raise ValueError(f"RoPE table has {cos.shape[1]} pair columns, head_dim={head_dim} needs {head_dim // 2}")
    frames, height, width = grid
    if offset < 0 or offset + seq > frames * height * width:
        raise ValueError(
            f"tokens [{offset}, {offset + seq}) fall outside the grid {grid} ({frames * height * width} tokens); "
            "pass the shard's global start as offset and the full latent grid"
        )
    if max(frames, height, width) > cos.shape[0]:
        raise ValueError(f"grid {grid} exceeds the RoPE table's {cos.shape[0]} positions; build rope_tables(max_len=...)")
    return batch, seq, head_dim


def token_positions(*, grid: tuple[int, int, int], offset: int, length: int, device: torch.device | str) -> torch.Tensor:
    """(t, h, w) position of tokens [offset, offset+length) of a row-major (t, h, w) grid: [length, 3] int64."""
    _, height, width = grid
    idx = torch.arange(offset, offset + length, device=device)
    return torch.stack([idx // (height * width), (idx // width) % height, idx % width], dim=1)


def qk_norm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    weight_q: torch.Tensor,
    weight_k: torch.Tensor,
    heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    grid: tuple[int, int, int],
    offset: int = 0,
    eps: float = 1e-6,
    split: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference, fp32 math: q, k [B, L, heads*head_dim] -> [B, L, heads, head_dim] in q's dtype."""
    _, seq, head_dim = _check_inputs(q, k, heads=heads, cos=cos, grid=grid, offset=offset)
    n_t, n_h, _ = _split(head_dim, split)
    pos = token_positions(grid=grid, offset=offset, length=seq, device=q.device)  # [L, 3]
    # Pair column j of the table is read at the token's position along the axis that owns j.
    axis_of_pair = torch.zeros(head_dim // 2, dtype=torch.long, device=q.device)
    axis_of_pair[n_t : n_t + n_h] = 1
    axis_of_pair[n_t + n_h :] = 2
    rows = pos[:, axis_of_pair]  # [L, head_dim//2]
    cols = torch.arange(head_dim // 2, device=q.device).expand_as(rows)
    c = cos.to(q.device).float()[rows, cols][None, :, None, :]  # [1, L, 1, head_dim//2]
    s = sin.to(q.device).float()[rows, cols][None, :, None, :]

    def one(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
        xf = xf.unflatten(-1, (heads, head_dim // 2, 2))  # [B, L, heads, pairs, 2]
        x0, x1 = xf[..., 0], xf[..., 1]
        out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
        return out.flatten(-2).to(x.dtype)

    return one(q, weight_q), one(k, weight_k)


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
        offset,
        height,
        width,
        eps,
        HALF: tl.constexpr,  # head_dim // 2: pairs per head
        N_T: tl.constexpr,  # pairs rotated by the t position
        N_H: tl.constexpr,  # pairs rotated by the h position
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

        # Global token index -> (t, h, w) on the row-major latent grid; a shard passes its offset.
        g = offset + l
        hw = height * width
        pos_t = g // hw
        pos_h = (g % hw) // width
        pos_w = g % width
        jp = j % HALF
        pos = tl.where(jp < N_T, pos_t, tl.where(jp < N_T + N_H, pos_h, pos_w))
        pmask = j < N_PAIRS
        c = tl.load(cos_ptr + pos * HALF + jp, mask=pmask, other=1.0)
        s = tl.load(sin_ptr + pos * HALF + jp, mask=pmask, other=0.0)
        y = tl.join(x0 * c - x1 * s, x0 * s + x1 * c)  # [BLOCK, 2]
        # Output element (head h, channel 2*jp + lane) at (h // G) * o_stride_g + (h % G) * o_stride_h
        # + 2 * jp + lane: token-major [B, L, H, D] or head-major [B, H, L, D] by the strides (one
        # group, G = heads), or head groups [H/G, B, L, G, D] (the all-to-all's send layout).
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
    weight_q: torch.Tensor,
    weight_k: torch.Tensor,
    heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    grid: tuple[int, int, int],
    offset: int = 0,
    eps: float = 1e-6,
    split: tuple[int, int, int] | None = None,
    head_major: bool = False,
    head_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel: q, k [B, L, heads*head_dim] (last dim contiguous; rows may be strided, e.g.
    chunks of a fused QKV projection) -> [B, L, heads, head_dim] in q's dtype, contiguous; with
    ``head_major`` the result is [B, heads, L, head_dim] contiguous instead (SDPA's native layout);
    with ``head_groups`` G > 1 it is [G, B, L, heads/G, head_dim] contiguous (group g = heads
    [g*heads/G, (g+1)*heads/G)): the send buffer of a sequence-parallel all-to-all, written in place.

    ``grid`` is the full latent token grid (frames, height, width) after patching and ``offset``
    the global index of this tensor's first token (0 unless running on a sequence shard).
    ``split`` overrides the pairs per axis (default :func:`rope_split`, 22/21/21 for head_dim 128).
    """
    if triton is None:
        raise RuntimeError("qk_norm_rope needs triton; install it or use qk_norm_rope_reference")
    batch, seq, head_dim = _check_inputs(q, k, heads=heads, cos=cos, grid=grid, offset=offset)
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous last dim (stride 1); call .contiguous() first")
    n_pairs = heads * head_dim // 2
    block = triton.next_power_of_2(n_pairs)
    if n_pairs > _MAX_PAIRS:
        raise ValueError(f"heads*head_dim={2 * n_pairs} exceeds the kernel's cap {2 * _MAX_PAIRS}; use the reference")
    n_t, n_h, _ = _split(head_dim, split)
    cos = cos.to(device=q.device, dtype=torch.float32).contiguous()
    sin = sin.to(device=q.device, dtype=torch.float32).contiguous()
    if head_groups < 1 or heads % head_groups or (head_groups > 1 and head_major):
        raise ValueError(f"head_groups={head_groups}: must divide heads={heads} (and not with head_major)")
    group = heads // head_groups
    if head_groups > 1:
        shape = (head_groups, batch, seq, group, head_dim)
    else:
        shape = (batch, heads, seq, head_dim) if head_major else (batch, seq, heads, head_dim)
    q_out = torch.empty(shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(shape, dtype=k.dtype, device=k.device)
    if batch * seq == 0:
        return q_out, k_out
    # (batch, token, head-in-group, group) strides of the output, whichever layout.
    if head_groups > 1:
        o_strides = (q_out.stride(1), q_out.stride(2), q_out.stride(3), q_out.stride(0))
    elif head_major:
        o_strides = (q_out.stride(0), q_out.stride(2), q_out.stride(1), 0)
    else:
        o_strides = (*q_out.stride()[:3], 0)
    _, height, width = grid
    _qk_norm_rope_kernel[(batch * seq, 2)](
        q,
        k,
        q_out,
        k_out,
        weight_q,
        weight_k,
        cos,
        sin,
        seq,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        *o_strides,
        group,
        offset,
        height,
        width,
        eps,
        HALF=head_dim // 2,
        N_T=n_t,
        N_H=n_h,
        N_PAIRS=n_pairs,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return q_out, k_out


def rope_from_diffusers(freqs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' per-token (cos, sin), each [1, L, 1, head_dim] pair-repeated -> tables [L, head_dim//2].

    Feed them with ``grid=(L, 1, 1)`` and ``split=(head_dim // 2, 0, 0)``: every pair then reads
    the row of its token's index, i.e. a per-token table.
    """
    cos, sin = freqs
    return cos[0, :, 0, 0::2].float().contiguous(), sin[0, :, 0, 0::2].float().contiguous()
