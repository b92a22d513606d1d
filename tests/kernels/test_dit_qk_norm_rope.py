"""Fused Q/K RMSNorm + 3-D RoPE kernel vs its plain-torch reference, and the reference vs diffusers.

On CPU the kernel runs under TRITON_INTERPRET=1 (set by tests/conftest.py). Errors are reported as
max |a - b| and max |a - b| / max |b|; the printed figures are the ones asserted.
"""

from __future__ import annotations

import pytest
import torch

from pan2render.kernels.dit_qk_norm_rope import (
    qk_norm_rope,
    qk_norm_rope_reference,
    rope_from_diffusers,
    rope_split,
    rope_tables,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 outputs: kernel and reference both compute in fp32 and round once; reduction order may flip
# a rounding: one bf16 ulp, up to 2^-7 of the largest value. fp32: summation order only.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _report(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.float() - want.float()).abs()
    rel = float(diff.max() / want.float().abs().max())
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    print(f"{name}: max abs {float(diff.max()):.3g} at {where}, rel {rel:.3g}")
    return rel


def _inputs(batch: int, seq: int, heads: int, head_dim: int, dtype: torch.dtype, *, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dim = heads * head_dim
    q = (torch.randn(batch, seq, dim, generator=g) * 3).to(DEVICE, dtype)
    k = (torch.randn(batch, seq, dim, generator=g) * 0.5).to(DEVICE, dtype)
    wq = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    wk = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    return q, k, wq, wk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "head_dim", "grid"),
    # Odd head counts, a non-power-of-two row, and the DiT's own 24 x 128 (3072 channels).
    [(3, 12, (2, 3, 4)), (5, 20, (3, 2, 5)), (1, 128, (2, 2, 3)), (7, 8, (1, 4, 3)), (24, 128, (1, 2, 2))],
)
def test_kernel_matches_reference(heads: int, head_dim: int, grid: tuple[int, int, int], dtype: torch.dtype) -> None:
    seq = grid[0] * grid[1] * grid[2]
    q, k, wq, wk = _inputs(2, seq, heads, head_dim, dtype)
    cos, sin = rope_tables(head_dim=head_dim, max_len=16, device=DEVICE)
    kw = dict(weight_q=wq, weight_k=wk, heads=heads, cos=cos, sin=sin, grid=grid, eps=1e-6)
    got_q, got_k = qk_norm_rope(q, k, **kw)
    want_q, want_k = qk_norm_rope_reference(q, k, **kw)
    assert got_q.shape == (2, seq, heads, head_dim) and got_q.dtype == dtype
    assert _report(f"q {heads}x{head_dim} {dtype}", got_q, want_q) < TOL[dtype]
    assert _report(f"k {heads}x{head_dim} {dtype}", got_k, want_k) < TOL[dtype]


def test_sequence_shard_with_offset_equals_rows_of_full_sequence() -> None:
    """A shard [offset, offset+n) with strided rows (chunks of a fused QKV) gives the full run's rows."""
    heads, head_dim, grid = 3, 12, (3, 4, 5)
    seq = 60
    q, k, wq, wk = _inputs(2, seq, heads, head_dim, torch.float32, seed=3)
    cos, sin = rope_tables(head_dim=head_dim, max_len=8, device=DEVICE)
    kw = dict(weight_q=wq, weight_k=wk, heads=heads, cos=cos, sin=sin, grid=grid)
    full_q, full_k = qk_norm_rope_reference(q, k, **kw)
    offset, n = 17, 23
    qkv = torch.cat([q, k, q], dim=-1)[:, offset : offset + n]  # strided rows: stride(1) = 3 * dim
    q_shard, k_shard = qkv[..., : heads * head_dim], qkv[..., heads * head_dim : 2 * heads * head_dim]
    got_q, got_k = qk_norm_rope(q_shard, k_shard, offset=offset, **kw)
    assert _report("shard q", got_q, full_q[:, offset : offset + n]) < 1e-5
    assert _report("shard k", got_k, full_k[:, offset : offset + n]) < 1e-5


