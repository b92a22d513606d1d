"""Where pan2-render keeps what it builds once per machine: the tiny checkpoint, compiled kernels,
the weights' digests. ``$PAN2_RENDER_CACHE``, else ``~/.cache/pan2-render``."""

from __future__ import annotations

import os
import pwd
import tempfile
from pathlib import Path

CACHE_ENV = "PAN2_RENDER_CACHE"


def cache_root() -> Path:
    """The cache folder (not created here). An empty ``PAN2_RENDER_CACHE`` counts as unset, and an
    empty or missing ``HOME`` (a service, ``env -i``) falls back to the account's home folder from
    the password database, never to ``/.cache``."""
    given = os.environ.get(CACHE_ENV, "")
    if given:
        return Path(given).expanduser()
    return _home() / ".cache" / "pan2-render"


def _home() -> Path:
    home = os.environ.get("HOME", "")
    if home:
        return Path(home)
    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:  # a uid without an account (some containers)
        return Path(tempfile.gettempdir()) / f"pan2-render-{os.getuid()}"
