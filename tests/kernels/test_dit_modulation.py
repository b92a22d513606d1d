"""Fused LayerNorm + modulation and residual (+ gate) + norm kernels vs their plain-torch references,
and the references vs diffusers' WanTransformerBlock math with a per-token [B, L, 6, D] table.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py). Figures printed are asserted.
"""

from __future__ import annotations

import pytest
import torch

from pan2render.kernels.dit_modulation import (
    layernorm_modulate,
    layernorm_modulate_reference,
    residual_layernorm_modulate,
    residual_layernorm_modulate_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 outputs: both sides compute in fp32 and round once; a flipped rounding is one bf16 ulp, up to
# 2^-7 of the largest value. fp32: summation order only.
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


def _rel(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.float() - want.float()).abs()
    rel = float(diff.max() / want.float().abs().max())
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    print(f"{name}: max abs {float(diff.max()):.3g} at {where}, rel {rel:.3g}")
    return rel


def _setup(batch: int, seq: int, dim: int, distinct: int, dtype: torch.dtype, *, per_token: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, seq, dim, generator=g) * 2 + 0.5).to(DEVICE, dtype)
    y = torch.randn(batch, seq, dim, generator=g).to(DEVICE, dtype)
    table = (0.3 * torch.randn(distinct, 6, dim, generator=g)).to(DEVICE)  # [U, 6, D] fp32
    shift, scale, gate, c_shift, c_scale, c_gate = table.unbind(1)  # [U, D] each, row stride 6*D
    if per_token:
        index = torch.randint(0, distinct, (batch, seq), generator=g).to(DEVICE)
    else:
        index = torch.randint(0, distinct, (batch,), generator=g).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE)
    bias = (0.1 * torch.randn(dim, generator=g)).to(DEVICE)
    return x, y, table, (shift, scale, gate, c_shift, c_scale, c_gate), index, weight, bias


# (batch, tokens, dim, distinct timesteps, per-token index): odd dims, and the DiT's 3072.
CASES = [(2, 7, 48, 2, True), (1, 5, 40, 3, True), (3, 4, 24, 2, False), (2, 3, 100, 1, False), (1, 3, 3072, 2, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "seq", "dim", "distinct", "per_token"), CASES)
def test_layernorm_modulate(batch: int, seq: int, dim: int, distinct: int, per_token: bool, dtype: torch.dtype) -> None:
    x, _, _, rows, index, weight, bias = _setup(batch, seq, dim, distinct, dtype, per_token=per_token)
    shift, scale = rows[0], rows[1]
    got = layernorm_modulate(x, shift=shift, scale=scale, index=index)
    want = layernorm_modulate_reference(x, shift=shift, scale=scale, index=index)
    assert got.dtype == dtype and got.shape == x.shape
    assert _rel(f"norm+mod {dim} {dtype}", got, want) < TOL[dtype]
    got = layernorm_modulate(x, weight=weight, bias=bias)
    want = layernorm_modulate_reference(x, weight=weight, bias=bias)
    assert _rel(f"affine norm {dim} {dtype}", got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "seq", "dim", "distinct", "per_token"), CASES)
def test_residual_gate_norm_modulate(
    batch: int, seq: int, dim: int, distinct: int, per_token: bool, dtype: torch.dtype
) -> None:
    x, y, _, rows, index, weight, bias = _setup(batch, seq, dim, distinct, dtype, per_token=per_token, seed=1)
    _, _, gate, c_shift, c_scale, c_gate = rows
    # Gated residual -> affine norm (self-attention -> cross-attention input).
    kw = dict(gate=gate, index=index, weight=weight, bias=bias)
    (gx, gn), (wx, wn) = residual_layernorm_modulate(x, y, **kw), residual_layernorm_modulate_reference(x, y, **kw)
    assert _rel(f"residual+gate {dtype}", gx, wx) < TOL[dtype]
    assert _rel(f"-> affine norm {dtype}", gn, wn) < TOL[dtype]
    # Plain residual -> modulated norm (cross-attention -> FFN input).
    kw = dict(index=index, shift=c_shift, scale=c_scale)
    (gx, gn), (wx, wn) = residual_layernorm_modulate(x, y, **kw), residual_layernorm_modulate_reference(x, y, **kw)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(gx, wx), "a plain residual add rounds once on both sides"
    else:  # the Triton interpreter truncates fp32 -> bf16 (no rounding mode in its cast), the GPU rounds
        assert _rel(f"plain residual {dtype}", gx, wx) < TOL[dtype]
    assert _rel(f"-> modulated norm {dtype}", gn, wn) < TOL[dtype]
    # Gated residual alone (the block's last step).
    gx, none = residual_layernorm_modulate(x, y, gate=c_gate, index=index, norm=False)
    wx, _ = residual_layernorm_modulate_reference(x, y, gate=c_gate, index=index, norm=False)
    assert none is None
    assert _rel(f"gated residual only {dtype}", gx, wx) < TOL[dtype]


def test_per_token_timesteps_match_diffusers_per_token_table() -> None:
    """Index-gathered rows == diffusers' ti2v path with a full [B, L, 6, D] temb (first frame at t=0)."""
    batch, frames, per_frame, dim = 2, 3, 4, 32
    seq = frames * per_frame
    g = torch.Generator().manual_seed(4)
    x = torch.randn(batch, seq, dim, generator=g).to(DEVICE)
    y = torch.randn(batch, seq, dim, generator=g).to(DEVICE)
    sst = (torch.randn(1, 6, dim, generator=g) / dim**0.5).to(DEVICE)  # block.scale_shift_table
    proj = torch.randn(2, 6, dim, generator=g).to(DEVICE)  # time projection of the distinct t: {0, t}
    index = torch.ones(batch, seq, dtype=torch.long, device=DEVICE)
    index[:, :per_frame] = 0  # first latent frame is the clean image
    # diffusers: temb [B, L, 6, D] per token, (table + temb).chunk(6, dim=2).
    temb = proj[index]  # [B, L, 6, D]
    mods = (sst.unsqueeze(0) + temb.float()).chunk(6, dim=2)
    shift_msa, scale_msa, gate_msa = (m.squeeze(2) for m in mods[:3])
    ln = torch.nn.functional.layer_norm
    want_n = ln(x.float(), (dim,), eps=1e-6) * (1 + scale_msa) + shift_msa
    want_h = x.float() + y * gate_msa
    # Ours: [U, 6, D] rows + index.
    table = sst + proj  # [U, 6, D]
    shift, scale, gate = table[:, 0], table[:, 1], table[:, 2]
    got_n = layernorm_modulate(x, shift=shift, scale=scale, index=index)
    got_h, _ = residual_layernorm_modulate(x, y, gate=gate, index=index, norm=False)
    assert _rel("per-token norm+mod vs diffusers", got_n, want_n) < 2e-5
    assert _rel("per-token gate vs diffusers", got_h, want_h) < 2e-5


def test_errors_name_the_problem() -> None:
    x, y, _, rows, index, *_ = _setup(2, 3, 16, 2, torch.float32, per_token=True)
    with pytest.raises(ValueError, match="index shape"):
        layernorm_modulate(x, shift=rows[0], scale=rows[1], index=index[:, :2])
    with pytest.raises(ValueError, match="both shift and scale"):
        layernorm_modulate(x, shift=rows[0], index=index)
    with pytest.raises(ValueError, match="contiguous last dim"):
        residual_layernorm_modulate(x, y.transpose(1, 2).contiguous().transpose(1, 2), index=index)
