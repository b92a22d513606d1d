"""The DiT's plain-torch ops, the references of the fused kernels (tests/kernels/test_dit_*.py):
``out_dtype`` (an fp32 residual stream feeding bf16 linears) and the Q/K prologue vs diffusers."""

from __future__ import annotations

import pytest
import torch

from pan2render.models.dit_ops import (
    gated_residual,
    layer_norm,
    modulated_norm,
    qk_norm_rope,
    residual_layer_norm,
    residual_modulated_norm,
)

DIM = 24


def _inputs(seed: int = 0):
    """x fp32 [2, 5, DIM] (the residual stream), y bf16 (a linear's output), rows fp32 [3, DIM],
    per-token index [2, 5]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, DIM, generator=g) * 3 + 0.5
    y = torch.randn(2, 5, DIM, generator=g).bfloat16()
    shift, scale, gate = (0.2 * torch.randn(3, DIM, generator=g) for _ in range(3))
    weight = 1 + 0.1 * torch.randn(DIM, generator=g)
    bias = 0.1 * torch.randn(DIM, generator=g)
    index = torch.randint(0, 3, (2, 5), generator=g)
    return x, y, dict(shift=shift, scale=scale, gate=gate, weight=weight, bias=bias, index=index)


def test_norms_return_out_dtype_rounded_once_from_fp32() -> None:
    x, _, p = _inputs()
    mod = dict(shift=p["shift"], scale=p["scale"], index=p["index"], eps=1e-6)
    got = modulated_norm(x, **mod, out_dtype=torch.bfloat16)
    want = modulated_norm(x, **mod)  # fp32 math, fp32 out
    assert want.dtype == torch.float32 and got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())

    got = layer_norm(x, weight=p["weight"], bias=p["bias"], eps=1e-6, out_dtype=torch.bfloat16)
    want = layer_norm(x, weight=p["weight"], bias=p["bias"], eps=1e-6)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
    # cross_attn_norm=False: identity, still in the linear's dtype.
    got = layer_norm(x, weight=None, bias=None, eps=1e-6, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, x.bfloat16())
    # Default: x's dtype (diffusers' numerics).
    assert modulated_norm(x.bfloat16(), **mod).dtype == torch.bfloat16
    assert layer_norm(x.bfloat16(), weight=None, bias=None, eps=1e-6).dtype == torch.bfloat16


@pytest.mark.parametrize("gated", [True, False])
def test_residual_ops_keep_the_fp32_stream_and_round_only_the_norm(gated: bool) -> None:
    x, y, p = _inputs(seed=1)
    gate = p["gate"] if gated else None
    stream = x + y.float() * (p["gate"][p["index"]] if gated else 1.0)  # fp32, never rounded
    assert torch.equal(gated_residual(x, y, gate=gate, index=p["index"]), stream)

    x_new, normed = residual_modulated_norm(
        x, y, gate=gate, index=p["index"], shift=p["shift"], scale=p["scale"], eps=1e-6, out_dtype=torch.bfloat16
    )
    assert x_new.dtype == torch.float32 and torch.equal(x_new, stream)
    want = modulated_norm(stream, shift=p["shift"], scale=p["scale"], index=p["index"], eps=1e-6)
    assert normed.dtype == torch.bfloat16 and torch.equal(normed, want.bfloat16())

    x_new, normed = residual_layer_norm(
        x, y, gate=gate, index=p["index"], weight=p["weight"], bias=p["bias"], eps=1e-6, out_dtype=torch.bfloat16
    )
    assert x_new.dtype == torch.float32 and torch.equal(x_new, stream)
    want = layer_norm(stream, weight=p["weight"], bias=p["bias"], eps=1e-6)
    assert normed.dtype == torch.bfloat16 and torch.equal(normed, want.bfloat16())


def test_qk_norm_rope_matches_diffusers_attention_processor() -> None:
    """The Q/K prologue (the fused kernel's reference) equals diffusers' WanAttnProcessor: RMSNorm
    across heads, then its apply_rotary_emb with WanRotaryPosEmbed's tables (fp32, CPU)."""
    diffusers_wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    from pan2render.models.dit import PAN2DiTConfig, RotaryPosEmbed

    heads, head_dim, grid = 3, 20, (2, 3, 4)
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(2, 24, heads * head_dim, generator=g) * s for s in (3.0, 0.5))
    wq, wk = (1 + 0.1 * torch.randn(heads * head_dim, generator=g) for _ in range(2))
    rope = diffusers_wan.WanRotaryPosEmbed(head_dim, (1, 2, 2), 32)
    freqs = rope(torch.zeros(1, 1, grid[0], grid[1] * 2, grid[2] * 2))  # ([1, L, 1, D], [1, L, 1, D])

    def diffusers_side(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        norm = torch.nn.RMSNorm(heads * head_dim, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(weight)
            x = norm(x).unflatten(2, (heads, -1))  # [B, L, H, D]
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        cos, sin = freqs[0][..., 0::2], freqs[1][..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).transpose(1, 2)

    cos, sin = RotaryPosEmbed(split=PAN2DiTConfig(attention_head_dim=head_dim).rope_split, max_seq_len=32)(grid)
    got_q, got_k = qk_norm_rope(q, k, norm_q_weight=wq, norm_k_weight=wk, freqs_cos=cos, freqs_sin=sin,
                                num_heads=heads, eps=1e-6)
    for got, want in ((got_q, diffusers_side(q, wq)), (got_k, diffusers_side(k, wk))):
        rel = float((got - want).abs().max() / want.abs().max())
        print(f"qk_norm_rope vs diffusers: rel {rel:.3g}")
        assert got.shape == (2, heads, 24, head_dim) and rel < 1e-5
