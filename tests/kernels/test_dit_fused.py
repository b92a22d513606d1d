"""The fused-kernel switch: routing rules, and a counter test proving a DiT forward ran every fused
kernel (on CPU through the Triton interpreter) with the same result as the eager path."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pan2render.kernels import dit_fused
from pan2render.kernels.dit_fused import (
    FUSED_KERNEL_NAMES,
    allow_interpreter,
    fused_kernel_counts,
    fused_kernel_enabled,
    reset_fused_kernel_counts,
    routed_dit_ops,
    set_fused_kernels,
)


@pytest.fixture(autouse=True)
def _restore_switch():
    yield
    set_fused_kernels(True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        allow_interpreter(False)
    reset_fused_kernel_counts()


def test_set_fused_kernels_by_name_and_rejects_unknown() -> None:
    set_fused_kernels(["qk_norm_rope"])
    assert dit_fused.fused_kernels() == {"qk_norm_rope"}
    set_fused_kernels(False)
    assert dit_fused.fused_kernels() == frozenset()
    set_fused_kernels(True)
    assert dit_fused.fused_kernels() == FUSED_KERNEL_NAMES
    with pytest.raises(ValueError, match="unknown fused kernel"):
        set_fused_kernels(["qk_norm"])


def test_eager_path_on_cpu_without_interpreter_and_under_grad() -> None:
    x = torch.zeros(2, 3)
    assert not fused_kernel_enabled("norm_modulate", x)  # CPU tensors: eager
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    allow_interpreter(True)
    assert fused_kernel_enabled("norm_modulate", x)
    w = torch.zeros(3, requires_grad=True)
    assert not fused_kernel_enabled("norm_modulate", x, w)  # autograd needed: eager
    with torch.no_grad():
        assert fused_kernel_enabled("norm_modulate", x, w)
    set_fused_kernels(["qk_norm_rope"])
    assert not fused_kernel_enabled("norm_modulate", x)


def _tiny_models():
    from pan2render.models.dit import PAN2DiT, PAN2DiTConfig
    from pan2render.models.dit_ops import ROUTED_OPS, TORCH_OPS

    config = PAN2DiTConfig(num_attention_heads=3, attention_head_dim=20, text_dim=32, freq_dim=32, ffn_dim=64,
                           num_layers=2)
    torch.manual_seed(0)
    model = PAN2DiT(config).eval()
    assert model.ops is ROUTED_OPS, "the model consults the switch by default"
    return model, ROUTED_OPS, TORCH_OPS


def test_routed_ops_cover_every_dit_op() -> None:
    from pan2render.models.dit_ops import TORCH_OPS, DiTOps

    eager = {f.name: getattr(TORCH_OPS, f.name) for f in dataclasses.fields(DiTOps)}
    assert set(routed_dit_ops(eager)) == set(eager)


@pytest.mark.parametrize("per_token", [False, True])
def test_dit_forward_runs_every_fused_kernel(per_token: bool) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    model, fused_ops, torch_ops = _tiny_models()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 48, 2, 4, 6, generator=g).to(device)  # token grid (2, 2, 3): 12 tokens
    context = torch.randn(2, 5, 32, generator=g).to(device)
    if per_token:
        timestep = torch.full((2, 12), 700.0, device=device)
        timestep[:, :6] = 0.0  # first latent frame clean
    else:
        timestep = torch.tensor([700.0, 300.0], device=device)
    with torch.no_grad():
        model.set_ops(torch_ops)
        want = model(x, timestep, context)
        if device == "cpu":
            allow_interpreter(True)
        model.set_ops(fused_ops)
        reset_fused_kernel_counts()
        got = model(x, timestep, context)
    counts = fused_kernel_counts()
    print("fused launches:", counts)
    # Per block: norm1, residual->norm2, residual->norm3, last gated residual, Q/K prologue; + head norm.
    assert counts == {"norm_modulate": 2 + 1, "residual_norm_modulate": 4, "gated_residual": 2, "qk_norm_rope": 2}
    rel = float((got - want).abs().max() / want.abs().max())
    print(f"fused vs eager forward (fp32): rel {rel:.3g}")
    assert rel < 1e-4

    set_fused_kernels(False)
    reset_fused_kernel_counts()
    with torch.no_grad():
        model(x, timestep, context)
    assert fused_kernel_counts() == {}, "switched off: the eager path runs"


def test_fp32_residual_stream_through_the_fused_kernels() -> None:
    """The modulation kernels keep an fp32 residual stream and hand the linears their dtype
    (``out_dtype``), as the eager references do.

    Compute dtype fp16 here, not bf16: the Triton interpreter (triton 3.x, ``_convert_float``)
    truncates fp32 -> bf16 instead of rounding to nearest even as the GPU does, so in bf16 half
    the normed values would differ by one ulp from torch's; it rounds fp16 correctly.
    """
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    model, fused_ops, torch_ops = _tiny_models()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    keep_fp32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")
    model = model.to(device)
    for name, p in model.named_parameters():
        if not any(k in name for k in keep_fp32):
            p.data = p.data.half()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 48, 2, 4, 6, generator=g).to(device, torch.float16)  # 12 tokens
    context = torch.randn(2, 5, 32, generator=g).to(device, torch.float16)
    timestep = torch.full((2, 12), 700.0, device=device)
    timestep[:, :6] = 0.0
    # The kernels that take out_dtype; the Q/K prologue rounds differently from the eager ops in
    # fp16 and is covered by its own tests.
    set_fused_kernels(["norm_modulate", "residual_norm_modulate", "gated_residual"])
    with torch.no_grad():
        model.set_ops(torch_ops)
        fp16_stream = model(x, timestep, context)
        model.set_residual_dtype(torch.float32)
        want = model(x, timestep, context)
        if device == "cpu":
            allow_interpreter(True)
        model.set_ops(fused_ops)
        reset_fused_kernel_counts()
        got = model(x, timestep, context)
    assert fused_kernel_counts() == {"norm_modulate": 2 + 1, "residual_norm_modulate": 4, "gated_residual": 2}
    assert got.dtype == torch.float16

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    err, stream_err = rel(got, want), rel(fp16_stream, want)
    print(f"fused vs eager, fp32 stream: {err:.2e}; fp16 vs fp32 stream: {stream_err:.2e}")
    # Same fp32 math, one rounding per output: bit-equal interpreted; on a GPU the LayerNorm
    # reductions differ in order, so an output may round the other way at a tie.
    assert err < (1e-5 if device == "cpu" else 2e-4)
    assert stream_err > 10 * max(err, 1e-5)  # an fp16 stream would show (measured 6.4e-4)
