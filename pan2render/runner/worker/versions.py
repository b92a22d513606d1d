"""What the worker reports of the software that renders (params.json's ``versions``)."""

from __future__ import annotations

import platform

import av
import torch

from pan2render import __version__


def runtime_versions() -> dict[str, str]:
    """Versions of what renders, as the worker that loads a model reports them."""
    # Plain strings: torch.__version__ is a TorchVersion, whose unpickling imports torch in the
    # driver (which never needs torch otherwise).
    versions = {"pan2-render": __version__, "torch": str(torch.__version__), "av": str(av.__version__),
                "python": platform.python_version()}
    if torch.cuda.is_available():
        versions["cuda"] = str(torch.version.cuda)
        versions["gpu"] = torch.cuda.get_device_name(0)
    return versions
