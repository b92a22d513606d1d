"""ccvfi's IFNet class, the reference `pan2render.models.ifnet` is tested and benchmarked against
(ccvfi's one RIFE model's architecture, v4.26.heavy); the tests and scripts/bench_interpolate.py
load this file with runpy.

ccvfi's package __init__ imports its model wrappers, which import torchvision and cv2 for image I/O
(torchvision is not a dependency ccvfi declares; a CPU-only torch has no matching torchvision wheel on
PyPI). The architecture needs only torch and ccvfi's type names (pydantic): where the wrappers'
imports fail, its module is imported beneath an empty package shell, and sys.modules is left as it
was.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

MISSING = "ccvfi is not installed: the reference RIFE IFNet (pip install -e '.[test]')"


def ccvfi_ifnet_class() -> type | None:
    """ccvfi's ``IFNet`` (forward ``(x = cat(img0, img1), timestep, scale_list)``), or None
    without ccvfi."""
    spec = importlib.util.find_spec("ccvfi")
    if spec is None:
        return None
    before = _ccvfi_modules()
    try:
        from ccvfi.arch.ifnet_arch import IFNet

        return IFNet
    except ModuleNotFoundError:
        pass  # an I/O need of the wrappers (torchvision, cv2): the architecture alone may still import
    shell = types.ModuleType("ccvfi")
    shell.__path__ = list(spec.submodule_search_locations or [])
    _restore(before)  # what the failed import left half-made
    sys.modules["ccvfi"] = shell
    try:
        return importlib.import_module("ccvfi.arch.ifnet_arch").IFNet
    finally:
        _restore(before)


def _ccvfi_modules() -> dict[str, types.ModuleType]:
    return {k: v for k, v in sys.modules.items() if k == "ccvfi" or k.startswith("ccvfi.")}


def _restore(before: dict[str, types.ModuleType]) -> None:
    for k in _ccvfi_modules():
        del sys.modules[k]
    sys.modules.update(before)
