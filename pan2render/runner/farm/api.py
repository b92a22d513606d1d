"""The farm's HTTP API (aiohttp), on 127.0.0.1 by default.

Every request carries the farm's token (``Authorization: Bearer <token>``; ``ROOT/token`` holds it,
readable by its owner only); without it the answer is 401. Requests that change something are
POSTs with a JSON body, handed to the farm's main thread (``Farm.ask``); reads answer from the
snapshot the farm publishes after each pass. A refusal is a 4xx with ``{"error": "..."}`` naming
what to change.

    GET  /api/status                   the farm: groups, queue depth, log, every batch
    GET  /api/batches                  the batches, newest last
    POST /api/batches                  submit {request, owner, priority} -> the batch
    GET  /api/batches/{id}             one batch (state, counts, exit code once ended)
    GET  /api/batches/{id}/log         its run.log from ?offset=N -> {text, offset}
    POST /api/batches/{id}/pause       /unpause  /cancel {job?}  /retry  /priority {priority}
    POST /api/stop                     stop the farm (running jobs go back to pending)

The web monitor's page (``GET /``, no token: it holds no data) and its routes are in ``monitor.py``.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from pan2render.runner.farm import monitor
from pan2render.runner.farm.queue import QueueError
from pan2render.runner.farm.service import Farm, FarmRequestError
from pan2render.runner.serve.progress import RUN_LOG_NAME
from pan2render.runner.serve.session import BatchRequest

LOG_CHUNK = 256 << 10  # most bytes of a run log one request returns
ASK_TIMEOUT_S = 60.0  # a request the main thread has not answered by then is reported as such

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class RunningApi:
    url: str
    stop: Callable[[], None]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status=status)


def make_app(farm: Farm, *, token: str) -> web.Application:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if monitor.is_public(request):
            return await handler(request)
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not given or not hmac.compare_digest(given, token):
            return _error(401, f"this farm needs its token: send `Authorization: Bearer <token>` with the token "
                               f"in {farm.root / 'token'} (readable by the farm's owner)")
        return await handler(request)

    async def ask(fn: Callable[[], Any]) -> web.Response:
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(farm.ask(fn)), ASK_TIMEOUT_S)
        except (FarmRequestError, QueueError) as e:
            return _error(e.status if isinstance(e, FarmRequestError) else 409, str(e))
        except (KeyError, ValueError, TypeError) as e:
            return _error(400, f"bad request: {type(e).__name__}: {e}")
        except asyncio.TimeoutError:
            return _error(503, f"the farm did not answer within {ASK_TIMEOUT_S:.0f} s (see its log)")
        return _json(result)

    async def body(request: web.Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(text='{"error": "the body must be a JSON object"}',
                                     content_type="application/json")
        return data

    async def status(request: web.Request) -> web.Response:
        return _json(farm.snapshot())

    async def batches(request: web.Request) -> web.Response:
        return _json(farm.snapshot().get("batches", []))

    async def submit(request: web.Request) -> web.Response:
        data = await body(request)
        req = BatchRequest.from_json(data["request"])
        owner, priority = str(data.get("owner") or "unknown"), int(data.get("priority", 0))
        preempt = bool(data.get("preempt"))
        return await ask(lambda: farm.submit(req, owner=owner, priority=priority, preempt=preempt))

    async def one(request: web.Request) -> web.Response:
        batch_id = request.match_info["id"]
        return await ask(lambda: farm.describe(batch_id))

    async def log(request: web.Request) -> web.Response:
        batch_id = request.match_info["id"]
        try:
            offset = max(0, int(request.query.get("offset", "0")))
        except ValueError:
            return _error(400, "offset must be an integer")
        described = await asyncio.wrap_future(farm.ask(lambda: farm.describe(batch_id)))
        path = Path(described["out_dir"]) / RUN_LOG_NAME
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read(LOG_CHUNK)
        except FileNotFoundError:
            chunk = b""
        cut = chunk.rfind(b"\n") + 1  # whole lines only: the next request starts at a line
        return _json({"text": chunk[:cut].decode("utf-8", "replace"), "offset": offset + cut,
                      "batch": described})

    def action(name: str) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            batch_id = request.match_info["id"]
            data = await body(request) if request.can_read_body else {}
            if name == "pause":
                return await ask(lambda: farm.pause(batch_id, paused=True))
            if name == "unpause":
                return await ask(lambda: farm.pause(batch_id, paused=False))
            if name == "cancel":
                job = data.get("job")
                return await ask(lambda: farm.cancel(batch_id, job=None if job is None else str(job)))
            if name == "retry":
                return await ask(lambda: farm.retry(batch_id))
            priority = int(data["priority"])
            return await ask(lambda: farm.set_priority(batch_id, priority))
        return handle

    async def stop(request: web.Request) -> web.Response:
        farm.stop()
        return _json({"stopping": True})

    app = web.Application(middlewares=[monitor.guard, auth], client_max_size=256 << 20)
    monitor.add_routes(app, farm, ask_timeout_s=ASK_TIMEOUT_S)
    app.add_routes([
        web.get("/api/status", status),
        web.get("/api/batches", batches),
        web.post("/api/batches", submit),
        web.get("/api/batches/{id}", one),
        web.get("/api/batches/{id}/log", log),
        *(web.post(f"/api/batches/{{id}}/{name}", action(name))
          for name in ("pause", "unpause", "cancel", "retry", "priority")),
        web.post("/api/stop", stop),
    ])
    return app


def start_api(farm: Farm, *, token: str, host: str, port: int) -> RunningApi:
    """Serve the API on a thread of its own; returns once it listens (``port`` 0: a free one)."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(farm, token=token), access_log=None)
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
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host  # naming, not binding
    url = f"http://{shown}:{where['port']}"

    def stop() -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    return RunningApi(url=url, stop=stop)
