"""How many CUDA GPUs this machine has for a local Ray cluster, found without importing torch.

The driver needs the count before it starts Ray (a CPU-only machine gets logical GPUs instead),
and importing torch for it cost the driver seconds it never needed otherwise. NVML, the NVIDIA
driver's management library, answers through ctypes in milliseconds: the way Ray counts GPUs
(`NvidiaGPUAcceleratorManager`: NVML's device count, capped by the entries of
``CUDA_VISIBLE_DEVICES``), so the cluster and this count agree.

A GPU counts only if the installed torch can use it: a torch built without CUDA (the CPU wheel)
counts none, read from ``torch/version.py`` without importing torch. A ROCm build is asked through
torch itself, since NVML does not see AMD GPUs.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
from pathlib import Path

_NVML_LIBRARIES = ("libnvidia-ml.so.1", "libnvidia-ml.so")
_NVML_SUCCESS = 0


def cuda_gpu_count() -> int:
    """CUDA GPUs the workers of a local cluster could use; 0 on a machine without any."""
    build = torch_build()
    if build == "rocm":
        return _count_through_torch()
    if build == "cpu":
        return 0
    return visible(nvml_device_count())


def visible(count: int, env: str | None = None) -> int:
    """``count`` GPUs capped as ``CUDA_VISIBLE_DEVICES`` (``env``; default the environment's) caps
    them for Ray: unset, all; empty (or ``NoDevFiles``), none; else at most one per entry."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    if value is None:
        return count
    if value in ("", "NoDevFiles"):
        return 0
    return min(count, len(value.split(",")))


def nvml_device_count() -> int:
    """The NVIDIA GPUs the driver reports (NVML), 0 where there is no driver or it fails."""
    lib = None
    for name in _NVML_LIBRARIES:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        return 0
    try:
        if lib.nvmlInit_v2() != _NVML_SUCCESS:
            return 0
    except AttributeError:
        return 0
    try:
        count = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != _NVML_SUCCESS:
            return 0
        return int(count.value)
    finally:
        lib.nvmlShutdown()


def torch_build() -> str | None:
    """"cuda", "rocm" or "cpu": what the installed torch was built for, read from its
    ``version.py`` (no import of torch); None when that cannot be read (then NVML alone decides)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text(encoding="utf-8")
    except (OSError, StopIteration, UnicodeDecodeError):
        return None
    values = {}
    for key in ("cuda", "hip"):
        # `cuda: Optional[str] = '12.8'` or `cuda = None`, as torch writes it at build time
        m = re.search(rf"^{key}\s*(?::[^=\n]*)?=\s*(\S.*?)\s*$", text, re.MULTILINE)
        if m is None:
            return None
        values[key] = m.group(1) != "None"
    if values["hip"]:
        return "rocm"
    return "cuda" if values["cuda"] else "cpu"


def _count_through_torch() -> int:
    import torch  # only for a ROCm build, which NVML cannot see

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
