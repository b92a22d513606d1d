"""The fused Q/K RMSNorm + RoPE kernel against its one reference, ``pan2render.models.dit_ops.qk_norm_rope``
(the function the model runs): same arguments, in the dtypes the model hands them (bf16 or fp32
projections and norm weights, fp32 per-token RoPE tables from the model's ``RotaryPosEmbed``), same
result, dtype and memory layout.

On CPU the kernel runs under TRITON_INTERPRET=1 (set by tests/conftest.py). Errors are reported as
max |a - b| and max |a - b| / max |b|; the printed figures are the ones asserted.
"""

from __future__ import annotations

import pytest
import torch

from pan2render.kernels import dit_qk_norm_rope as fused
from pan2render.models import dit_ops as ref
from pan2render.models.dit import PAN2DiTConfig, RotaryPosEmbed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# fp32: summation order only. bf16: the kernel rounds once from fp32 math; the reference stores the
# normed q / k in bf16 before rotating them (torch's RMSNorm keeps the input dtype; diffusers does
# the same), and the Triton interpreter truncates instead of rounding: apart by up to two bf16 ulps,
# 2^-7 of the largest value each.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _report(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.float() - want.float()).abs()
    rel = float(diff.max() / want.float().abs().max())
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    print(f"{name}: max abs {float(diff.max()):.3g} at {where}, rel {rel:.3g}")
    return rel


def _rope(head_dim: int, grid: tuple[int, int, int], **slice_: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (cos, sin) [L, head_dim // 2] fp32, as the model makes them."""
    split = PAN2DiTConfig(attention_head_dim=head_dim).rope_split
    return RotaryPosEmbed(split=split, max_seq_len=64)(grid, device=DEVICE, **slice_)


def _kwargs(batch: int, grid: tuple[int, int, int], heads: int, head_dim: int, dtype: torch.dtype, *, seed: int = 0):
    """(q, k, the remaining keyword arguments) as SelfAttention passes them."""
    g = torch.Generator().manual_seed(seed)
    seq, dim = grid[0] * grid[1] * grid[2], heads * head_dim
    q = (torch.randn(batch, seq, dim, generator=g) * 3).to(DEVICE, dtype)
    k = (torch.randn(batch, seq, dim, generator=g) * 0.5).to(DEVICE, dtype)
    wq = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    wk = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    cos, sin = _rope(head_dim, grid)
    return q, k, dict(norm_q_weight=wq, norm_k_weight=wk, freqs_cos=cos, freqs_sin=sin, num_heads=heads, eps=EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "head_dim", "grid"),
    # Odd head counts, a non-power-of-two row, and the DiT's own 24 x 128 (3072 channels).
    [(3, 12, (2, 3, 4)), (5, 20, (3, 2, 5)), (1, 128, (2, 2, 3)), (7, 8, (1, 4, 3)), (24, 128, (1, 2, 2))],
)
def test_kernel_matches_reference(heads: int, head_dim: int, grid: tuple[int, int, int], dtype: torch.dtype) -> None:
    q, k, kw = _kwargs(2, grid, heads, head_dim, dtype)
    got_q, got_k = fused.qk_norm_rope(q, k, **kw)
    want_q, want_k = ref.qk_norm_rope(q, k, **kw)
    for name, got, want in (("q", got_q, want_q), ("k", got_k, want_k)):
        # Same layout: [B, H, L, D] views of [B, L, H, D] memory (what the attention and the output
        # projection's flatten expect).
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        assert _report(f"{name} {heads}x{head_dim} {dtype}", got, want) < TOL[dtype]


def test_sequence_shard_equals_rows_of_full_sequence() -> None:
    """A shard [offset, offset+n) with its own RoPE rows and strided q / k rows (chunks of a fused
    QKV projection) gives the full run's rows."""
    heads, head_dim, grid = 3, 12, (3, 4, 5)
    q, k, kw = _kwargs(2, grid, heads, head_dim, torch.float32, seed=3)
    full_q, full_k = ref.qk_norm_rope(q, k, **kw)  # [B, H, L, D]
    offset, n = 17, 23
    dim = heads * head_dim
    qkv = torch.cat([q, k, q], dim=-1)[:, offset : offset + n]  # strided rows: stride(1) = 3 * dim
    cos, sin = _rope(head_dim, grid, start=offset, length=n)
    got_q, got_k = fused.qk_norm_rope(qkv[..., :dim], qkv[..., dim : 2 * dim],
                                      **{**kw, "freqs_cos": cos, "freqs_sin": sin})
    assert _report("shard q", got_q, full_q[:, :, offset : offset + n]) < 1e-5
    assert _report("shard k", got_k, full_k[:, :, offset : offset + n]) < 1e-5


@pytest.mark.parametrize("groups", [2, 3, 6])
def test_head_groups_output_is_the_all_to_all_send_layout(groups: int) -> None:
    """head_groups=G writes [G, B, L, heads/G, head_dim] contiguous: group g holds heads
    [g*heads/G, (g+1)*heads/G) of every token, as the reference lays them out."""
    heads, head_dim, grid = 6, 12, (2, 3, 4)
    q, k, kw = _kwargs(2, grid, heads, head_dim, torch.float32, seed=4)
    gq, gk = fused.qk_norm_rope(q, k, head_groups=groups, **kw)
    wq, wk = ref.qk_norm_rope(q, k, head_groups=groups, **kw)
    assert gq.shape == (groups, 2, 24, heads // groups, head_dim) and gq.is_contiguous() and gk.is_contiguous()
    assert _report(f"grouped q G={groups}", gq, wq) < 1e-5 and _report(f"grouped k G={groups}", gk, wk) < 1e-5
    tq, _ = fused.qk_norm_rope(q, k, **kw)  # [B, H, L, D]
    assert torch.equal(gq, tq.transpose(1, 2).unflatten(2, (groups, heads // groups)).permute(2, 0, 1, 3, 4))
    with pytest.raises(ValueError, match="head_groups=4"):
        fused.qk_norm_rope(q, k, head_groups=4, **kw)


def test_rejects_tables_of_another_length() -> None:
    q, k, kw = _kwargs(1, (2, 2, 3), 2, 12, torch.float32)
    cos, sin = _rope(12, (2, 2, 4))  # 16 rows for 12 tokens
    with pytest.raises(ValueError, match=r"freqs_cos has shape \(16, 6\); expected one row per token"):
        fused.qk_norm_rope(q, k, **{**kw, "freqs_cos": cos, "freqs_sin": sin})
