"""The farm's web monitor: the page at the farm's URL and the API routes only it needs.

The page (``static/monitor.html`` with its script and style sheet beside it) holds no data
and needs no token to load; everything it shows comes from the token-protected API:

    GET  /                                 the page; /static/<name> its script and style sheet
    GET  /api/stream                       server-sent events: the farm's snapshot each time it changes
    GET  /api/batches/{id}/view            a batch's jobs laid out as its report does, and its ledger's events
    GET  /api/batches/{id}/files/{path}    a video, poster, params.json or live preview of a batch the farm serves

What a browser adds to the token: every response says ``nosniff`` and carries a strict
Content-Security-Policy (no inline script, nothing from another origin), and a POST is refused
when its Origin is not the page's own or, on a loopback farm, when its Host is not a loopback
name (a DNS-rebinding page names its own host). The token travels in the Authorization header on
every request, so a cross-site form or image cannot act with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import re
import stat
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from aiohttp import ClientConnectionResetError, web

from pan2render.jobs import outdir
from pan2render.jobs.ledger import Ledger
from pan2render.preview_file import PREVIEW_NAME
from pan2render.runner.farm.http import ApiError, route
from pan2render.runner.protocol.artifacts import VIDEO_NAME
from pan2render.runner.protocol.outputs import PARAMS_NAME

if TYPE_CHECKING:
    from pan2render.runner.farm.api import Reads
    from pan2render.runner.farm.service import Farm
from pan2render.runner.views.posters import POSTER_DIR
from pan2render.runner.views.report import Grid, batch_view, report_path

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

STATIC = {  # what the page loads, by name: nothing else is served from the package
    "monitor.js": "text/javascript",
    "monitor.css": "text/css",
}
PAGE = "monitor.html"
_PAGE_PATHS = ("/", "/favicon.ico")  # (a browser asks for the icon on its own: no icon, no 401 in its console)
STREAM_POLL_S = 0.25  # how often the stream looks for a new snapshot (the farm publishes every <= 0.5 s)
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing a quiet stream
LEDGER_EVENTS_SHOWN = 100
FILE_CHUNK = 1 << 20
# The files of a batch the page may ask for: a job's video, params.json and live preview, a poster
# the report made. One segment of a job id or poster name: no separators, no leading dot (so no "..").
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}"
_SERVED_FILES = re.compile(rf"(?:{_NAME}/(?:{re.escape(VIDEO_NAME)}|{re.escape(PARAMS_NAME)}|{re.escape(PREVIEW_NAME)})"
                           rf"|{re.escape(POSTER_DIR)}/{_NAME}\.png)")
_TYPES = {".mp4": "video/mp4", ".png": "image/png", ".json": "application/json", ".webp": "image/webp"}

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; media-src 'self' blob:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


def is_public(request: web.Request) -> bool:
    """The page and its files: served without the token (they hold no data)."""
    return request.method == "GET" and (request.path in _PAGE_PATHS or request.path.removeprefix("/static/") in STATIC)


def cross_site_refusal(request: web.Request) -> str | None:
    """Why a POST is refused as cross-site, or None. A browser sends Origin with every POST a page
    makes; command-line clients send none and are judged by the token alone."""
    origin = request.headers.get("Origin")
    if origin is not None and urlsplit(origin).netloc.lower() != request.host.lower():
        return f"a request from the page at {origin} is refused: the monitor acts only from its own page"
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    if sock and _loopback(sock[0]) and not _loopback_name(urlsplit(f"//{request.host}").hostname or ""):
        return (f"Host {request.host!r} is refused: this farm listens on {sock[0]} and answers only to a "
                f"loopback name (127.0.0.1, localhost, [::1])")
    return None


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _loopback_name(host: str) -> bool:
    return host == "localhost" or host.endswith(".localhost") or _loopback(host)


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Cross-site changes (POST, DELETE) refused before anything else looks at them."""
    if request.method not in ("GET", "HEAD") and (why := cross_site_refusal(request)) is not None:
        raise ApiError(403, why)
    return await handler(request)


