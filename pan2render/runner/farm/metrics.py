"""The farm watched with the tools operators already run, on the farm's API (``api.make_app``):

    GET /metrics    the pan2render_* families in Prometheus's text format (prometheus_client)
    GET /healthz    200 while the process answers
    GET /readyz     200 when the farm can take work, else 503 with the reasons (JSON)

What /metrics counts comes from the records (``serve/metrics.py``): the queue's rows and the
ledgers of the folders it holds, read off the main thread, at most every REFRESH_S, and a folder
whose batches all ended is read once until its rows change, so a scrape never walks every ledger.
Only the API's requests (``pan2render_api_requests_total``) are counted in memory, since the
process started. What the loop holds now (GPU groups, the cluster's GPUs) comes from its snapshot.

Access: the three routes answer without a token on a loopback farm (a browser page reaching it
through a rebound name is refused, as the monitor's POSTs are), and anywhere to the token in
``--metrics-token-file`` (which opens nothing else); otherwise they take a user's token as every
route does.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from pan2render.jobs.ledger import JobState
from pan2render.runner.farm import monitor
from pan2render.runner.farm.http import Handler, route
from pan2render.runner.farm.queue import BatchState, FarmQueue, QueuedBatch
from pan2render.runner.farm.users import MAX_TOKEN_LENGTH
from pan2render.runner.serve.config import SettingError
from pan2render.runner.serve.metrics import (
    GPUS,
    GROUPS,
    LOADING,
    QUEUE_DEPTH,
    REFRESH_S,
    START_TIME,
    Family,
    FolderTally,
    LedgerCounts,
    counter,
    gauge,
    group_states,
    ledger_families,
)

if TYPE_CHECKING:
    from pan2render.runner.farm.service import Farm

ROUTES = ("/metrics", "/healthz", "/readyz")
LOOP_STALE_S = 60.0  # a main loop that has not published its snapshot for this long is not ready
BATCHES = Family("batches", "gauge", "Batches in the farm's queue by state and owner.", ("state", "owner"))
API_REQUESTS = Family("api_requests", "counter", "Requests the farm's API answered, by route and status, since "
                      "the farm started (restarts from zero).", ("route", "status"))


class FarmCollector:
    """The families of a farm: its queue and ledgers (cached REFRESH_S), its snapshot, its API."""

    def __init__(self, farm: Farm):
        self.farm = farm
        self._lock = threading.Lock()
        self._queue: FarmQueue | None = None
        self._folders: dict[str, FolderTally] = {}
        self._read: dict[str, tuple[Any, ...]] = {}  # folder -> its rows when its ledger was last read
        self._rows: list[QueuedBatch] = []
        self._read_at = float("-inf")
        self._records_text = b""
        self._requests: Counter[tuple[str, str]] = Counter()
        self._requests_lock = threading.Lock()

    def count_request(self, route: str, status: int) -> None:
        with self._requests_lock:
            self._requests[(route, str(status))] += 1

    def exposition(self) -> bytes:
        """Every family in Prometheus's text format: the records' as written at the last refresh (at
        most REFRESH_S old), what the loop holds and the API's counts as they are now."""
        with self._lock:
            if time.monotonic() - self._read_at >= REFRESH_S:
                self._refresh()
                self._read_at = time.monotonic()
                self._records_text = generate_latest(_Families(self._from_records(time.time())))
            records = self._records_text
        return records + generate_latest(_Families(self._live()))

    def _live(self) -> list[Metric]:
        snap = self.farm.snapshot()
        loading = {r["group"] for r in snap.get("running", []) if r.get("stage") == LOADING}
        with self._requests_lock:
            requests = dict(self._requests)
        return [gauge(GROUPS, group_states((g["state"], g["id"] in loading) for g in snap.get("groups", []))),
                gauge(GPUS, snap.get("gpus", 0)), gauge(START_TIME, self.farm.started_at),
                counter(API_REQUESTS, requests)]

    def _from_records(self, now: float) -> list[Metric]:
        """The families the queue and the ledgers give, made once per refresh: a scrape between two
        refreshes costs the few live families alone, however many folders the farm holds."""
        counts = LedgerCounts()
        for tally in self._folders.values():
            counts.add(tally.counts(now))
        owners = sorted({r.owner for r in self._rows})  # (every state of each owner, zero or not)
        batches = Counter((r.state.value, r.owner) for r in self._rows)
        return [*ledger_families(counts, now=now),
                gauge(BATCHES, {(s.value, o): batches.get((s.value, o), 0) for s in BatchState for o in owners}),
                gauge(QUEUE_DEPTH, _waiting(self._rows, self._folders, owners))]

    def _refresh(self) -> None:
        """The queue's rows, and the ledger of each folder whose rows changed or whose batches have
        not all ended (an ended batch's ledger changes no more)."""
        if self._queue is None:
            self._queue = FarmQueue(self.farm.root, readonly=True)
        self._rows = self._queue.batches()
        by_folder: dict[str, list[QueuedBatch]] = {}
        for r in self._rows:
            by_folder.setdefault(r.out_dir, []).append(r)
        for out_dir, rows in by_folder.items():
            seen = tuple((r.id, r.state, r.updated_at) for r in rows)
            job_ids = frozenset(j for r in rows for j in r.job_ids)
            tally = self._folders.get(out_dir)
            if tally is None or tally.job_ids != job_ids:  # (a batch added into it: read from its start)
                tally = self._folders[out_dir] = FolderTally(Path(out_dir), job_ids)
            elif self._read.get(out_dir) == seen and all(r.state.ended for r in rows):
                continue
            tally.refresh()
            self._read[out_dir] = seen
        for gone in set(self._folders) - set(by_folder):  # (the queue repaired empty)
            del self._folders[gone]

    def close(self) -> None:
        with self._lock:
            if self._queue is not None:
                self._queue.close()
                self._queue = None


