"""A Python client of a pan2-render farm's HTTP API (the standard library's urllib: cheap to import).

    from pan2render.client import find_farm
    farm = find_farm()                       # the farm at the default folder, if one answers
    b = farm.submit_file("jobs/sweep.yaml", out="renders/sweep", sets=["model=tiny"])
    code = farm.follow(b["id"])              # its run.log's lines as they come; `run`'s exit code
    farm.download(video_id, "fox.mp4")       # a video made through /v1/videos

A farm is found through its folder: ``ROOT/farm.json`` (its URL, written once it listens) and
``ROOT/token``, read only from a folder that is the user's alone (``farm/folder.py``), so a folder
left by a killed farm, or planted by someone else, is not taken for a running farm. Or connect to
one by URL with a user's token: ``FarmClient(url, token)``. The farm validates every batch itself
(the batch file's text travels, not our reading of it), so any client, ``curl`` included, submits
exactly as ``pan2-render submit`` does.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pan2render.runner.farm.folder import read_info, read_token

ROOT_ENV = "PAN2_RENDER_FARM"  # the farm folder, when not given by --root
TIMEOUT_S = 90.0  # longer than the farm's own wait for its main thread, whose 503 says more than a timeout


def default_root() -> Path:
    """``$PAN2_RENDER_FARM``, else ``$XDG_STATE_HOME/pan2-render/farm`` (``~/.local/state/...``)."""
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV])
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "pan2-render" / "farm"


class FarmError(RuntimeError):
    """The farm refused a request (``status``: the HTTP status; ``body``: its JSON answer, with
    ``problems`` for a batch that does not validate) or could not be reached (status 0)."""

    def __init__(self, status: int, message: str, body: dict[str, Any] | None = None):
        self.status = status
        self.body = body or {}
        super().__init__(message)

    @property
    def problems(self) -> list[str]:
        return list(self.body.get("problems") or [])


class FarmClient:
    def __init__(self, url: str, token: str, *, root: Path | None = None):
        self.url = url.rstrip("/")
        self.token = token
        self.root = root

    # ------------------------------------------------------------------ the wire
    def get(self, path: str, *, timeout_s: float = 30.0) -> Any:
        return self._send("GET", path, None, timeout_s)

    def post(self, path: str, data: dict[str, Any] | None = None, *, timeout_s: float = TIMEOUT_S) -> Any:
        return self._send("POST", path, data or {}, timeout_s)

    def delete(self, path: str, *, timeout_s: float = TIMEOUT_S) -> Any:
        return self._send("DELETE", path, None, timeout_s)

    def _open(self, method: str, path: str, data: dict[str, Any] | None, timeout_s: float) -> Any:
        body = None if data is None else json.dumps(data).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=timeout_s)  # the farm's own URL
        except urllib.error.HTTPError as e:
            try:
                answer = json.loads(e.read())
            except ValueError:
                answer = {}
            error = answer.get("error") if isinstance(answer, dict) else None
            message = error.get("message") if isinstance(error, dict) else error
            raise FarmError(e.code, str(message or e.reason), answer if isinstance(answer, dict) else {}) from None
        except (urllib.error.URLError, OSError) as e:
            raise FarmError(0, f"the farm at {self.url} does not answer ({getattr(e, 'reason', e)})") from None

    def _send(self, method: str, path: str, data: dict[str, Any] | None, timeout_s: float) -> Any:
        with self._open(method, path, data, timeout_s) as resp:
            return json.loads(resp.read() or b"null")

    # ------------------------------------------------------------------ batches
    def submit_text(self, text: str, *, out: str | Path, name: str = "batch.yaml", base: str | Path | None = None,
                    sets: list[str] | tuple[str, ...] = (), sweeps: list[str] | tuple[str, ...] = (),
                    priority: int = 0, preempt: bool = False, retries: int | None = None, add: bool = False,
                    force: bool = False, prune: bool = False) -> dict[str, Any]:
        """Queue a batch given as its YAML text; relative paths in it resolve against ``base`` (a
        folder the farm may read), ``out`` is where it renders. Returns the batch as the farm has
        it; FarmError 422 with ``problems`` (file:line, field, what is allowed) when it does not validate."""
        body: dict[str, Any] = {"text": text, "name": name, "out": str(out), "set": list(sets), "sweep": list(sweeps),
                                "priority": priority, "preempt": preempt, "add": add, "force": force, "prune": prune}
        if base is not None:
            body["base"] = str(base)
        if retries is not None:
            body["retries"] = retries
        return self.post("/api/batches", body)

    def submit_file(self, path: str | Path, *, out: str | Path, **options: Any) -> dict[str, Any]:
        """Queue a batch file (read here, validated by the farm), its relative paths resolved against
        its folder, ``out`` against the folder this runs in."""
        p = Path(path)
        return self.submit_text(p.read_text(encoding="utf-8"), name=p.name, base=p.absolute().parent,
                                out=Path(out).absolute(), **options)

    def submit_dict(self, doc: dict[str, Any], *, out: str | Path, base: str | Path, **options: Any) -> dict[str, Any]:
        """Queue a batch given as a mapping (what a batch file holds)."""
        return self.submit_text(json.dumps(doc), out=out, base=base, **options)  # JSON is YAML

    def batches(self, *, all: bool = False) -> list[dict[str, Any]]:
        return self.get("/api/batches" + ("?all=1" if all else ""))

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self.get(f"/api/batches/{_q(batch_id)}")

    def status(self) -> dict[str, Any]:
        return self.get("/api/status")

    def whoami(self) -> dict[str, Any]:
        return self.get("/api/whoami")

    def act(self, batch_id: str, action: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
        """pause, unpause, cancel ({"job": ...}), retry, priority ({"priority": n}), hide."""
        return self.post(f"/api/batches/{_q(batch_id)}/{action}", data)

    def pause(self, batch_id: str) -> dict[str, Any]:
        return self.act(batch_id, "pause")

    def unpause(self, batch_id: str) -> dict[str, Any]:
        return self.act(batch_id, "unpause")

    def cancel(self, batch_id: str, job: str | None = None) -> dict[str, Any]:
        return self.act(batch_id, "cancel", {} if job is None else {"job": job})

    def retry(self, batch_id: str) -> dict[str, Any]:
        return self.act(batch_id, "retry")

    def set_priority(self, batch_id: str, priority: int) -> dict[str, Any]:
        return self.act(batch_id, "priority", {"priority": priority})

    def request(self, request_id: str) -> dict[str, Any]:
        """What became of a request the farm answered 503 (its id was in that answer)."""
        return self.get(f"/api/requests/{_q(request_id)}")

    def follow(self, batch_id: str, *, offset: int = 0, on_line: Callable[[str], None] | None = None,
               out_dir: Path | None = None) -> int:
        """Hand the batch's run.log lines to ``on_line`` (default: stderr) as they come, until it
        ends; returns what `run` would exit with. Losing the farm raises FarmError after the lines
        of ``out_dir``'s run.log (where this machine can read it) the farm had not sent yet."""
        say = on_line or (lambda line: print(line, file=sys.stderr, flush=True))
        while True:
            try:
                got = self.get(f"/api/batches/{_q(batch_id)}/log?offset={offset}")
            except FarmError as e:
                if e.status == 0 and out_dir is not None:  # lost: what the farm had not sent yet
                    for line in _log_from(out_dir / "run.log", offset):
                        say(line)
                raise
            for line in got["text"].splitlines():
                say(line)
            offset = got["offset"]
            code = got["batch"]["exit_code"]
            if code is not None and not got["text"]:
                return int(code)
            if not got["text"]:
                time.sleep(0.3)

    def stop(self) -> dict[str, Any]:
        return self.post("/api/stop")

    # ------------------------------------------------------------------ videos (OpenAI's shape)
    def video(self, video_id: str) -> dict[str, Any]:
        return self.get(f"/v1/videos/{_q(video_id)}")

    def download(self, video_id: str, path: str | Path, *, variant: str = "video") -> Path:
        """A video's mp4 (or its ``thumbnail`` / ``spritesheet`` PNG) written to ``path``."""
        target = Path(path)
        with self._open("GET", f"/v1/videos/{_q(video_id)}/content?variant={_q(variant)}", None, 300) as resp:
            tmp = target.with_name(f".{target.name}.part")
            with open(tmp, "wb") as f:
                while chunk := resp.read(1 << 20):
                    f.write(chunk)
            os.replace(tmp, target)
        return target


def _q(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def _log_from(path: Path, offset: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def find_farm(root: Path | None = None, *, timeout_s: float = 3.0) -> FarmClient | None:
    """A client of the farm whose folder is ``root`` (default: :func:`default_root`), or None when
    none answers there, or the folder is not this user's alone."""
    root = default_root() if root is None else root
    info = read_info(root)
    token = read_token(root)
    if token is None or info is None or not isinstance(info.get("url"), str):
        return None
    client = FarmClient(info["url"], token, root=root)
    try:
        client.get("/api/status", timeout_s=timeout_s)
    except FarmError:
        return None
    return client
