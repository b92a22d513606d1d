"""The fast VAE decoder's Triton kernels against their plain-torch references.

On CPU the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py) at tiny, odd sizes.
Tolerances: fp32 1e-5 relative to the largest value; bf16 one bf16 ulp (2^-8) of it, as the
kernel and the reference round the same fp32 value once and may land on neighbouring bf16s.
"""

from __future__ import annotations

import pytest
import torch

from pan2render.kernels import vae_ops

pytestmark = pytest.mark.skipif(vae_ops.triton is None, reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}


def _report(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    err = (got.float() - want.float()).abs()
    scale = want.float().abs().max().clamp_min(1e-6)
    rel = (err.max() / scale).item()
    at = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    print(f"{name}: max rel err {rel:.3g} at {at} (got {got.flatten()[err.argmax()].item():.6g}, "
          f"want {want.flatten()[err.argmax()].item():.6g})")
    return rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 48), (5, 3, 160), (2, 3, 7, 96), (1, 1)])
@pytest.mark.parametrize("silu,with_bias", [(True, True), (True, False), (False, False)])
def test_rms_norm_act_matches_reference(shape, dtype, silu, with_bias) -> None:
    g = torch.Generator().manual_seed(hash((shape, silu, with_bias)) % 1000)
    c = shape[-1]
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)
    gamma = (torch.rand(c, generator=g) + 0.5).to(DEVICE)
    bias = torch.randn(c, generator=g).to(DEVICE) if with_bias else None
    got = vae_ops.rms_norm_act(x, gamma, bias=bias, silu=silu)
    want = vae_ops.rms_norm_act_reference(x, gamma, bias=bias, silu=silu)
    assert got.shape == x.shape and got.dtype == dtype
    assert _report(f"rms_norm_act {shape} {dtype} silu={silu} bias={with_bias}", got, want) <= TOL[dtype]


def test_rms_norm_act_writes_into_a_buffer_slice_only() -> None:
    """The decoder points the kernel at frames 2.. of a conv buffer; frames 0-1 must stay."""
    x = torch.randn(3, 4, 5, 24, device=DEVICE)  # [T, H, W, C]
    buf = torch.full((5, 4, 5, 24), 7.0, device=DEVICE)  # [2 + T, H, W, C]
    gamma = torch.rand(24, device=DEVICE) + 0.5
    vae_ops.rms_norm_act(x, gamma, silu=True, out=buf[2:])
    assert torch.equal(buf[:2], torch.full_like(buf[:2], 7.0))
    want = vae_ops.rms_norm_act_reference(x, gamma, silu=True)
    assert _report("rms_norm_act into buf[2:]", buf[2:], want) <= TOL[torch.float32]


def test_rms_norm_act_zero_rows_stay_finite() -> None:
    """F.normalize clamps the norm at eps: an all-zero row gives zeros, not NaN."""
    x = torch.zeros(4, 32, device=DEVICE)
    y = vae_ops.rms_norm_act(x, torch.ones(32, device=DEVICE), silu=True)
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias,with_res", [(True, True), (True, False), (False, True)])
def test_add_bias_residual_matches_reference(dtype, with_bias, with_res) -> None:
    g = torch.Generator().manual_seed(3)
    y = torch.randn(2, 7, 5, 80, generator=g).to(DEVICE, dtype)
    bias = torch.randn(80, generator=g).to(DEVICE) if with_bias else None
    res = torch.randn(2, 7, 5, 80, generator=g).to(DEVICE, dtype) if with_res else None
    want = vae_ops.add_bias_residual_reference(y, bias=bias, residual=res)
    got = vae_ops.add_bias_residual_(y.clone(), bias=bias, residual=res)
    assert _report(f"add_bias_residual_ {dtype} bias={with_bias} res={with_res}", got, want) <= TOL[dtype]


def test_row_kernels_reject_bad_inputs_with_the_limit() -> None:
    with pytest.raises(ValueError, match="channels=5000"):
        vae_ops.rms_norm_act(torch.zeros(2, 5000), torch.ones(5000), silu=True)
    with pytest.raises(ValueError, match="contiguous"):
        vae_ops.rms_norm_act(torch.zeros(8, 6).t(), torch.ones(8), silu=True)
    with pytest.raises(ValueError, match="one per channel"):
        vae_ops.add_bias_residual_(torch.zeros(3, 8), bias=torch.ones(7), residual=None)


