"""A client of a farm's HTTP API (the standard library's urllib: a client, cheap to import).

A farm is found through its folder: ``ROOT/farm.json`` (its URL, written once it listens) and
``ROOT/token``. :func:`find_farm` returns a client only when the farm there answers, so a folder
left by a farm that was killed is not mistaken for a running one.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

INFO_NAME = "farm.json"
TOKEN_NAME = "token"
ROOT_ENV = "PAN2_RENDER_FARM"  # the farm folder, when not given by --root


def default_root() -> Path:
    """``$PAN2_RENDER_FARM``, else ``$XDG_STATE_HOME/pan2-render/farm`` (``~/.local/state/...``)."""
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV])
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "pan2-render" / "farm"


class FarmError(RuntimeError):
    """The farm refused a request (``status``: the HTTP status) or could not be reached (0)."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


class FarmClient:
    def __init__(self, url: str, token: str, *, root: Path | None = None):
        self.url = url.rstrip("/")
        self.token = token
        self.root = root

    def get(self, path: str, *, timeout_s: float = 30.0) -> Any:
        return self._send("GET", path, None, timeout_s)

    def post(self, path: str, data: dict[str, Any] | None = None, *, timeout_s: float = 60.0) -> Any:
        return self._send("POST", path, data or {}, timeout_s)

    def _send(self, method: str, path: str, data: dict[str, Any] | None, timeout_s: float) -> Any:
        body = None if data is None else json.dumps(data).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # the farm's own URL
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read()).get("error") or e.reason
            except (ValueError, AttributeError):
                message = str(e.reason)
            raise FarmError(e.code, str(message)) from None
        except (urllib.error.URLError, OSError) as e:
            raise FarmError(0, f"the farm at {self.url} does not answer ({getattr(e, 'reason', e)})") from None


def read_token(root: Path) -> str | None:
    try:
        return (root / TOKEN_NAME).read_text().strip() or None
    except OSError:
        return None


def find_farm(root: Path | None = None, *, timeout_s: float = 3.0) -> FarmClient | None:
    """A client of the farm whose folder is ``root`` (default: :func:`default_root`), or None when
    none answers there."""
    root = default_root() if root is None else root
    try:
        info = json.loads((root / INFO_NAME).read_text())
    except (OSError, ValueError):
        return None
    token = read_token(root)
    if token is None or not isinstance(info, dict) or "url" not in info:
        return None
    client = FarmClient(str(info["url"]), token, root=root)
    try:
        client.get("/api/status", timeout_s=timeout_s)
    except FarmError:
        return None
    return client