class _Families(Collector):
    """Families already made, for prometheus_client's writer."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def _waiting(rows: Iterable[QueuedBatch], folders: dict[str, FolderTally],
             owners: Iterable[str]) -> dict[tuple[str, ...], float]:
    """Pending jobs of the batches not ended, by the batch's state and owner (each owner's every
    state not ended, zero or not)."""
    out: Counter[tuple[str, str]] = Counter({(s.value, o): 0 for s in BatchState if not s.ended for o in owners})
    for r in rows:
        if not r.state.ended and (tally := folders.get(r.out_dir)) is not None:
            out[(r.state.value, r.owner)] += sum(tally.states.get(j) is JobState.PENDING for j in r.job_ids)
    return dict(out)


# ---------------------------------------------------------------------------------------- access
def read_metrics_token(path: Path) -> str:
    """The token in ``path``: a regular file of this user's that no one else may read, holding one
    printable token; else SettingError naming what to change."""
    flag = f"--metrics-token-file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SettingError(f"{flag}: cannot be opened ({e.strerror}; a link is refused): name a file of "
                           f"yours holding the token") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SettingError(f"{flag}: not a regular file")
        if st.st_uid != os.getuid():
            raise SettingError(f"{flag}: belongs to uid {st.st_uid}, not to you (uid {os.getuid()})")
        if st.st_mode & 0o077:
            raise SettingError(f"{flag}: may be read by others (mode {stat.S_IMODE(st.st_mode):o}): anyone who "
                               f"reads it can read the farm's metrics; `chmod 600 {path}`")
        token = f.read(MAX_TOKEN_LENGTH + 2).decode("ascii", errors="replace").strip()
    if not token or len(token) > MAX_TOKEN_LENGTH or not token.isprintable() or " " in token:
        raise SettingError(f"{flag}: must hold one token (printable ASCII, no spaces, 1 to {MAX_TOKEN_LENGTH} "
                           f"characters), e.g. `openssl rand -hex 32 > {path}`")
    return token


def _loopback_host(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# ---------------------------------------------------------------------------------------- the routes
class MetricsApi:
    """The three routes, the access rule the API's authentication asks (:meth:`open_to`), and the
    middleware that counts the API's requests."""

    def __init__(self, farm: Farm):
        self.farm = farm
        path = farm.config.metrics_token_file
        self._token = None if path is None else read_metrics_token(path).encode()
        self._open = _loopback_host(farm.config.host)
        self.collector = FarmCollector(farm)

    def open_to(self, request: web.Request) -> bool:
        """May ``request`` read one of these routes without a user's token? With the metrics
        token, yes; on a loopback farm, yes unless it comes through a name that is not loopback."""
        if request.method not in ("GET", "HEAD") or request.path not in ROUTES:
            return False
        header = request.headers.get("Authorization", "")
        given = header.removeprefix("Bearer ").strip().encode() if header.isascii() else b""
        if self._token is not None and hmac.compare_digest(given, self._token):
            return True
        return self._open and not given and monitor.cross_site_refusal(request) is None

    @web.middleware
    async def count_requests(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)  # (outermost: errors are answers by now)
        resource = request.match_info.route.resource
        self.collector.count_request(resource.canonical if resource is not None else "unmatched", response.status)
        return response

    @route("GET", "/metrics")
    async def metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, self.collector.exposition)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @route("GET", "/healthz")
    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"alive": True, "pid": os.getpid(), "up_s": round(time.time() - self.farm.started_at,
                                                                                   3)})

    @route("GET", "/readyz")
    async def readyz(self, request: web.Request) -> web.Response:
        reasons = await asyncio.get_running_loop().run_in_executor(None, readiness, self.farm)
        return web.json_response({"ready": not reasons, "reason": "; ".join(reasons) or None, "reasons": reasons},
                                 status=503 if reasons else 200)


def readiness(farm: Farm) -> list[str]:
    """Why the farm cannot take work now (none: it can): its loop stalled, its cluster not
    answering, its queue not writable, every GPU held out of service."""
    snap = farm.snapshot()
    if not snap:
        return ["the farm is starting (its loop has not published its first snapshot)"]
    reasons = []
    if (age := farm.snapshot_age_s) > LOOP_STALE_S:
        reasons.append(f"the farm's loop has not published its snapshot for {age:.0f} s (see its log)")
    try:
        if (why := farm.ex.unreachable()) is not None:
            reasons.append(why)
    except Exception as e:
        reasons.append(f"{farm.ex.cluster} cannot be asked: {type(e).__name__}: {e}")
    if snap.get("write_error"):
        reasons.append(f"the queue cannot be written: {snap['write_error']}")
    held = sum(g["gpus"] for g in snap.get("groups", []) if g["state"] == "out of service")
    if snap.get("gpus") and held >= snap["gpus"]:
        reasons.append(f"every GPU ({held}) is held out of service after device faults (`pan2-render farm status`)")
    return reasons