def test_phase_weights_equal_nearest_x2_then_3x3_conv() -> None:
    """The 2x2 phase kernels reproduce conv3x3(nearest_x2(X)) exactly up to fp32 rounding."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 3, 7, generator=g, dtype=torch.float64)
    w = torch.randn(6, 5, 3, 3, generator=g, dtype=torch.float64)
    want = F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), w, padding=1)
    o = F.conv2d(x, vae_ops.phase_weights(w).double(), padding=1).permute(0, 2, 3, 1).contiguous()
    zeros_src = torch.zeros(2, 3, 7, 1, dtype=torch.float64)
    index = torch.zeros(1, 2, 2, 6, dtype=torch.int32)
    got = vae_ops.upsample_phase_combine_reference(o, torch.zeros(6, dtype=torch.float64), zeros_src, index, r=1)
    assert _report("phase conv vs nearest+3x3", got.permute(0, 3, 1, 2), want) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r,cin,cout", [(1, 6, 3), (2, 5, 5), (2, 10, 5)])
def test_upsample_phase_combine_matches_reference(dtype, r, cin, cout) -> None:
    g = torch.Generator().manual_seed(7 * r + cin)
    n, h, w = 2 * r, 3, 5  # odd H, W
    o = torch.randn(n, h + 1, w + 1, 4 * cout, generator=g).to(DEVICE, dtype)
    x_in = torch.randn(n // r, h, w, cin, generator=g).to(DEVICE, dtype)
    bias = torch.randn(cout, generator=g).to(DEVICE)
    index = torch.randint(0, cin, (r, 2, 2, cout), generator=g, dtype=torch.int32).to(DEVICE)
    want = vae_ops.upsample_phase_combine_reference(o, bias, x_in, index, r=r)
    got = vae_ops.upsample_phase_combine(o, bias, x_in, index, r=r)
    assert got.shape == (n, 2 * h, 2 * w, cout)
    assert _report(f"upsample_phase_combine r={r} {cin}->{cout} {dtype}", got, want) <= TOL[dtype]


@pytest.mark.parametrize("frames", [1, 2, 3])
def test_rms_norm_act_also_writes_the_history_rows(frames) -> None:
    """hist gets the last 2 frames (hist_start = (T - 2) * HW, negative for T = 1: the one frame
    lands in the history's second slot and the first slot is left alone)."""
    hw, c = 6, 16
    x = torch.randn(frames, hw, c, device=DEVICE)
    gamma = torch.rand(c, device=DEVICE) + 0.5
    hist = torch.full((2, hw, c), 9.0, device=DEVICE)
    y = vae_ops.rms_norm_act(x, gamma, silu=True, hist=hist, hist_start=(frames - 2) * hw)
    want = vae_ops.rms_norm_act_reference(x, gamma, silu=True)
    assert _report(f"norm out T={frames}", y, want) <= TOL[torch.float32]
    if frames == 1:
        assert torch.equal(hist[0], torch.full_like(hist[0], 9.0)) and torch.equal(hist[1], y[0])
    else:
        assert torch.equal(hist, y[-2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu", [True, False])
def test_rms_norm_act_folds_the_resnet_add_and_keeps_the_sum(dtype, silu) -> None:
    """With a residual the kernel writes x + bias + residual (rounded to x's dtype, as the unfused
    add) back into x and normalises that rounded sum: both must equal the two-kernel path."""
    g = torch.Generator().manual_seed(5)
    c = 40
    y = (torch.randn(3, 7, c, generator=g) * 2).to(DEVICE, dtype)
    res = (torch.randn(3, 7, c, generator=g) * 2).to(DEVICE, dtype)
    bias = torch.randn(c, generator=g).to(DEVICE)
    gamma = (torch.rand(c, generator=g) + 0.5).to(DEVICE)
    want_sum = vae_ops.add_bias_residual_reference(y, bias=bias, residual=res)
    want = vae_ops.rms_norm_act_reference(want_sum, gamma, silu=silu)
    assert torch.equal(vae_ops.rms_norm_act_reference(y, gamma, bias=bias, residual=res, silu=silu), want)
    x = y.clone()
    got = vae_ops.rms_norm_act(x, gamma, bias=bias, residual=res, silu=silu)
    assert _report(f"folded sum {dtype}", x, want_sum) <= TOL[dtype]
    assert _report(f"folded norm {dtype} silu={silu}", got, want) <= TOL[dtype]
    assert not torch.equal(x, y)  # the sum really was written back
    with pytest.raises(ValueError, match="out must be another tensor"):
        vae_ops.rms_norm_act(x, gamma, residual=res, silu=silu, out=x)
    with pytest.raises(ValueError, match="residual"):
        vae_ops.rms_norm_act(x, gamma, residual=res[:2], silu=silu)
