"""The one place that picks the attention backend for the DiT (self- and cross-attention).

``attention(q, k, v)`` takes [B, heads, L, head_dim] and returns the same layout, like
``F.scaled_dot_product_attention`` without a mask. The backend is chosen explicitly instead of
leaving it to SDPA's default order, because the default order picks flash (FA2) first, which on an
H200 runs the DiT's 26,598-token self-attention at ~360 TFLOP/s while SDPA's cuDNN backend runs it
at ~640 (DESIGN.md section 6; issue 5).

Order by device (each list is a priority order for ``sdpa_kernel(..., set_priority=True)``, so a
backend that cannot take the inputs hands over to the next one rather than failing):
- Hopper (sm_90): cuDNN, flash, memory-efficient, math;
- other CUDA GPUs: flash, memory-efficient, cuDNN, math;
- CPU and the rest: flash (the CPU flash kernel), math.

Measured on one H200 (docs/performance.md): cuDNN 630-640 TFLOP/s on the self-attention shape in
isolation (flash 356) and 536 on the cross-attention one (flash 312), whatever the q/k/v layout, so
cuDNN leads for both. ``split_batch`` (one batch entry at a time) and ``contiguous`` (copy to
[B, H, L, D] first) exist because the issue expected them to pay; both measured slower in the DiT
forward and are off by default. ``set_attention_backend`` forces one backend for tests and
benchmarks; if the forced backend cannot run here, the call falls back to the device's order and
says so once.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger(__name__)

BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


# Key/value lengths up to this are "short" (the DiT's 512 text tokens in cross-attention).
SHORT_KV = 2048


@dataclass
class AttentionConfig:
    backend: str = "auto"
    """'auto' (the device's order, see the module doc) or one of BACKENDS' names, forced."""
    split_batch: bool = False
    """Run batch entries one at a time when cuDNN leads the order. Off: in the DiT forward on an
    H200 it measured slower (batch 2: 1.78 s split vs 1.72 s whole; docs/performance.md)."""
    contiguous: bool = False
    """Copy q / k / v to contiguous [B, H, L, D] before SDPA (when a layout is faster there)."""
    short_kv_backend: str = "auto"
    """Backend tried first when k has at most SHORT_KV positions (cross-attention); 'auto': same order."""

    def __post_init__(self) -> None:
        for name in ("backend", "short_kv_backend"):
            value = getattr(self, name)
            if value != "auto" and value not in BACKENDS:
                raise ValueError(f"attention {name}={value!r} is unknown; choose 'auto' or one of {sorted(BACKENDS)}")


_config = AttentionConfig()
_warned: set[tuple[str, str]] = set()


def set_attention_backend(backend: str = "auto", **changes: object) -> None:
    """Force a backend ('cudnn', 'flash', 'efficient', 'math') or go back to 'auto'; keyword
    arguments change the other AttentionConfig fields (split_batch, contiguous, short_kv_backend)."""
    global _config
    _config = dataclasses.replace(_config, backend=backend, **changes)  # validated in __post_init__


def attention_config() -> AttentionConfig:
    return _config


def _device_order(device: torch.device) -> list[SDPBackend]:
    if device.type != "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    major, _ = torch.cuda.get_device_capability(device)
    if major == 9 and torch.backends.cudnn.is_available():
        return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def _usable(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA can run ``backend`` on these inputs here (checked without running it)."""
    if backend == SDPBackend.MATH:
        return True
    if q.device.type != "cuda":
        return backend == SDPBackend.FLASH_ATTENTION and q.device.type == "cpu"
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    check = {
        SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.can_use_cudnn_attention,
        SDPBackend.FLASH_ATTENTION: torch.backends.cuda.can_use_flash_attention,
        SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.can_use_efficient_attention,
    }[backend]
    return bool(check(params, False))


def attention_backends(q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> list[SDPBackend]:
    """The priority order ``attention`` uses for these inputs (the first usable one runs)."""
    k = q if k is None else k
    v = k if v is None else v
    order = _device_order(q.device)
    if _config.short_kv_backend != "auto" and k.shape[-2] <= SHORT_KV and q.device.type == "cuda":
        first = BACKENDS[_config.short_kv_backend]
        order = [first] + [b for b in order if b != first]
    if _config.backend != "auto":
        forced = BACKENDS[_config.backend]
        if _usable(forced, q, k, v):
            return [forced]
        key = (_config.backend, q.device.type)
        if key not in _warned:
            _warned.add(key)
            logger.warning(
                "attention backend %r cannot run on %s inputs %s %s; falling back to %s",
                _config.backend,
                q.device,
                tuple(q.shape),
                q.dtype,
                [b.name for b in order],
            )
    return order


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention, no mask: q [B, H, Lq, D], k / v [B, H, Lk, D] -> [B, H, Lq, D]."""
    order = attention_backends(q, k, v)
    if _config.contiguous:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    split = _config.split_batch and q.shape[0] > 1 and order[0] == SDPBackend.CUDNN_ATTENTION
    with sdpa_kernel(order, set_priority=True):
        if not split:
            return F.scaled_dot_product_attention(q, k, v)
        return torch.cat(
            [F.scaled_dot_product_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i in range(q.shape[0])]
        )
