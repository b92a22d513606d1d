"""The farm's HTTP API (aiohttp), on 127.0.0.1 by default: one handler per route, in classes of
route methods (this module's :class:`FarmApi`, ``videos.VideosApi`` for OpenAI's ``/v1/videos``,
``monitor.MonitorApi`` for the web monitor's page and streams).

Every request carries a token (``Authorization: Bearer <token>``): a user's (``farm user add``) or
the farm's own admin token (``ROOT/token``, readable by the farm's owner only); without a valid
one the answer is 401. A request that changes something is put in line for the farm's main thread
(``requests.py``) and answered when it is carried out (``actions.py``), or with a 503 and the
request's id after :data:`ASK_TIMEOUT_S`. Reads answer from the snapshot the farm publishes after
each pass and from the queue and the ledgers, read-only, off the event loop.

    GET  /api/status                     the farm: groups, queue depth, its log, the batches
    GET  /api/batches                    the batches not ended and the latest ended (?all=1: every one)
    POST /api/batches                    submit a batch file's text; the farm validates it
    GET  /api/batches/{id}               one batch (state, counts, exit code once ended)
    GET  /api/batches/{id}/log           its run.log from ?offset=N -> {text, offset, batch}
    POST /api/batches/{id}/pause         /unpause  /cancel {job?}  /retry  /priority {priority}  /hide
    GET  /api/requests/{id}              what became of a request answered 503
    GET  /api/whoami                     the user the token names
    POST /api/stop                       stop the farm (running jobs go back to pending; admin only)
    GET  /metrics  /healthz  /readyz     for Prometheus and supervisors (``metrics.py``, its own access rule)
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import os
import secrets
import socket
import stat
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from pan2render.runner.farm import intake, metrics, monitor, videos
from pan2render.runner.farm.actions import FarmRequestError, check_priority
from pan2render.runner.farm.folder import url_host
from pan2render.runner.farm.http import (
    USER,
    ApiError,
    Handler,
    error_answer,
    field,
    json_body,
    route,
    routes_of,
    user_of,
)
from pan2render.runner.farm.queue import FarmQueue, QueuedBatch, QueueError
from pan2render.runner.farm.service import Farm, described_from_ledger
from pan2render.runner.farm.users import MAX_TOKEN_LENGTH, Users
from pan2render.runner.serve.progress import RUN_LOG_NAME

LOG_CHUNK = 256 << 10  # most bytes of a run log one request returns
ASK_TIMEOUT_S = 60.0  # a request the main thread has not answered by then is answered 503, and stays in line


@dataclass
class RunningApi:
    url: str
    stop: Callable[[], None]


class Reads:
    """The queue read from the API's threads, beside the main thread that writes it: one read-only
    connection, one reader at a time, never on the event loop."""

    def __init__(self, farm: Farm):
        self._farm = farm
        self._queue: FarmQueue | None = None
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(queue, *args, **kwargs)`` on an executor thread, with the read-only queue."""
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(self._locked, fn, *args,
                                                                                        **kwargs))

    def _locked(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._queue is None:
                self._queue = FarmQueue(self._farm.root, readonly=True)
            return fn(self._queue, *args, **kwargs)

    async def batch(self, batch_id: str) -> QueuedBatch:
        try:
            return await self.run(FarmQueue.get, batch_id)
        except QueueError as e:
            raise ApiError(404, str(e)) from None

    def close(self) -> None:
        with self._lock:
            if self._queue is not None:
                self._queue.close()


async def apply(farm: Farm, request: web.Request, action: str, run: Callable[[], Any]) -> Any:
    """Carry ``run`` out on the farm's main thread and return its result; a refusal becomes its
    4xx. Not answered within ASK_TIMEOUT_S: 503 with the request's id; it stays in line."""
    pending = farm.requests.put(action, user_of(request).name, run)
    try:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending.future)), ASK_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(503, f"the farm has not carried out {action!r} within {ASK_TIMEOUT_S:.0f} s (it is busy, see "
                            f"its log): the request is in line and will be carried out in its turn unless refused; "
                            f"GET /api/requests/{pending.id} says what became of it",
                       extra={"request": pending.id, "applied": False}) from None
    except FarmRequestError as e:
        raise ApiError(e.status, str(e), extra=e.extra | {"request": pending.id}) from None