def test_per_token_tables_equal_grid_tables() -> None:
    """The per-token layout (the model's [L, head_dim//2] tables) equals the grid layout."""
    heads, head_dim, grid = 2, 20, (2, 3, 4)
    q, k, wq, wk = _inputs(1, 24, heads, head_dim, torch.float32, seed=5)
    cos, sin = rope_tables(head_dim=head_dim, max_len=8, device=DEVICE)
    base = dict(weight_q=wq, weight_k=wk, heads=heads)
    want_q, _ = qk_norm_rope_reference(q, k, cos=cos, sin=sin, grid=grid, **base)
    # Per-token table: row l holds token l's angles for every pair.
    from pan2render.kernels.dit_qk_norm_rope import token_positions

    pos = token_positions(grid=grid, offset=0, length=24, device=DEVICE)
    n_t, n_h, _ = rope_split(head_dim)
    axis = torch.tensor([0] * n_t + [1] * n_h + [2] * (head_dim // 2 - n_t - n_h), device=DEVICE)
    cols = torch.arange(head_dim // 2, device=DEVICE)
    tok_cos, tok_sin = cos[pos[:, axis], cols], sin[pos[:, axis], cols]
    got_q, _ = qk_norm_rope(q, k, cos=tok_cos, sin=tok_sin, grid=(24, 1, 1), split=(head_dim // 2, 0, 0), **base)
    assert _report("per-token tables", got_q, want_q) < 1e-5


def test_reference_matches_diffusers_math() -> None:
    """Our reference equals diffusers' WanAttnProcessor norm + apply_rotary_emb (fp32, CPU)."""
    diffusers_wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    heads, head_dim, grid = 3, 20, (2, 3, 4)
    q, k, wq, wk = (t.cpu() for t in _inputs(2, 24, heads, head_dim, torch.float32, seed=7))
    rope = diffusers_wan.WanRotaryPosEmbed(head_dim, (1, 2, 2), 32)
    freqs = rope(torch.zeros(1, 1, grid[0], grid[1] * 2, grid[2] * 2))  # ([1, L, 1, D], [1, L, 1, D])
    norm = torch.nn.RMSNorm(heads * head_dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(wq)
        x = norm(q).unflatten(2, (heads, -1))
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs[0][..., 0::2], freqs[1][..., 1::2]
    want = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    tables = rope_tables(head_dim=head_dim, max_len=32)
    got, _ = qk_norm_rope_reference(q, k, weight_q=wq, weight_k=wk, heads=heads, cos=tables[0], sin=tables[1], grid=grid)
    assert _report("reference vs diffusers", got, want) < 1e-5
    tok_cos, tok_sin = rope_from_diffusers(freqs)
    got_tok, _ = qk_norm_rope_reference(
        q, k, weight_q=wq, weight_k=wk, heads=heads, cos=tok_cos, sin=tok_sin, grid=(24, 1, 1), split=(10, 0, 0)
    )
    assert _report("per-token diffusers tables", got_tok, want) < 1e-5


def test_rejects_shard_outside_grid() -> None:
    q, k, wq, wk = _inputs(1, 10, 2, 12, torch.float32)
    cos, sin = rope_tables(head_dim=12, max_len=8, device=DEVICE)
    with pytest.raises(ValueError, match="outside the grid"):
        qk_norm_rope(q, k, weight_q=wq, weight_k=wk, heads=2, cos=cos, sin=sin, grid=(2, 2, 4), offset=7)


def test_split_is_44_42_42_for_head_dim_128() -> None:
    assert tuple(2 * n for n in rope_split(128)) == (44, 42, 42)


def test_head_major_output_is_the_same_values() -> None:
    """head_major writes [B, heads, L, head_dim] contiguous, equal to the token-major result transposed."""
    heads, head_dim, grid = 5, 20, (2, 3, 4)
    q, k, wq, wk = _inputs(2, 24, heads, head_dim, torch.bfloat16, seed=9)
    cos, sin = rope_tables(head_dim=head_dim, max_len=8, device=DEVICE)
    kw = dict(weight_q=wq, weight_k=wk, heads=heads, cos=cos, sin=sin, grid=grid)
    tq, tk = qk_norm_rope(q, k, **kw)
    hq, hk = qk_norm_rope(q, k, head_major=True, **kw)
    assert hq.shape == (2, heads, 24, head_dim) and hq.is_contiguous()
    assert torch.equal(hq, tq.transpose(1, 2)) and torch.equal(hk, tk.transpose(1, 2))


@pytest.mark.parametrize("groups", [2, 3, 6])
def test_head_groups_output_is_the_all_to_all_send_layout(groups: int) -> None:
    """head_groups=G writes [G, B, L, heads/G, head_dim] contiguous: group g holds heads
    [g*heads/G, (g+1)*heads/G) of every token, equal to slicing the token-major result."""
    heads, head_dim, grid = 6, 12, (2, 3, 4)
    q, k, wq, wk = _inputs(2, 24, heads, head_dim, torch.float32, seed=4)
    cos, sin = rope_tables(head_dim=head_dim, max_len=8, device=DEVICE)
    kw = dict(weight_q=wq, weight_k=wk, heads=heads, cos=cos, sin=sin, grid=grid)
    tq, tk = qk_norm_rope(q, k, **kw)  # [B, L, H, D]
    gq, gk = qk_norm_rope(q, k, head_groups=groups, **kw)
    assert gq.shape == (groups, 2, 24, heads // groups, head_dim) and gq.is_contiguous()
    want_q = tq.unflatten(2, (groups, heads // groups)).permute(2, 0, 1, 3, 4)
    want_k = tk.unflatten(2, (groups, heads // groups)).permute(2, 0, 1, 3, 4)
    assert torch.equal(gq, want_q) and torch.equal(gk, want_k)
    with pytest.raises(ValueError, match="head_groups=4"):
        qk_norm_rope(q, k, head_groups=4, **kw)
