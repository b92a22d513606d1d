"""The one place that picks the attention backend for the DiT (self- and cross-attention).

``attention(q, k, v)`` takes [B, heads, L, head_dim] and returns the same layout, like
``F.scaled_dot_product_attention`` without a mask. The backend is chosen explicitly instead of
leaving it to SDPA's default order, because the default order picks flash (FA2) first, which on an
H200 runs the DiT's 26,598-token self-attention at ~360 TFLOP/s while SDPA's cuDNN backend runs it
at ~640 (docs/performance.md).

FlashAttention-4 first. Where the ``flash-attn-4`` package (``flash_attn.cute.flash_attn_func``,
CuTe DSL kernels compiled on the first call) imports, the GPU is sm_90 or sm_100, the dtype bf16
or fp16 and the head dim 128 (`fa4_unusable_reason`), every call goes to it: at the DiT's
self-attention shape it ran 13.3 ms vs cuDNN's 15.3 ms on an H200 with the same error against fp32
(docs/performance.md). It takes [B, L, heads, D]; the DiT's q / k / v are token-major views (the
projections write [B, L, heads, D]), so ``transpose(1, 2)`` hands it the memory as it lies, and its
[B, L, heads, D] output goes back as the [B, heads, L, D] view the caller flattens for free.
Its compiled kernels are keyed by dtype / head dim / tile (not by sequence length or head count),
so one warm-up call at load (`warm_up_attention`) compiles what every later call uses;
given a folder, it lets the library keep them on disk for the next process.

Otherwise SDPA, in an order by device (each list is a priority order for
``sdpa_kernel(..., set_priority=True)``, so a backend that cannot take the inputs hands over to the
next one rather than failing):
- Hopper (sm_90): cuDNN, flash, memory-efficient, math;
- other CUDA GPUs: flash, memory-efficient, cuDNN, math;
- CPU and the rest: flash (the CPU flash kernel), math.

Measured on one H200 (docs/performance.md): cuDNN 630-640 TFLOP/s on the self-attention shape in
isolation (flash 356) and 536 on the cross-attention one (flash 312), whatever the q/k/v layout, so
cuDNN leads for both. The inputs go to SDPA as they lie and the batch whole: running one batch
entry at a time, or copying q / k / v to contiguous [B, H, L, D] first, measured slower in the DiT
forward (scripts/bench_dit.py keeps the layout comparison). ``set_attention_backend`` forces one
backend ('fa4' or an SDPA one) for tests and benchmarks; if the forced backend cannot run here,
the call falls back to the device's SDPA order and says so once. The backend used is logged once
per process and input kind (`describe_attention` gives the same words for the load reply and the
group's layout line).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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
FA4 = "fa4"  # FlashAttention-4 (flash-attn-4), not an SDPA backend

# Where FlashAttention-4 is used: its Hopper (sm_90) and Blackwell (sm_100) forward kernels, the
# 16-bit dtypes, and the head dim it was measured at (the DiT's 128; the VAE mid-block's 1024 is
# above the library's limit of 256 on sm_90 and 128 on sm_100).
FA4_ARCH_MAJORS = (9, 10)
FA4_DTYPES = (torch.bfloat16, torch.float16)
FA4_HEAD_DIM = 128

# Key/value lengths up to this are "short" (the DiT's 512 text tokens in cross-attention).
SHORT_KV = 2048


@dataclass
class AttentionConfig:
    backend: str = "auto"
    """'auto' (FlashAttention-4 where usable, else the device's SDPA order; see the module doc),
    'fa4', or one of BACKENDS' names, forced."""
    short_kv_backend: str = "auto"
    """SDPA backend tried first when k has at most SHORT_KV positions (cross-attention), which then
    goes to SDPA even where FlashAttention-4 runs the rest; 'auto': same choice as every call."""

    def __post_init__(self) -> None:
        for name, allowed in (("backend", [*BACKENDS, FA4]), ("short_kv_backend", list(BACKENDS))):
            value = getattr(self, name)
            if value != "auto" and value not in allowed:
                raise ValueError(f"attention {name}={value!r} is unknown; choose 'auto' or one of {sorted(allowed)}")


_config = AttentionConfig()
_warned: set[tuple[str, str]] = set()
_announced: set[tuple[str, str, int]] = set()
_fa4_broken: str | None = None  # why FlashAttention-4 is off for this process (its warm-up failed)


def set_attention_backend(backend: str = "auto", **changes: object) -> None:
    """Force a backend ('fa4', 'cudnn', 'flash', 'efficient', 'math') or go back to 'auto'; keyword
    arguments change the other AttentionConfig fields (short_kv_backend)."""
    global _config
    _config = dataclasses.replace(_config, backend=backend, **changes)  # validated in __post_init__


def attention_config() -> AttentionConfig:
    return _config


# ------------------------------------------------------------------------------------------------
# FlashAttention-4


def _use_persistent_compile_cache(folder: Path) -> None:
    """Ask flash-attn-4 to keep its compiled kernels in ``folder`` across processes (its own
    on-disk cache, keyed by its source and toolchain versions). The library reads these variables
    when it is first imported, so this acts only before that; a user's own settings win."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(folder))


@functools.cache
def _fa4_function() -> tuple[Callable[..., object] | None, str]:
    """(flash_attn_func or None, what was found), imported once per process (a second thread
    calling it while the first imports waits on Python's import lock and finds the same)."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as err:  # noqa: BLE001 - a missing package or a broken CuTe DSL install alike
        first_line = (str(err).splitlines() or [""])[0]
        return None, f"flash-attn-4 not importable ({type(err).__name__}: {first_line})"
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    return flash_attn_func, f"flash-attn-4 {version}"


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def fa4_unusable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when FlashAttention-4 runs attention of these inputs here, else why not (cheap checks
    first: the package is imported only on a GPU it supports)."""
    if _fa4_broken is not None:
        return _fa4_broken
    if device.type != "cuda":
        return f"{device.type} device"
    major, minor = _capability(device)
    if major not in FA4_ARCH_MAJORS:
        supported = ", ".join(f"sm_{m}0" for m in FA4_ARCH_MAJORS)
        return f"sm_{major}{minor} GPU (FlashAttention-4 here: {supported})"
    if dtype not in FA4_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')} (FlashAttention-4 here: bf16, fp16)"
    if head_dim != FA4_HEAD_DIM:
        return f"head dim {head_dim} (FlashAttention-4 here: {FA4_HEAD_DIM})"
    fn, found = _fa4_function()
    return None if fn is not None else found


def _fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    fn, _ = _fa4_function()
    assert fn is not None  # checked by fa4_unusable_reason
    # [B, H, L, D] -> [B, L, H, D]: a view of the token-major memory the DiT's projections write.
    result = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out = result[0] if isinstance(result, tuple) else result  # (out, lse); lse None unless asked
    return out.transpose(1, 2)  # [B, L, H, D] contiguous -> [B, H, L, D] view


def _fa4_allowed() -> bool:
    """Whether the configured backend lets FlashAttention-4 run ('auto' or 'fa4')."""
    return _config.backend in ("auto", FA4)


def _use_fa4(q: torch.Tensor, k: torch.Tensor) -> bool:
    if not _fa4_allowed():
        return False
    if _config.short_kv_backend != "auto" and k.shape[-2] <= SHORT_KV:
        return False
    reason = fa4_unusable_reason(q.device, q.dtype, q.shape[-1])
    if reason is not None and _config.backend == FA4:
        _warn_once(FA4, q, f"attention backend 'fa4' cannot run here ({reason}); falling back to "
                           f"{[b.name for b in _device_order(q.device)]}")
    return reason is None


def start_attention_import(device: torch.device | str, dtype: torch.dtype, *, head_dim: int,
                           compile_cache: Path | None = None) -> threading.Thread | None:
    """Start importing FlashAttention-4 on a thread, where it will run here (the same cheap checks
    as `fa4_unusable_reason`, before any import), and return the thread (None where it will not
    run). Its CuTe DSL took ~7 s to import on an H200 host; a model load calls this first so the
    import overlaps reading the weights, whose reads release the GIL. `warm_up_attention` later
    gets the imported module (or waits for the import to end)."""
    device = torch.device(device)
    if (device.type != "cuda" or not _fa4_allowed() or _fa4_broken is not None or dtype not in FA4_DTYPES
            or head_dim != FA4_HEAD_DIM or _capability(device)[0] not in FA4_ARCH_MAJORS):
        return None
    if compile_cache is not None:
        _use_persistent_compile_cache(compile_cache)  # before the first import of the library
    thread = threading.Thread(target=_fa4_function, name="import flash-attn-4", daemon=True)
    thread.start()
    return thread


def warm_up_attention(device: torch.device | str, dtype: torch.dtype, *, heads: int, head_dim: int,
                      compile_cache: Path | None = None) -> None:
    """Compile FlashAttention-4's kernel now (at model load) when it will run, instead of inside
    the first job's first forward; with ``compile_cache``, in (or loaded from) that folder. A no-op
    where it will not run (CPU, other GPUs, no package). If the compile fails, FlashAttention-4 is
    switched off for this process and SDPA runs (logged)."""
    global _fa4_broken
    device = torch.device(device)
    if compile_cache is not None and device.type == "cuda":
        _use_persistent_compile_cache(compile_cache)  # before the first import of the library
    if not _fa4_allowed() or fa4_unusable_reason(device, dtype, head_dim) is not None:
        return
    # Token-major q / k / v, the layout the DiT passes. The library's compile key holds no sequence
    # length or head count; on sm_100 it holds whether q spans more than one 128-row tile (two Q
    # stages), hence 256 tokens, as every DiT call does.
    x = torch.randn(1, 256, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
    t0 = time.perf_counter()
    try:
        _fa4_attention(x, x, x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as err:  # noqa: BLE001 - a failed compile must not fail the load: SDPA remains
        _fa4_broken = f"FlashAttention-4 warm-up failed ({type(err).__name__}: {err})"
        logger.warning("%s; attention runs through SDPA in this process", _fa4_broken)
        return
    logger.info("FlashAttention-4 warm-up (compile or cache load) took %.1f s", time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------------
# SDPA


def _device_order(device: torch.device) -> list[SDPBackend]:
    if device.type != "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    major, _ = _capability(device)
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


def _warn_once(backend: str, q: torch.Tensor, message: str) -> None:
    key = (backend, q.device.type)
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s (inputs %s %s on %s)", message, tuple(q.shape), q.dtype, q.device)


def attention_backends(q: torch.Tensor, k: torch.Tensor | None = None,
                       v: torch.Tensor | None = None) -> list[SDPBackend]:
    """The SDPA priority order ``attention`` uses for these inputs when FlashAttention-4 does not
    run them (the first usable one runs)."""
    k = q if k is None else k
    v = k if v is None else v
    order = _device_order(q.device)
    if _config.short_kv_backend != "auto" and k.shape[-2] <= SHORT_KV and q.device.type == "cuda":
        first = BACKENDS[_config.short_kv_backend]
        order = [first] + [b for b in order if b != first]
    if not _fa4_allowed():
        forced = BACKENDS[_config.backend]
        if _usable(forced, q, k, v):
            return [forced]
        _warn_once(_config.backend, q, f"attention backend {_config.backend!r} cannot run here; falling back to "
                                       f"{[b.name for b in order]}")
    return order


def describe_attention(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str:
    """In words, the backend ``attention`` uses for [B, H, L, head_dim] inputs of ``dtype`` on
    ``device`` (long sequences; ``short_kv_backend`` may route cross-attention elsewhere): for the
    process's log, the group's layout line and the worker's load reply."""
    device = torch.device(device)
    reason = fa4_unusable_reason(device, dtype, head_dim)
    if _fa4_allowed() and reason is None:
        return f"FlashAttention-4 ({_fa4_function()[1]})"
    probe = torch.empty(1, 1, 1, head_dim, device=device if device.type == "cuda" else "cpu", dtype=dtype)
    order = "/".join(b.name.lower().removesuffix("_attention") for b in attention_backends(probe))
    why = f"; FlashAttention-4 not used: {reason}" if _fa4_allowed() else ""
    return f"SDPA {order}{why}"


def _announce(q: torch.Tensor) -> None:
    """Log the backend once per process and input kind (device, dtype, head dim)."""
    key = (str(q.device), str(q.dtype), q.shape[-1])
    if key not in _announced:
        _announced.add(key)
        logger.info("attention on %s %s head dim %d: %s", q.device, str(q.dtype).removeprefix("torch."),
                    q.shape[-1], describe_attention(q.device, q.dtype, q.shape[-1]))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention, no mask: q [B, H, Lq, D], k / v [B, H, Lk, D] -> [B, H, Lq, D]."""
    _announce(q)
    if _use_fa4(q, k):
        return _fa4_attention(q, k, v)
    with sdpa_kernel(attention_backends(q, k, v), set_priority=True):
        return F.scaled_dot_product_attention(q, k, v)
