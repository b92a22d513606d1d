"""The DiT's plain-torch reference ops: ``out_dtype`` (an fp32 residual stream feeding bf16 linears)."""

from __future__ import annotations

import pytest
import torch

from pan2render.models.dit_ops import (
    gated_residual,
    layer_norm,
    modulated_norm,
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