async def secure(request: web.Request, response: web.StreamResponse) -> None:
    """The browser's security headers on every answer (errors and streams included)."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)


def _not_found(message: str) -> ApiError:
    return ApiError(404, message)


class MonitorApi:
    """The monitor's routes on the farm's API (``api.make_app``)."""

    def __init__(self, farm: Farm, reads: Reads, app: web.Application):
        self.farm = farm
        self.reads = reads
        self.closing = asyncio.Event()
        app.on_shutdown.append(self._on_shutdown)

    async def _on_shutdown(self, _: web.Application) -> None:
        self.closing.set()  # open streams end, so the API stops without waiting for browsers

    @route("GET", "/")
    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=_static(PAGE), content_type="text/html", charset="utf-8")

    @route("GET", "/favicon.ico")
    async def no_icon(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    @route("GET", "/static/{name}")
    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise _not_found(f"no file {name!r} here")
        return web.Response(body=_static(name), content_type=STATIC[name], charset="utf-8")

    # The stream is a plain GET read by the page with fetch(), not an EventSource: EventSource
    # cannot send a header, and the token then would have to ride in the URL (where proxies and
    # logs keep it) or in a cookie (which every cross-site request carries). With fetch the stream
    # is authenticated exactly as every other request; the page parses the events and reconnects.
    @route("GET", "/api/stream")
    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"})
        await response.prepare(request)
        sent, quiet = b"", 0.0
        try:
            while not self.closing.is_set():
                snap = self.farm.snapshot()  # ({} until the farm's first pass has published one)
                data = self.farm.encoded("stream", lambda s: s) if snap else sent  # (once for every stream)
                if data != sent:
                    await response.write(b"event: snapshot\ndata: " + data + b"\n\n")
                    sent, quiet = data, 0.0
                elif quiet >= KEEPALIVE_S:
                    await response.write(b": still here\n\n")
                    quiet = 0.0
                try:
                    await asyncio.wait_for(self.closing.wait(), STREAM_POLL_S)
                except asyncio.TimeoutError:
                    quiet += STREAM_POLL_S
        except (ConnectionResetError, ClientConnectionResetError):
            pass  # the tab was closed: a stream ends so, it is no error
        return response

    @route("GET", "/api/batches/{id}/view")
    async def view(self, request: web.Request) -> web.Response:
        batch = await self._batch(request.match_info["id"])
        return web.json_response(await asyncio.get_running_loop().run_in_executor(None, _view, batch))

    @route("GET", "/api/batches/{id}/files/{path:.+}")
    async def file(self, request: web.Request) -> web.StreamResponse:
        batch = await self._batch(request.match_info["id"])
        rel = request.match_info["path"]
        if not _SERVED_FILES.fullmatch(rel):
            raise _not_found(f"{rel!r}: the monitor serves a job's {VIDEO_NAME}, {PARAMS_NAME} and {PREVIEW_NAME} "
                             f"and the report's posters, nothing else")
        loop = asyncio.get_running_loop()
        try:
            fd, size = await loop.run_in_executor(None, _open_inside, Path(batch["out_dir"]), rel)
        except (FileNotFoundError, NotADirectoryError, outdir.UnsafePathError) as e:
            raise _not_found(f"{rel}: not in the batch's folder ({e})") from None
        with os.fdopen(fd, "rb") as f:
            response = web.StreamResponse(headers={"Content-Type": _TYPES[Path(rel).suffix],
                                                   "Content-Length": str(size)})
            await response.prepare(request)
            while chunk := await loop.run_in_executor(None, f.read, FILE_CHUNK):
                await response.write(chunk)
        await response.write_eof()
        return response

    async def _batch(self, batch_id: str) -> dict[str, Any]:
        """The batch as the farm's queue has it (only a batch of the farm's queue has files here)."""
        row = await self.reads.batch(batch_id)
        return {"id": row.id, "out_dir": row.out_dir, "owner": row.owner, "state": row.state.value}


def _static(name: str) -> bytes:
    return resources.files("pan2render.runner.farm").joinpath("static", name).read_bytes()


def _open_inside(out_dir: Path, rel: str) -> tuple[int, int]:
    """An fd of the regular file ``out_dir/rel``, its size: the subfolder entered with lstat and the
    file opened without following a link, so a link planted in a job's folder leads nowhere, and
    without waiting (O_NONBLOCK): a FIFO planted there is refused, not waited on by a thread."""
    parent, name = rel.split("/")
    folder = out_dir / parent
    if not stat.S_ISDIR(os.lstat(folder).st_mode):
        raise outdir.UnsafePathError(folder, "not a folder")
    fd = outdir.open_file(folder / name, os.O_RDONLY | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise outdir.UnsafePathError(folder / name, "not a regular file")
    return fd, st.st_size


def _view(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch's page data, read-only from its ledger (a thread of the API's, never the farm's)."""
    out = Path(batch["out_dir"])
    try:
        laid_out = batch_view(out, say=lambda text: None)
        ledger = Ledger.open_readonly(out)
    except FileNotFoundError as e:
        return {"batch": batch, "error": str(e), "jobs": [], "grids": [], "events": []}
    try:
        events = ledger.events()[-LEDGER_EVENTS_SHOWN:]
    finally:
        ledger.close()
    report = report_path(out)
    return {
        "batch": batch,
        "folder": str(out),
        "report": str(report) if report.is_file() else None,
        "jobs": [dataclasses.asdict(t) for t in laid_out.tiles.values()],
        "grids": [_grid_json(g) for g in laid_out.grids],
        "events": [{"at": e.at, "job": e.job_id, "kind": e.label, "detail": e.detail} for e in events],
    }


def _grid_json(grid: Grid) -> dict[str, Any]:
    """A grid with each cell's tiles named by job id (the jobs list holds the tiles)."""
    return {"name": grid.name, "caption": grid.caption, "fixed": grid.fixed, "row_axes": grid.row_axes,
            "col_axis": grid.col_axis, "col_values": grid.col_values,
            "rows": [{"headers": [dataclasses.asdict(h) for h in r.headers],
                      "cells": [[t.id for t in cell] for cell in r.cells]} for r in grid.rows]}
