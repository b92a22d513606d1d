"""The fused LayerNorm + modulation kernel, as the four DiT ops it replaces, against their one
reference: the ``pan2render.models.dit_ops`` functions the model runs. Kernel and reference get the
same arguments, in the dtypes the model hands them; plus the per-token rows vs diffusers'
WanTransformerBlock math with a per-token [B, L, 6, D] table.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py). Figures printed are asserted.
"""

from __future__ import annotations

import pytest
import torch

from pan2render.kernels import dit_modulation as fused
from pan2render.models import dit_ops as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (residual stream x, linear output y, the norms' out_dtype) as the model runs them: the fp32 model
# (CPU), bf16 with diffusers' numerics (dit_fp32_residual=False), bf16 with the fp32 residual
# stream (dit_fp32_residual=True, the pipeline's default). Modulation rows and the cross-attention
# norm's weight / bias are fp32 in every case (the loader keeps them so).
DTYPES = {
    "fp32": (torch.float32, torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp32_residual": (torch.float32, torch.bfloat16, torch.bfloat16),
}
# bf16 outputs: both sides compute in fp32 and round once; a flipped rounding is one bf16 ulp, up to
# 2^-7 of the largest value (the Triton interpreter truncates instead of rounding: one ulp too).
# fp32: summation order only.
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
EPS = 1e-6


def _rel(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{name}: {got.dtype} {got.shape} vs {want.dtype} {want.shape}"
    diff = (got.float() - want.float()).abs()
    rel = float(diff.max() / want.float().abs().max())
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    print(f"{name}: max abs {float(diff.max()):.3g} at {where}, rel {rel:.3g}")
    return rel


def _setup(batch: int, seq: int, dim: int, distinct: int, dtypes: str, *, per_token: bool, seed: int = 0):
    x_dtype, y_dtype, out_dtype = DTYPES[dtypes]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, seq, dim, generator=g) * 2 + 0.5).to(DEVICE, x_dtype)
    y = torch.randn(batch, seq, dim, generator=g).to(DEVICE, y_dtype)
    table = (0.3 * torch.randn(distinct, 6, dim, generator=g)).to(DEVICE)  # [U, 6, D] fp32
    rows = table.unbind(1)  # shift, scale, gate, c_shift, c_scale, c_gate: [U, D] each, row stride 6*D
    if per_token:
        index = torch.randint(0, distinct, (batch, seq), generator=g).to(DEVICE)
    else:
        index = torch.randint(0, distinct, (batch,), generator=g).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE)
    bias = (0.1 * torch.randn(dim, generator=g)).to(DEVICE)
    return x, y, rows, index, weight, bias, out_dtype


# (batch, tokens, dim, distinct timesteps, per-token index): odd dims, and the DiT's 3072.
CASES = [(2, 7, 48, 2, True), (1, 5, 40, 3, True), (3, 4, 24, 2, False), (2, 3, 100, 1, False), (1, 3, 3072, 2, True)]


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize(("batch", "seq", "dim", "distinct", "per_token"), CASES)
def test_modulated_norm(batch: int, seq: int, dim: int, distinct: int, per_token: bool, dtypes: str) -> None:
    x, _, rows, index, _, _, out_dtype = _setup(batch, seq, dim, distinct, dtypes, per_token=per_token)
    kw = dict(shift=rows[0], scale=rows[1], index=index, eps=EPS, out_dtype=out_dtype)
    got, want = fused.modulated_norm(x, **kw), ref.modulated_norm(x, **kw)
    assert _rel(f"norm+mod {dim} {dtypes}", got, want) < TOL[out_dtype]
    # out_dtype left out: x's dtype, as the reference.
    kw.pop("out_dtype")
    got, want = fused.modulated_norm(x, **kw), ref.modulated_norm(x, **kw)
    assert got.dtype == x.dtype and _rel(f"norm+mod {dim} {dtypes}, default dtype", got, want) < TOL[x.dtype]


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize(("batch", "seq", "dim", "distinct", "per_token"), CASES)
def test_residual_ops(batch: int, seq: int, dim: int, distinct: int, per_token: bool, dtypes: str) -> None:
    x, y, rows, index, weight, bias, out_dtype = _setup(batch, seq, dim, distinct, dtypes, per_token=per_token, seed=1)
    _, _, gate, c_shift, c_scale, c_gate = rows
    stream_tol = TOL[x.dtype]
    # Gated residual -> affine norm (self-attention -> cross-attention input).
    kw = dict(gate=gate, index=index, weight=weight, bias=bias, eps=EPS, out_dtype=out_dtype)
    (gx, gn), (wx, wn) = fused.residual_layer_norm(x, y, **kw), ref.residual_layer_norm(x, y, **kw)
    assert _rel(f"residual+gate {dtypes}", gx, wx) < stream_tol
    assert _rel(f"-> affine norm {dtypes}", gn, wn) < TOL[out_dtype]
    # Plain residual -> modulated norm (cross-attention -> FFN input).
    kw = dict(gate=None, index=index, shift=c_shift, scale=c_scale, eps=EPS, out_dtype=out_dtype)
    (gx, gn), (wx, wn) = fused.residual_modulated_norm(x, y, **kw), ref.residual_modulated_norm(x, y, **kw)
    if DEVICE == "cuda" or x.dtype == torch.float32:
        assert torch.equal(gx, wx), "a plain residual add rounds once on both sides"
    else:  # the Triton interpreter truncates fp32 -> bf16 (no rounding mode in its cast), the GPU rounds
        assert _rel(f"plain residual {dtypes}", gx, wx) < stream_tol
    assert _rel(f"-> modulated norm {dtypes}", gn, wn) < TOL[out_dtype]
    # Gated residual alone (the block's last step).
    kw = dict(gate=c_gate, index=index)
    got, want = fused.gated_residual(x, y, **kw), ref.gated_residual(x, y, **kw)
    assert _rel(f"gated residual {dtypes}", got, want) < stream_tol


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
    want_n = ln(x.float(), (dim,), eps=EPS) * (1 + scale_msa) + shift_msa
    want_h = x.float() + y * gate_msa
    # Ours: [U, 6, D] rows + index.
    table = sst + proj  # [U, 6, D]
    shift, scale, gate = table[:, 0], table[:, 1], table[:, 2]
    got_n = fused.modulated_norm(x, shift=shift, scale=scale, index=index, eps=EPS)
    got_h = fused.gated_residual(x, y, gate=gate, index=index)
    assert _rel("per-token norm+mod vs diffusers", got_n, want_n) < 2e-5
    assert _rel("per-token gate vs diffusers", got_h, want_h) < 2e-5


def test_errors_name_the_problem() -> None:
    x, y, rows, index, weight, bias, _ = _setup(2, 3, 16, 2, "fp32", per_token=True)
    with pytest.raises(ValueError, match="index shape"):
        fused.modulated_norm(x, shift=rows[0], scale=rows[1], index=index[:, :2], eps=EPS)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused.gated_residual(x, y.transpose(1, 2).contiguous().transpose(1, 2), gate=None, index=index)
    with pytest.raises(ValueError, match="both weight and bias"):
        fused.residual_layer_norm(x, y, gate=None, index=index, weight=weight, bias=None, eps=EPS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="identity norm"):
        fused.residual_layer_norm(x, y, gate=None, index=index, weight=None, bias=None, eps=EPS)  # type: ignore[arg-type]
