"""The DiT fused-kernel switch: which fused kernels the model's helpers may route to, and proof they ran.

``PAN2PipelineConfig.dit_fused_kernels`` lands here as ``set_fused_kernels(True | False | names)``.
The DiT's pure-torch helpers ask :func:`fused_kernel_enabled` before each call; the fused path runs
only where it can and is exact to use:

- every tensor is on CUDA (or, for CPU tests only, :func:`allow_interpreter` is on and
  ``TRITON_INTERPRET=1`` was set before triton compiled the kernels);
- no autograd graph is needed (the Triton kernels have no backward): grad mode is off, or no
  argument requires grad;
- not inside torch.compile tracing (Dynamo cannot trace our launchers; Inductor fuses the eager
  helpers itself there);
- triton imports.

Otherwise the eager helper runs. Each fused launch increments :func:`fused_kernel_counts`, which is
how a test (and a benchmark) proves the fused path actually ran.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

# The routable steps; names are permanent API (configs and logs use them).
QK_NORM_ROPE = "qk_norm_rope"  # Q/K RMSNorm across heads + 3-D RoPE
NORM_MODULATE = "norm_modulate"  # LayerNorm (+ affine) + shift/scale modulation
RESIDUAL_NORM_MODULATE = "residual_norm_modulate"  # residual (+ gate) fused with the next norm
GATED_RESIDUAL = "gated_residual"  # the block's last residual + gate (same kernel, no norm)
FUSED_KERNEL_NAMES: frozenset[str] = frozenset({QK_NORM_ROPE, NORM_MODULATE, RESIDUAL_NORM_MODULATE, GATED_RESIDUAL})

_enabled: frozenset[str] = FUSED_KERNEL_NAMES  # on by default where they apply
# Whether the fused Q/K prologue writes q, k head-major ([B, H, L, D] contiguous, SDPA's native
# layout) instead of token-major views; chosen by measurement (scripts/bench_dit.py, docs/performance.md).
QK_HEAD_MAJOR = False
_interpreter_on_cpu = False
_counts: Counter[str] = Counter()


def set_fused_kernels(enabled: bool | Iterable[str]) -> None:
    """Enable all fused kernels (True), none (False), or exactly the named ones."""
    global _enabled
    if enabled is True or enabled is False:
        _enabled = FUSED_KERNEL_NAMES if enabled else frozenset()
        return
    if isinstance(enabled, str):
        enabled = [enabled]
    names = frozenset(enabled)
    unknown = names - FUSED_KERNEL_NAMES
    if unknown:
        raise ValueError(f"unknown fused kernel(s) {sorted(unknown)}; choose from {sorted(FUSED_KERNEL_NAMES)}")
    _enabled = names


def fused_kernels() -> frozenset[str]:
    """The names currently switched on (whether they can run depends on the call, see the module doc)."""
    return _enabled


def allow_interpreter(on: bool = True) -> None:
    """Tests only: let the fused path take CPU tensors through the Triton interpreter."""
    global _interpreter_on_cpu
    if on and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "allow_interpreter(True) needs TRITON_INTERPRET=1 in the environment before triton kernels are "
            "imported (tests/conftest.py sets it when CUDA is absent)"
        )
    _interpreter_on_cpu = on


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def fused_kernel_enabled(name: str, *tensors: torch.Tensor | None) -> bool:
    """True when step ``name`` is switched on and may run fused on these tensors right now."""
    if name not in FUSED_KERNEL_NAMES:
        raise ValueError(f"unknown fused kernel {name!r}; choose from {sorted(FUSED_KERNEL_NAMES)}")
    if name not in _enabled or _compiling():
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
    """Record one fused launch of ``name`` (called by the routing helpers right after the launch)."""
    _counts[name] += 1


def fused_kernel_counts() -> dict[str, int]:
    """Launches per fused kernel since the last reset."""
    return dict(_counts)


def reset_fused_kernel_counts() -> None:
    _counts.clear()


# Routed DiT ops: same signatures as pan2render.models.dit_ops' references, fused where
# fused_kernel_enabled says so, the given eager function otherwise. The kernel modules are imported
# lazily so that importing the switch never needs triton.
def routed_dit_ops(eager: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """Entries for ``pan2render.models.dit_ops.DiTOps`` that consult the switch on every call.

    ``eager`` maps the DiTOps field names (modulated_norm, residual_layer_norm,
    residual_modulated_norm, gated_residual, qk_norm_rope) to the plain-torch functions to fall back
    on. The norms' ``out_dtype`` (the dtype of the linear they feed; an fp32 residual stream feeding
    bf16 linears) goes to the kernel or the fallback alike. Use: ``DiTOps(**routed_dit_ops({f.name: getattr(TORCH_OPS, f.name) for f in fields(DiTOps)}))``.
    """

    def modulated_norm(x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, index: torch.Tensor,
                       eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if fused_kernel_enabled(NORM_MODULATE, x, shift, scale, index):
            from pan2render.kernels.dit_modulation import layernorm_modulate

            out = layernorm_modulate(x, shift=shift, scale=scale, index=index, eps=eps, out_dtype=out_dtype)
            count_fused(NORM_MODULATE)
            return out
        return eager["modulated_norm"](x, shift=shift, scale=scale, index=index, eps=eps, out_dtype=out_dtype)

    def residual_layer_norm(x: torch.Tensor, y: torch.Tensor, *, gate: torch.Tensor | None, index: torch.Tensor,
                            weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                            out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # weight None is the cross_attn_norm=False layout (identity norm): nothing to fuse.
        if weight is not None and fused_kernel_enabled(RESIDUAL_NORM_MODULATE, x, y, gate, index, weight, bias):
            from pan2render.kernels.dit_modulation import residual_layernorm_modulate

            x_new, normed = residual_layernorm_modulate(
                x, y, gate=gate, index=index, weight=weight, bias=bias, eps=eps, out_dtype=out_dtype
            )
            count_fused(RESIDUAL_NORM_MODULATE)
            assert normed is not None
            return x_new, normed
        return eager["residual_layer_norm"](x, y, gate=gate, index=index, weight=weight, bias=bias, eps=eps,
                                            out_dtype=out_dtype)

    def residual_modulated_norm(x: torch.Tensor, y: torch.Tensor, *, gate: torch.Tensor | None,
                                index: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if fused_kernel_enabled(RESIDUAL_NORM_MODULATE, x, y, gate, index, shift, scale):
            from pan2render.kernels.dit_modulation import residual_layernorm_modulate

            x_new, normed = residual_layernorm_modulate(
                x, y, gate=gate, index=index, shift=shift, scale=scale, eps=eps, out_dtype=out_dtype
            )
            count_fused(RESIDUAL_NORM_MODULATE)
            assert normed is not None
            return x_new, normed
        return eager["residual_modulated_norm"](x, y, gate=gate, index=index, shift=shift, scale=scale, eps=eps,
                                                out_dtype=out_dtype)

    def gated_residual(x: torch.Tensor, y: torch.Tensor, *, gate: torch.Tensor | None,
                       index: torch.Tensor) -> torch.Tensor:
        if fused_kernel_enabled(GATED_RESIDUAL, x, y, gate, index):
            from pan2render.kernels.dit_modulation import residual_layernorm_modulate

            x_new, _ = residual_layernorm_modulate(x, y, gate=gate, index=index, norm=False)
            count_fused(GATED_RESIDUAL)
            return x_new
        return eager["gated_residual"](x, y, gate=gate, index=index)

    def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, *, norm_q_weight: torch.Tensor,
                     norm_k_weight: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                     num_heads: int, eps: float, head_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if fused_kernel_enabled(QK_NORM_ROPE, q, k, norm_q_weight, norm_k_weight, freqs_cos, freqs_sin):
            from pan2render.kernels.dit_qk_norm_rope import qk_norm_rope as kernel

            # freqs are per token ([L, head_dim // 2], already this shard's rows): every pair reads
            # its token's row, i.e. the kernel's one-axis layout with grid (L, 1, 1).
            seq, half = freqs_cos.shape
            head_major = QK_HEAD_MAJOR and head_groups == 1
            qo, ko = kernel(q, k, weight_q=norm_q_weight, weight_k=norm_k_weight, heads=num_heads,
                            cos=freqs_cos, sin=freqs_sin, grid=(seq, 1, 1), offset=0, eps=eps,
                            split=(half, 0, 0), head_major=head_major, head_groups=head_groups)
            count_fused(QK_NORM_ROPE)
            if head_groups > 1 or head_major:  # [G, B, L, H/G, D] / [B, H, L, D] contiguous
                return qo, ko
            return qo.transpose(1, 2), ko.transpose(1, 2)  # [B, H, L, D] views of [B, L, H, D]
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
