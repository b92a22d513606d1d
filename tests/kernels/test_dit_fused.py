"""Routing the DiT's ops to the fused kernels: when a routed op runs its kernel, and a counter test
proving a DiT forward ran every fused kernel (on CPU through the Triton interpreter) with the same
result as the plain-torch ops, in fp32 and with the fp32 residual stream."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pan2render.kernels.dit_fused import (
    can_fuse,
    fused_kernel_counts,
    interpret_on_cpu,
    reset_fused_kernel_counts,
    routed_dit_ops,
)
from pan2render.models.dit_ops import ROUTED_OPS, TORCH_OPS, DiTOps

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not (INTERPRETED or torch.cuda.is_available()),
                                   reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _reset_counts():
    yield
    reset_fused_kernel_counts()


def test_eager_path_on_cpu_outside_the_interpreter_and_under_grad() -> None:
    x = torch.zeros(2, 3)
    assert not can_fuse(x)  # CPU tensors: the reference runs
    if not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1")
    with interpret_on_cpu():
        assert can_fuse(x)
        w = torch.zeros(3, requires_grad=True)
        assert not can_fuse(x, w)  # autograd needed: the reference runs
        with torch.no_grad():
            assert can_fuse(x, w)
    assert not can_fuse(x), "the interpreter is allowed only inside the context"


def test_routed_ops_cover_every_dit_op() -> None:
    eager = {f.name: getattr(TORCH_OPS, f.name) for f in dataclasses.fields(DiTOps)}
    assert set(routed_dit_ops(eager)) == set(eager)


def _tiny_model() -> torch.nn.Module:
    from pan2render.models.dit import PAN2DiT, PAN2DiTConfig

    config = PAN2DiTConfig(num_attention_heads=3, attention_head_dim=20, text_dim=32, freq_dim=32, ffn_dim=64,
                           num_layers=2)
    torch.manual_seed(0)
    model = PAN2DiT(config).eval()
    assert model.ops is ROUTED_OPS, "the model routes to the kernels by default"
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(device: torch.device, dtype: torch.dtype, *, per_token: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 48, 2, 4, 6, generator=g).to(device, dtype)  # token grid (2, 2, 3): 12 tokens
    context = torch.randn(2, 5, 32, generator=g).to(device, dtype)
    if per_token:
        timestep = torch.full((2, 12), 700.0, device=device)
        timestep[:, :6] = 0.0  # first latent frame clean
    else:
        timestep = torch.tensor([700.0, 300.0], device=device)
    return x, timestep, context


def _fused_forward(model: torch.nn.Module, *args: torch.Tensor) -> torch.Tensor:
    reset_fused_kernel_counts()
    if args[0].device.type == "cpu":
        with interpret_on_cpu():
            return model(*args)
    return model(*args)


@needs_kernels
@pytest.mark.parametrize("per_token", [False, True])
def test_dit_forward_runs_every_fused_kernel(per_token: bool) -> None:
    model = _tiny_model()
    args = _inputs(next(model.parameters()).device, torch.float32, per_token=per_token)
    with torch.no_grad():
        model.set_ops(TORCH_OPS)
        want = model(*args)
        model.set_ops(ROUTED_OPS)
        got = _fused_forward(model, *args)
        counts = fused_kernel_counts()
        print("fused launches:", counts)
        # Per block: Q/K prologue, residual->norm2, residual->norm3. 2 blocks: block 0's first norm
        # and the output norm plain; two residual+norm passes per block, plus block 1's first norm
        # taking block 0's last residual; block 1's alone.
        assert counts == {"norm_modulate": 1 + 1, "residual_norm_modulate": 2 * 2 + 1, "gated_residual": 1,
                          "qk_norm_rope": 2}
        rel = float((got - want).abs().max() / want.abs().max())
        print(f"fused vs eager forward (fp32): rel {rel:.3g}")
        assert rel < 1e-4

        model.set_ops(TORCH_OPS)  # the pipeline's dit_fused_kernels=False
        _fused_forward(model, *args)
    assert fused_kernel_counts() == {}, "the plain-torch table never launches a kernel"


@needs_kernels
def test_fp32_residual_stream_through_the_fused_kernels() -> None:
    """The modulation kernels keep an fp32 residual stream and hand the linears their dtype
    (``out_dtype``) as the model passes it, as the references do.

    Compute dtype fp16 here, not bf16: the Triton interpreter (triton 3.x, ``_convert_float``)
    truncates fp32 -> bf16 instead of rounding to nearest even as the GPU does, so in bf16 half
    the normed values would differ by one ulp from torch's; it rounds fp16 correctly. The Q/K
    prologue stays on its reference here: that reference rounds between its norm and its rotation,
    the kernel does not (tests/kernels/test_dit_qk_norm_rope.py compares the two in bf16).
    """
    model = _tiny_model()
    device = next(model.parameters()).device
    keep_fp32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")
    for name, p in model.named_parameters():
        if not any(k in name for k in keep_fp32):
            p.data = p.data.half()
    args = _inputs(device, torch.float16, per_token=True)
    modulation_only = dataclasses.replace(ROUTED_OPS, qk_norm_rope=TORCH_OPS.qk_norm_rope)
    with torch.no_grad():
        model.set_ops(TORCH_OPS)
        fp16_stream = model(*args)
        model.set_residual_dtype(torch.float32)
        want = model(*args)
        model.set_ops(modulation_only)
        got = _fused_forward(model, *args)
    assert fused_kernel_counts() == {"norm_modulate": 1 + 1, "residual_norm_modulate": 2 * 2 + 1, "gated_residual": 1}
    assert got.dtype == torch.float16

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    err, stream_err = rel(got, want), rel(fp16_stream, want)
    print(f"fused vs eager, fp32 stream: {err:.2e}; fp16 vs fp32 stream: {stream_err:.2e}")
    # Same fp32 math, one rounding per output: bit-equal interpreted; on a GPU the LayerNorm
    # reductions differ in order, so an output may round the other way at a tie.
    assert err < (1e-5 if device.type == "cpu" else 2e-4)
    assert stream_err > 10 * max(err, 1e-5)  # an fp16 stream would show (measured 6.4e-4)
