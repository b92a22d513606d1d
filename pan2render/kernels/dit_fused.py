"""Routing the DiT's fusable ops to their Triton kernels, and proof that the kernels ran.

The switch is per pipeline: ``PAN2PipelineConfig.dit_fused_kernels`` gives the pipeline's DiT the
routed op table (``pan2render.models.dit_ops.ROUTED_OPS``, built by :func:`routed_dit_ops`) or the
plain-torch one (``TORCH_OPS``). A routed op runs its kernel only where the kernel can run and is
exact to use (:func:`can_fuse`):

- every tensor is on CUDA (or, for CPU tests only, inside :func:`interpret_on_cpu` with
  ``TRITON_INTERPRET=1`` set before triton compiled the kernels);
- no autograd graph is needed (the Triton kernels have no backward): grad mode is off, or no
  argument requires grad;
- not inside torch.compile tracing (Dynamo cannot trace our launchers; Inductor fuses the eager
  ops itself there);
- triton imports.

Otherwise it runs the plain-torch reference it was given, with the same arguments. Each fused
launch increments :func:`fused_kernel_counts`, which is how a test (and a benchmark) proves the
fused path actually ran.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

# The kernels, as counted; names are permanent API (logs and benchmark results use them).
QK_NORM_ROPE = "qk_norm_rope"  # Q/K RMSNorm across heads + RoPE
NORM_MODULATE = "norm_modulate"  # LayerNorm + shift/scale modulation
RESIDUAL_NORM_MODULATE = "residual_norm_modulate"  # residual (+ gate) fused with the next norm
GATED_RESIDUAL = "gated_residual"  # the block's last residual + gate (same kernel, no norm)
FUSED_KERNEL_NAMES: frozenset[str] = frozenset({QK_NORM_ROPE, NORM_MODULATE, RESIDUAL_NORM_MODULATE, GATED_RESIDUAL})

_interpreter_on_cpu = False
_counts: Counter[str] = Counter()


@contextlib.contextmanager
def interpret_on_cpu() -> Iterator[None]:
    """Tests only: inside, the routed ops take CPU tensors through the Triton interpreter."""
    global _interpreter_on_cpu
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "interpret_on_cpu() needs TRITON_INTERPRET=1 in the environment before triton kernels are "
            "imported (tests/conftest.py sets it when CUDA is absent)"
        )
    before, _interpreter_on_cpu = _interpreter_on_cpu, True
    try:
        yield
    finally:
        _interpreter_on_cpu = before


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def can_fuse(*tensors: torch.Tensor | None) -> bool:
    """True when a fused kernel may run on these tensors right now (see the module doc)."""
    if _compiling():
        return False
    present = [t for t in tensors if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False
    on_cuda = all(t.is_cuda for t in present)
    on_cpu_interpreted = _interpreter_on_cpu and all(t.device.type == "cpu" for t in present)
    if not (on_cuda or on_cpu_interpreted):
        return False
    return _triton_available()


def count_fused(name: str) -> None:
    """Record one fused launch of ``name`` (called by the routed ops right after the launch)."""
    _counts[name] += 1


def fused_kernel_counts() -> dict[str, int]:
    """Launches per fused kernel since the last reset."""
    return dict(_counts)


def reset_fused_kernel_counts() -> None:
    _counts.clear()


# The kernel modules are imported on the first fused call, so that importing the model never
# needs triton.
def routed_dit_ops(eager: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """Entries for ``pan2render.models.dit_ops.DiTOps``: each op runs its kernel where
    :func:`can_fuse` allows it and ``eager[op]`` (the reference, same signature) otherwise.

    ``eager`` maps the DiTOps field names (modulated_norm, residual_layer_norm,
    residual_modulated_norm, gated_residual, qk_norm_rope) to the plain-torch functions. Every
    argument goes to the kernel or the reference alike; the kernels take the references' signatures.
    """

    def modulated_norm(x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, index: torch.Tensor,
                       eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if can_fuse(x, shift, scale, index):
            from pan2render.kernels import dit_modulation

            out = dit_modulation.modulated_norm(x, shift=shift, scale=scale, index=index, eps=eps, out_dtype=out_dtype)
            count_fused(NORM_MODULATE)
            return out
        return eager["modulated_norm"](x, shift=shift, scale=scale, index=index, eps=eps, out_dtype=out_dtype)

    def residual_layer_norm(x: torch.Tensor, y: torch.Tensor, *, gate: torch.Tensor | None, index: torch.Tensor,
                            weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                            out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # weight None is the cross_attn_norm=False layout (identity norm): nothing to fuse.
        if weight is not None and can_fuse(x, y, gate, index, weight, bias):
            from pan2render.kernels import dit_modulation

            out = dit_modulation.residual_layer_norm(x, y, gate=gate, index=index, weight=weight, bias=bias,
                                                     eps=eps, out_dtype=out_dtype)
            count_fused(RESIDUAL_NORM_MODULATE)
            return out
        return eager["residual_layer_norm"](x, y, gate=gate, index=index, weight=weight, bias=bias, eps=eps,
                                            out_dtype=out_dtype)

    def residual_modulated_norm(x: torch.Tensor, y: torch.Tensor, *, gate: torch.Tensor | None,
                                index: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if can_fuse(x, y, gate, index, shift, scale):
            from pan2render.kernels import dit_modulation

            out = dit_modulation.residual_modulated_norm(x, y, gate=gate, index=index, shift=shift, scale=scale,
                                                         eps=eps, out_dtype=out_dtype)
            count_fused(RESIDUAL_NORM_MODULATE)
            return out
        return eager["residual_modulated_norm"](x, y, gate=gate, index=index, shift=shift, scale=scale, eps=eps,
                                                out_dtype=out_dtype)

    def gated_residual(x: torch.Tensor, y: torch.Tensor, *, gate: torch.Tensor | None,
                       index: torch.Tensor) -> torch.Tensor:
        if can_fuse(x, y, gate, index):
            from pan2render.kernels import dit_modulation

            out = dit_modulation.gated_residual(x, y, gate=gate, index=index)
            count_fused(GATED_RESIDUAL)
            return out
        return eager["gated_residual"](x, y, gate=gate, index=index)

    def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, *, norm_q_weight: torch.Tensor,
                     norm_k_weight: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                     num_heads: int, eps: float, head_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if can_fuse(q, k, norm_q_weight, norm_k_weight, freqs_cos, freqs_sin):
            from pan2render.kernels import dit_qk_norm_rope

            out = dit_qk_norm_rope.qk_norm_rope(q, k, norm_q_weight=norm_q_weight, norm_k_weight=norm_k_weight,
                                                freqs_cos=freqs_cos, freqs_sin=freqs_sin, num_heads=num_heads,
                                                eps=eps, head_groups=head_groups)
            count_fused(QK_NORM_ROPE)
            return out
        return eager["qk_norm_rope"](q, k, norm_q_weight=norm_q_weight, norm_k_weight=norm_k_weight,
                                     freqs_cos=freqs_cos, freqs_sin=freqs_sin, num_heads=num_heads, eps=eps,
                                     head_groups=head_groups)

    return {
        "modulated_norm": modulated_norm,
        "residual_layer_norm": residual_layer_norm,
        "residual_modulated_norm": residual_modulated_norm,
        "gated_residual": gated_residual,
        "qk_norm_rope": qk_norm_rope,
    }
