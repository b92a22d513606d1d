"""Requests that change something, carried from the API's thread to the farm's main thread, its one
writer, each with an id a client can look up afterwards.

The API waits for the main thread's answer a bounded time. A request it stops waiting for stays in
line and is applied in its turn (or refused), never lost and never raised into the farm's loop; the
client's 503 carries its id, and ``GET /api/requests/{id}`` says what became of it. The outcomes of
the latest :data:`REQUESTS_KEPT` requests are kept (in memory: an outcome that mattered for good,
a batch queued or cancelled, is in the queue and its ledger).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REQUESTS_KEPT = 1000


@dataclass
class Request:
    id: str
    action: str  # what it asks, for the person looking it up ("cancel b3", "submit jobs/x.yaml")
    user: str
    run: Callable[[], Any]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    at: float = field(default_factory=time.time)
    state: str = "queued"  # queued -> applied | refused
    answer: Any = None  # the result, or the refusal's message

    def outcome(self) -> dict[str, Any]:
        return {"id": self.id, "action": self.action, "user": self.user, "state": self.state, "at": self.at,
                "applied": self.state == "applied", "answer": self.answer}


class Requests:
    """The line of requests for the main thread, and the outcomes of the latest ones."""

    def __init__(self) -> None:
        self._line: queue.Queue[Request] = queue.Queue()
        self._kept: OrderedDict[str, Request] = OrderedDict()
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._arrived = threading.Event()

    def put(self, action: str, user: str, run: Callable[[], Any]) -> Request:
        """Called from the API's thread: ``run`` will run on the main thread."""
        req = Request(id=f"r{next(self._numbers)}-{secrets.token_hex(4)}", action=action, user=user, run=run)
        with self._lock:
            self._kept[req.id] = req
            while len(self._kept) > REQUESTS_KEPT:
                self._kept.popitem(last=False)
        self._line.put(req)
        self._arrived.set()
        return req

    def lookup(self, request_id: str) -> Request | None:
        with self._lock:
            return self._kept.get(request_id)

    def run_waiting(self, refused: tuple[type[BaseException], ...], *,
                    before_answers: Callable[[], None] = lambda: None) -> int:
        """On the main thread: every request in line, in order; how many ran. An exception of
        ``refused`` is the request's answer (sent back to the client); any other is the farm's bug,
        also sent back, and neither ever stops the farm's loop. ``before_answers`` runs once they
        ran and before any is answered (the farm publishes its snapshot: a client's next read shows
        what it changed)."""
        done: list[tuple[Request, Any, BaseException | None]] = []
        while True:
            try:
                req = self._line.get_nowait()
            except queue.Empty:
                break
            try:
                value = req.run()
            except Exception as e:  # sent back to the client whoever waits for it; the farm goes on
                req.state, req.answer = "refused", str(e) if isinstance(e, refused) else f"{type(e).__name__}: {e}"
                done.append((req, None, e))
            else:
                req.state, req.answer = "applied", value
                done.append((req, value, None))
        if done:
            before_answers()
        for req, value, error in done:
            _settle(req.future, value=value, error=error)
        return len(done)

    def wake(self) -> None:
        """From any thread: end the idle farm's wait now (something for its next pass arrived)."""
        self._arrived.set()

    def wait(self, timeout_s: float) -> None:
        """Block until a request is put in line or ``timeout_s`` passed: the idle farm's wait."""
        if self._arrived.wait(timeout_s):
            self._arrived.clear()


def _settle(future: concurrent.futures.Future[Any], *, value: Any = None, error: BaseException | None = None) -> None:
    """Hand the answer to whoever waits, if anyone still does: a waiter that gave up cancelled the
    future, and setting a cancelled future raises."""
    if not future.set_running_or_notify_cancel():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
