"""FP8 e4m3 row-scaled matmuls (pan2render.kernels.fp8): the quantiser's error bound, the Triton
kernel against its reference, the matmul reference against a plain computation, the switch that
refuses FP8 where it cannot run, and (GPU) torch._scaled_mm against the reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pan2render.kernels.fp8 import (
    E4M3_MAX,
    Fp8Linear,
    fp8_matmul_reference,
    fp8_problem,
    quantize_rows,
    quantize_rows_reference,
    scaled_rows_by_kernel,
)
from pan2render.models.dit import PAN2DiT, PAN2DiTConfig
from pan2render.models.precision import DiTPrecision, PrecisionUnavailable

SMALL = PAN2DiTConfig(num_attention_heads=2, attention_head_dim=12, text_dim=16, freq_dim=16, ffn_dim=40, num_layers=2)


def _plain_e4m3(v: float) -> float:
    """Round one value to e4m3 (3 mantissa bits, exponent >= -6, subnormal step 2^-9, max 448),
    nearest, ties to even: an independent statement of the format."""
    import math

    a = min(abs(v), 448.0)
    if a == 0:
        return 0.0
    e = max(math.floor(math.log2(a)), -6)
    step = 2.0 ** (e - 3)
    q = a / step
    r = math.floor(q)
    r = r + 1 if (q - r > 0.5 or (q - r == 0.5 and r % 2 == 1)) else r
    return math.copysign(min(r * step, 448.0), v)


def test_each_value_is_within_the_stated_bound_of_itself() -> None:
    """|q(v) s - v| <= 2^-4 |v| + 2^-10 s per element (the module doc's bound), tight: the error
    reaches ~2^-4 relative on some element."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 300, generator=gen) * torch.logspace(-3, 2, 64)[:, None]
    x[5, 7] = 0.0
    q, s = quantize_rows_reference(x)
    back = q.float() * s[:, None]
    err = (back - x).abs()
    bound = 2 ** -4 * x.abs() + 2 ** -10 * s[:, None]
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert float((err / x.abs().clamp_min(1e-30)).max()) > 2 ** -4 * 0.9
    # the cast is e4m3's: the same values as rounding each by hand
    plain = torch.tensor([[_plain_e4m3(float(v)) for v in row] for row in (x / s[:, None])[:4]])
    assert torch.equal(q.float()[:4], plain)
    assert float(q.float().abs().max()) == E4M3_MAX  # each row's amax lands on the format's largest value


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the interpreter's test (CPU tensors); on a GPU the compiled kernel's test covers it")
@pytest.mark.parametrize("shape", [(7, 100), (3, 2500), (1, 14336)])
@pytest.mark.parametrize("gelu", [False, True])
def test_the_kernel_scales_as_the_reference(shape: tuple[int, int], gelu: bool) -> None:
    """Under TRITON_INTERPRET the kernel's values before the e4m3 cast (the interpreter's own cast
    is wrong near powers of two; the GPU test covers it) and its scales equal the reference's."""
    gen = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(*shape, generator=gen) * 4).to(torch.bfloat16)
    scaled, scale = scaled_rows_by_kernel(x, gelu=gelu)
    q, ref_scale = quantize_rows_reference(x, gelu=gelu)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    mismatch = (scaled.to(torch.float8_e4m3fn).float() != q.float()).float().mean()
    assert float(mismatch) < 1e-3, f"{float(mismatch):.2e} of the values round to another e4m3 value"


def test_the_matmul_reference_is_a_dequantised_matmul_within_the_bound() -> None:
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(33, 256, generator=gen), torch.randn(48, 256, generator=gen), torch.randn(48, generator=gen)
    xq, xs = quantize_rows_reference(x)
    wq, ws = quantize_rows_reference(w)
    y = fp8_matmul_reference(xq, xs, wq, ws, b, out_dtype=torch.float32)
    by_hand = (xq.float() * xs[:, None]) @ (wq.float() * ws[:, None]).t() + b
    torch.testing.assert_close(y, by_hand, rtol=1e-5, atol=1e-5)
    exact = x @ w.t() + b
    rel = float((y - exact).norm() / exact.norm())
    print(f"e4m3 row-scaled GEMM of Gaussians, K=256: rel. L2 {rel:.3e}")
    assert 0.005 < rel < 0.06  # quantised (not exact), within the stated few percent


def test_fp8_linear_emulated_equals_the_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(64, 40)
    x = torch.randn(2, 5, 64, generator=gen)
    op = Fp8Linear(linear, emulate=True)
    xq, xs = quantize_rows(x.reshape(-1, 64))
    want = fp8_matmul_reference(xq, xs, op.weight, op.weight_scale, linear.bias.detach(), out_dtype=x.dtype)
    assert torch.equal(op(x), want.view(2, 5, 40))
    assert torch.equal(op(x, features=slice(8, 24)), want.view(2, 5, 40)[..., 8:24])
    gelu_in = fp8_matmul_reference(*quantize_rows(F.gelu(x.reshape(-1, 64), approximate="tanh")), op.weight,
                                   op.weight_scale, linear.bias.detach(), out_dtype=x.dtype)
    assert torch.equal(op(x, gelu_input=True), gelu_in.view(2, 5, 40))


def test_fp8_is_refused_where_it_cannot_run() -> None:
    dit = PAN2DiT(SMALL)
    precision = DiTPrecision(dit, torch.device("cpu"))
    with pytest.raises(PrecisionUnavailable, match="precision fp8 needs a CUDA GPU of compute capability 8.9"):
        with precision.applied("fp8"):
            pass
    assert fp8_problem("cpu") is not None
    with precision.applied("bf16"):  # bf16 always runs
        pass


def test_the_switch_routes_every_token_linear_and_restores_them() -> None:
    torch.manual_seed(0)
    dit = PAN2DiT(SMALL).eval()
    names = [name for name, _ in dit.token_linears()]
    assert len(names) == 8 * SMALL.num_layers and "blocks.0.attn2.to_k" not in names
    precision = DiTPrecision(dit, torch.device("cpu"), emulate=True)
    x, t, ctx = torch.randn(1, 48, 2, 4, 4), torch.tensor([500.0]), torch.randn(1, 8, 16)
    with torch.no_grad():
        plain = dit(x, t, ctx)
        with pytest.raises(RuntimeError, match="boom"), precision.applied("fp8"):
            assert all(m.op is not None for _, m in dit.token_linears())
            fp8 = dit(x, t, ctx)
            raise RuntimeError("boom")
        assert all(m.op is None for _, m in dit.token_linears())
        assert torch.equal(dit(x, t, ctx), plain)
    rel = float((fp8 - plain).norm() / plain.norm())
    print(f"tiny DiT forward, fp8 (emulated) vs fp32: rel. L2 {rel:.3e}")
    assert 1e-4 < rel < 0.1


@pytest.mark.gpu
def test_scaled_mm_computes_the_reference() -> None:
    if fp8_problem("cuda") is not None:
        pytest.skip(fp8_problem("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(3)
    linear = torch.nn.Linear(3072, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 333, 3072, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, s = quantize_rows(x.reshape(-1, 3072))
    rq, rs = quantize_rows_reference(x.reshape(-1, 3072))
    assert float((q.float() != rq.float()).float().mean()) < 1e-3
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    gpu, emulated = Fp8Linear(linear), Fp8Linear(linear, emulate=True)
    out, want = gpu(x).float(), emulated(x).float()
    rel = float((out - want).norm() / want.norm())
    assert rel < 5e-3, rel  # the same products; bf16 output rounding and the accumulation order apart