class FarmApi:
    def __init__(self, farm: Farm, reads: Reads, roots: intake.Roots):
        self.farm = farm
        self.reads = reads
        self.roots = roots

    # ------------------------------------------------------------------ reads
    @route("GET", "/api/status")
    async def status(self, request: web.Request) -> web.Response:
        return _json(self.farm.encoded("status", lambda snap: snap | {"roots": self.roots.describe()}))

    @route("GET", "/api/whoami")
    async def whoami(self, request: web.Request) -> web.Response:
        user = user_of(request)
        return web.json_response({"user": user.name, "admin": user.admin})

    @route("GET", "/api/batches")
    async def batches(self, request: web.Request) -> web.Response:
        if request.query.get("all") in ("1", "true", "yes"):
            rows = await self.reads.run(FarmQueue.batches)
            shown = {b["id"]: b for b in self.farm.snapshot().get("batches", [])}
            loop = asyncio.get_running_loop()
            return web.json_response([shown.get(r.id) or await loop.run_in_executor(None, described_from_ledger, r)
                                      for r in rows])
        return _json(self.farm.encoded("batches", lambda snap: snap.get("batches", [])))

    @route("GET", "/api/batches/{id}")
    async def batch(self, request: web.Request) -> web.Response:
        return web.json_response(await self.described(request.match_info["id"]))

    async def described(self, batch_id: str) -> dict[str, Any]:
        """A batch as the latest snapshot shows it, or (an ended one no longer in it) from the queue."""
        shown = self.farm.snapshot().get("batches", [])
        if (found := next((b for b in shown if b["id"] == batch_id), None)) is not None:
            return found  # (named as the queue names it: no read of the queue, on a thread of its own)
        row = await self.reads.batch(batch_id)
        found = next((b for b in shown if b["id"] == row.id), None)
        return found or await asyncio.get_running_loop().run_in_executor(None, described_from_ledger, row)

    @route("GET", "/api/batches/{id}/log")
    async def log(self, request: web.Request) -> web.Response:
        text = request.query.get("offset", "0")
        if not (text.isascii() and text.isdigit() and len(text) <= 15):
            raise ApiError(400, f"offset {text[:40]!r}: a byte offset, an integer from 0")
        offset = int(text)
        described = await self.described(request.match_info["id"])
        chunk = await asyncio.get_running_loop().run_in_executor(
            None, read_log_chunk, Path(described["out_dir"]) / RUN_LOG_NAME, offset)
        cut = chunk.rfind(b"\n") + 1  # whole lines only: the next request starts at a line
        return web.json_response({"text": chunk[:cut].decode("utf-8", "replace"), "offset": offset + cut,
                                  "batch": described})

    @route("GET", "/api/requests/{id}")
    async def request_outcome(self, request: web.Request) -> web.Response:
        found = self.farm.requests.lookup(request.match_info["id"])
        user = user_of(request)
        if found is None or (found.user != user.name and not user.admin):
            raise ApiError(404, f"no request {request.match_info['id'][:40]!r} among the farm's latest (the farm "
                                f"keeps the latest 1000, until it stops)")
        return web.json_response(found.outcome())

    # ------------------------------------------------------------------ changes
    @route("POST", "/api/batches")
    async def submit(self, request: web.Request) -> web.Response:
        data = await json_body(request)
        user = user_of(request)
        priority, preempt = field(data, "priority", int, default=0), field(data, "preempt", bool, default=False)
        try:
            check_priority(priority)
        except FarmRequestError as e:
            raise ApiError(400, str(e), param="priority") from None
        posted = await asyncio.get_running_loop().run_in_executor(None, intake.batch_from_post, data, self.roots,
                                                                  self.farm.config.serving.retries)
        out = await apply(self.farm, request, f"submit {posted.batch.path}",
                          lambda: self.farm.actions.submit(posted, owner=user.name, priority=priority,
                                                           preempt=preempt))
        return web.json_response(out, status=201)

    @route("POST", "/api/batches/{id}/pause")
    async def pause(self, request: web.Request) -> web.Response:
        return await self._act(request, "pause", lambda b, u, _: self.farm.actions.pause(b, paused=True, user=u))

    @route("POST", "/api/batches/{id}/unpause")
    async def unpause(self, request: web.Request) -> web.Response:
        return await self._act(request, "unpause", lambda b, u, _: self.farm.actions.pause(b, paused=False, user=u))

    @route("POST", "/api/batches/{id}/cancel")
    async def cancel(self, request: web.Request) -> web.Response:
        return await self._act(request, "cancel", lambda b, u, d: self.farm.actions.cancel(
            b, job=field(d, "job", str), user=u))

    @route("POST", "/api/batches/{id}/retry")
    async def retry(self, request: web.Request) -> web.Response:
        return await self._act(request, "retry", lambda b, u, _: self.farm.actions.retry(b, user=u))

    @route("POST", "/api/batches/{id}/hide")
    async def hide(self, request: web.Request) -> web.Response:
        return await self._act(request, "hide", lambda b, u, _: self.farm.actions.hide(b, user=u))

    @route("POST", "/api/batches/{id}/priority")
    async def priority(self, request: web.Request) -> web.Response:
        data = await json_body(request)
        priority = field(data, "priority", int, required=True)
        try:
            check_priority(priority)
        except FarmRequestError as e:
            raise ApiError(400, str(e), param="priority") from None
        return await self._act(request, "priority", lambda b, u, _: self.farm.actions.set_priority(b, priority, user=u),
                               data=data)

    async def _act(self, request: web.Request, name: str, run: Callable[[str, Any, dict[str, Any]], Any], *,
                   data: dict[str, Any] | None = None) -> web.Response:
        if data is None:
            data = await json_body(request, required=False)
        batch_id, user = request.match_info["id"], user_of(request)
        field(data, "job", str)  # checked here, on the API's thread: a bad body is a 400 before the line
        done = await apply(self.farm, request, f"{name} {batch_id}", lambda: run(batch_id, user, data))
        return web.json_response(done)

    @route("POST", "/api/stop")
    async def stop(self, request: web.Request) -> web.Response:
        if not user_of(request).admin:
            raise ApiError(403, "only the farm's admin (its own token) may stop it")
        self.farm.stop()
        return web.json_response({"stopping": True})


def _json(body: bytes) -> web.Response:
    """An answer encoded once for every client that reads it (``Farm.encoded``)."""
    return web.Response(body=body, content_type="application/json", charset="utf-8")


def read_log_chunk(path: Path, offset: int) -> bytes:
    """Up to LOG_CHUNK bytes of a batch's run.log from ``offset``: never through a link, a regular
    file only (opened non-blocking, so a FIFO planted there cannot hold the thread)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return b""
    except OSError as e:
        raise ApiError(404, f"{path.name} of this batch cannot be read ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ApiError(404, f"{path.name} of this batch is not a regular file")
        f.seek(offset)
        return f.read(LOG_CHUNK)


def make_app(farm: Farm, *, users: Users, roots: intake.Roots) -> web.Application:
    reads = Reads(farm)
    watch = metrics.MetricsApi(farm)  # (SettingError: its token file is refused)

    @web.middleware
    async def answer_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return error_answer(request, e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error_answer(request, ApiError(e.status, e.reason if e.text is None else _plain(e.text)))
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client went away: nothing to answer, nothing to log
        except Exception:
            ref = secrets.token_hex(4)
            farm.log(f"API error {ref} on {request.method} {request.path}:\n{traceback.format_exc()}")
            return error_answer(request, ApiError(500, f"the farm failed on this request (error {ref}, in farm.log)"))

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if monitor.is_public(request) or watch.open_to(request):
            return await handler(request)
        header = request.headers.get("Authorization", "")
        token = header.removeprefix("Bearer ").strip() if header.isascii() else ""
        user = users.who(token) if 0 < len(token) <= MAX_TOKEN_LENGTH else None
        if user is None:
            raise ApiError(401, f"this farm needs a token: send `Authorization: Bearer <token>` with a user's "
                                f"token (`pan2-render farm user add NAME` prints one) or the farm's own in "
                                f"{farm.root / 'token'}")
        request[USER] = user
        return await handler(request)

    app = web.Application(middlewares=[watch.count_requests, answer_errors, monitor.guard, authenticate],
                          client_max_size=80 << 20,
                          handler_args={"max_field_size": HEADER_MAX, "max_line_size": HEADER_MAX})
    app.on_response_prepare.append(monitor.secure)
    app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, reads.close))
    app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, watch.collector.close))
    for routes in (FarmApi(farm, reads, roots), videos.VideosApi(farm, reads, roots),
                   monitor.MonitorApi(farm, reads, app), watch):
        app.add_routes(routes_of(routes))
    return app


def _plain(text: str) -> str:
    return text.removeprefix("{\"error\": \"").removesuffix("\"}") if text.startswith("{") else text


def start_api(farm: Farm, *, users: Users, roots: intake.Roots, host: str, port: int,
              say: Callable[[str], None] = print) -> RunningApi:
    """Serve the API on a thread of its own; returns once it listens (``port`` 0: a free one)."""
    loop = asyncio.new_event_loop()
    # Headers up to 64 KiB reach the API (an oversized token gets its 401 there); a request its parser
    # refuses anyway is answered 400 by aiohttp without a traceback in the farm's log.
    runner = web.AppRunner(make_app(farm, users=users, roots=roots), access_log=None)
    logging.getLogger("aiohttp.server").addFilter(_no_bad_requests)
    ready = threading.Event()
    where: dict[str, Any] = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            # Bound here, so a port of 0 is known before anyone is told the address.
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            where["port"] = sock.getsockname()[1]
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.SockSite(runner, sock).start())
        except BaseException as e:  # handed to the thread that waits
            where["error"] = e
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, name="farm-api", daemon=True)
    thread.start()
    ready.wait()
    if "error" in where:
        raise where["error"]
    shown = client_host(host)
    url = f"http://{url_host(shown)}:{where['port']}"
    if shown != host or not _loopback(host):
        say(f"warning: the API listens on {host or 'every interface'} (clients on other machines use "
            f"http://{url_host(socket.gethostname())}:{where['port']}): it is plain HTTP, so tokens cross the "
            f"network in the clear; put it behind a TLS proxy, or keep it on 127.0.0.1 and tunnel (ssh -L)")

    def stop() -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    return RunningApi(url=url, stop=stop)


HEADER_MAX = 64 << 10


def _no_bad_requests(record: logging.LogRecord) -> bool:
    """aiohttp logs each request its parser refuses with a traceback: anyone could fill the log."""
    return not (record.exc_info and isinstance(record.exc_info[1], HttpProcessingError))


def client_host(host: str) -> str:
    """The address a client on this machine uses for a farm bound to ``host``."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
