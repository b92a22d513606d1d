"""The scheduler at scale: the farm (its real scheduler, ledgers, queue, API and snapshot) serving
batches on N simulated GPUs (``pan2render/runner/cluster/simulated.py``), with API clients polling
it and the monitor's stream open.

    python scripts/bench_scale.py                                   # 8, 64, 256, 1000 GPUs x DMD, 20-step
    python scripts/bench_scale.py --gpus 64 1000 --jobs 5000 --kinds dmd
    python scripts/bench_scale.py --clock virtual --gpus 64        # deterministic; scheduler time not charged

For each kind of job (``dmd``: a 3-step DMD job, 5.6 s of GPU work; ``20step``: a 20-step guided job,
~35 s) and each GPU count: a fresh farm in this process, its API on a free port, ``--batches``
batches of ``--jobs`` jobs in all from ``--owners`` users submitted through the API (their YAML
validated by the farm), ``--clients`` clients in another process polling ``/api/batches``,
``/api/status`` and a batch of their own every ``--poll-s`` and one reading ``/api/stream``. Served
until every batch has ended. The simulated GPUs run on the ``--clock``:

- ``charged`` (default): real time, with the waits skipped: the scheduler's own work (its loop, the
  ledgers' and the queue's fsyncs, the API on its threads) takes the time it takes while the GPUs'
  calls run on; a wait for a call jumps to its end. The busy fraction counts the scheduler's speed.
- ``virtual``: time passes only in waits (deterministic); the busy fraction says what the
  scheduler's decisions cost, never how fast it makes them.
- ``wall``: real time (``--speed`` times the cost model's).

Per run: the GPUs' busy fraction (steady state: from every GPU's first call to the last sampling
sent; and the whole run), jobs per second (simulated time and wall time), the farm process's CPU
seconds per job (all threads, and the main thread: the scheduler's loop and the snapshot; and its
report writer's, a child process), API
latency p50/p99, SQLite commits per job (ledgers, their backups, the queue) and fsyncs per job
(Python's ``os.fsync`` calls plus SQLite's, 4 fdatasync per commit in the rollback journal's FULL
mode, counted with strace), RSS growth per job. Results: OUT/bench_scale.json and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from pan2render.client import FarmClient
from pan2render.jobs import store
from pan2render.jobs.ledger import JobState, Ledger
from pan2render.runner.cluster.sim_model import ChargedClock, Clock, VirtualClock, WallClock
from pan2render.runner.cluster.simulated import SimulatedExecutor
from pan2render.runner.farm.api import start_api
from pan2render.runner.farm.config import FarmConfig
from pan2render.runner.farm.folder import ensure_token
from pan2render.runner.farm.intake import Roots
from pan2render.runner.farm.queue import FarmQueue
from pan2render.runner.farm.service import Farm
from pan2render.runner.farm.users import Users

KINDS = {"dmd": {"sampler": "dmd", "guidance": 1.0, "timesteps": [1000, 757, 522]},
         "20step": {"steps": 20, "guidance": 2.5}}
SQLITE_FSYNCS_PER_COMMIT = 4  # journal_mode=DELETE, synchronous=FULL: strace counts 4 fdatasync a commit
ENDED = {"done", "failed", "cancelled", "stopped"}


# ---------------------------------------------------------------------- counting the durable writes
class Counts:
    """SQLite commits (all; the queue's; the ledger backups' job by job; the rest are the
    ledgers'), whole-file backups and os.fsync calls, counted by wrapping ``store.transaction``
    and ``store.Changes._commit`` (every commit of a ledger, a ledger's backup or the queue goes
    through one), ``FarmQueue._tx``, ``Ledger.backup_job``, ``store.backup`` and ``os.fsync``.
    SQLite's own fsyncs are 4 a commit."""

    def __init__(self) -> None:
        self.commits: Counter[str] = Counter()
        self.backups = 0
        self.fsyncs = 0
        self._lock = threading.Lock()

    def _count(self, kind: str) -> None:
        with self._lock:
            self.commits[kind] += 1

    def install(self) -> None:
        tx, backup, fsync = store.transaction, store.backup, os.fsync
        queue_tx, backup_job, group_commit = FarmQueue._tx, Ledger.backup_job, store.Changes._commit

        @contextmanager
        def counted_tx(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
            with tx(conn) as c:
                yield c
            self._count("all")

        def counted_group_commit(changes: store.Changes) -> None:
            if changes._conn.in_transaction:  # (a group that changed nothing commits nothing)
                self._count("all")
            group_commit(changes)

        def counted_queue_tx(queue: FarmQueue) -> Any:
            self._count("queue")
            return queue_tx(queue)

        def counted_backup_job(ledger: Ledger, job_id: str) -> None:
            self._count("ledger backup")
            backup_job(ledger, job_id)

        FarmQueue._tx, Ledger.backup_job = counted_queue_tx, counted_backup_job  # type: ignore[method-assign]
        store.Changes._commit = counted_group_commit  # type: ignore[method-assign]

        def counted_backup(conn: sqlite3.Connection, dest: Path) -> Path:
            with self._lock:
                self.backups += 1
            return backup(conn, dest)

        def counted_fsync(fd: int) -> None:
            with self._lock:
                self.fsyncs += 1
            fsync(fd)

        store.transaction, store.backup, os.fsync = counted_tx, counted_backup, counted_fsync  # type: ignore[assignment]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            commits = dict(self.commits)
            commits["ledger"] = commits.get("all", 0) - commits.get("queue", 0) - commits.get("ledger backup", 0)
            return {"commits": commits, "backups": self.backups, "fsyncs": self.fsyncs}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_per_job(rss: list[tuple[int, float]], jobs: int) -> float:
    """KB of RSS per job served, from when a tenth of the jobs were done (the imports, the first
    batches' set-up and the allocator's first arenas are behind) to the end."""
    base = next(((n, mb) for n, mb in rss if n >= jobs // 10), rss[0])
    return 1024 * (rss[-1][1] - base[1]) / max(1, rss[-1][0] - base[0])


# ---------------------------------------------------------------------- one run
def batch_text(kind: str, index: int, jobs: int) -> str:
    doc = {"model": "tiny", "preset": "tiny-preview", "defaults": {"negative_prompt": "", **KINDS[kind]},
           "jobs": [{"name": f"b{index:03d}j{i:05d}", "prompt": f"batch {index} clip {i}", "seed": i}
                    for i in range(jobs)]}
    return yaml.safe_dump(doc, sort_keys=False)


def make_clock(args: argparse.Namespace) -> Clock:
    return {"charged": ChargedClock, "virtual": VirtualClock}.get(args.clock, lambda: WallClock(speed=args.speed))()


def run_one(gpus: int, kind: str, args: argparse.Namespace, counts: Counts) -> dict[str, Any]:
    base = Path(args.root) / f"{kind}-{gpus}"
    shutil.rmtree(base, ignore_errors=True)
    (base / "farm").mkdir(parents=True, mode=0o700)
    full, rest = divmod(gpus, args.gpus_per_node)
    nodes = [args.gpus_per_node] * full + ([rest] if rest else [])
    ex = SimulatedExecutor(nodes=nodes, clock=make_clock(args), seed=args.seed)
    farm = Farm(FarmConfig(root=base / "farm"), ex, log=lambda text: None)
    token = ensure_token(base / "farm")
    owners = [f"user{i}" for i in range(args.owners)]
    tokens = {name: Users(base / "farm").add(name) for name in owners}
    api = start_api(farm, users=Users(base / "farm", admin_token=token), roots=Roots.of([base], [base]),
                    host="127.0.0.1", port=0, say=lambda text: None)
    farm.url = api.url
    result_file = base / "clients.json"
    clients = subprocess.Popen([sys.executable, __file__, "--clients-url", api.url, "--clients", str(args.clients),
                                "--tokens", ",".join(tokens.values()), "--poll-s", str(args.poll_s),
                                "--clients-result", str(result_file)], stdin=subprocess.PIPE)
    per_batch = [args.jobs // args.batches + (i < args.jobs % args.batches) for i in range(args.batches)]
    submitted: list[float] = []
    submit_s: list[float] = []
    rss: list[tuple[int, float]] = [(0, rss_mb())]

    def submit() -> None:
        for i, n in enumerate(per_batch):
            client = FarmClient(api.url, tokens[owners[i % len(owners)]])
            t = time.perf_counter()
            client.submit_text(batch_text(kind, i, n), out=base / f"batch{i:03d}", name=f"b{i:03d}.yaml", base=base)
            submit_s.append(time.perf_counter() - t)
        submitted.append(time.perf_counter())

    def watch() -> None:
        while True:
            time.sleep(0.5)
            rss.append((ex.record.calls["CollectCall"], rss_mb()))
            snap = farm.snapshot()
            if submitted and snap and not [b for b in snap.get("batches", []) if b["state"] not in ENDED]:
                farm.stop()
                return

    before = counts.snapshot()
    wall0, cpu0, main0 = time.perf_counter(), time.process_time(), time.thread_time()
    threading.Thread(target=submit, name="submitter", daemon=True).start()
    watcher = threading.Thread(target=watch, name="watcher", daemon=True)
    watcher.start()
    farm.run()  # until the watcher stops it: every batch ended
    wall, cpu, main = time.perf_counter() - wall0, time.process_time() - cpu0, time.thread_time() - main0
    after = counts.snapshot()
    rss.append((ex.record.calls["CollectCall"], rss_mb()))
    clients.stdin.close()  # type: ignore[union-attr]
    clients.wait(timeout=60)
    api.stop()
    api_stats = json.loads(result_file.read_text()) if result_file.exists() else {}
    states: Counter[str] = Counter()
    for i in range(args.batches):
        led = Ledger.open_readonly(base / f"batch{i:03d}")
        states.update(j.state.value for j in led.jobs())
        led.close()
    jobs = sum(per_batch)
    commits = {k: after["commits"].get(k, 0) - before["commits"].get(k, 0) for k in after["commits"] if k != "all"}
    sim = ex.record.summary()
    out = {
        "gpus": gpus, "kind": kind, "jobs": jobs, "batches": args.batches, "clock": args.clock,
        "done": states[JobState.DONE.value], "failed": states[JobState.FAILED.value], "wall_s": wall,
        "sim_makespan_s": sim["makespan_s"], "busy_steady": sim["busy_steady"], "busy_whole": sim["busy_whole"],
        "jobs_per_s_sim": jobs / sim["makespan_s"], "jobs_per_s_wall": jobs / wall,
        "cpu_ms_per_job": 1000 * cpu / jobs, "main_cpu_ms_per_job": 1000 * main / jobs,
        "report_child_cpu_ms_per_job": 1000 * farm.reports.child_cpu_s / jobs,
        "commits_per_job": {k: v / jobs for k, v in sorted(commits.items())},
        "backups_per_job": (after["backups"] - before["backups"]) / jobs,
        "fsyncs_per_job": (after["fsyncs"] - before["fsyncs"]
                           + SQLITE_FSYNCS_PER_COMMIT * sum(commits.values())) / jobs,
        "rss_mb": {"start": rss[0][1], "end": rss[-1][1]}, "rss_kb_per_job": rss_per_job(rss, jobs),
        "rss_curve": rss[:: max(1, len(rss) // 12)] + rss[-1:],
        "submit_s": {"p50": statistics.median(submit_s), "max": max(submit_s)} if submit_s else None,
        "api": api_stats, "calls": sim["calls"],
    }
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return out


# ---------------------------------------------------------------------- the clients (another process)
def run_clients(url: str, tokens: list[str], n: int, poll_s: float, result: Path) -> None:
    """``n`` clients polling the API, one reading the monitor's stream, until stdin closes; then
    the latencies (p50, p99 per route and in all) to ``result``."""
    import aiohttp

    latencies: dict[str, list[float]] = {}
    errors: Counter[str] = Counter()
    stream_events = [0]

    async def timed(session: aiohttp.ClientSession, route: str, path: str, token: str) -> Any:
        t = time.perf_counter()
        try:
            async with session.get(url + path, headers={"Authorization": f"Bearer {token}"}) as r:
                body = await r.read()
                if r.status != 200:
                    errors[f"{route} {r.status}"] += 1
                    return None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            errors[f"{route} {type(e).__name__}"] += 1
            return None
        latencies.setdefault(route, []).append(time.perf_counter() - t)
        return json.loads(body)

    async def client(i: int, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        token, mine = tokens[i % len(tokens)], None
        await asyncio.sleep(poll_s * i / n)  # spread over the period
        while not stop.is_set():
            listed = await timed(session, "GET /api/batches", "/api/batches", token)
            await timed(session, "GET /api/status", "/api/status", token)
            if mine is None and listed:
                mine = next((b["id"] for b in listed[i % len(listed):] + listed), None)
            if mine is not None:
                await timed(session, "GET /api/batches/{id}", f"/api/batches/{mine}", token)
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except asyncio.TimeoutError:
                pass

    async def stream(session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        try:
            async with session.get(url + "/api/stream", headers={"Authorization": f"Bearer {tokens[0]}"},
                                   timeout=aiohttp.ClientTimeout(total=None)) as r:
                async for line in r.content:
                    if line.startswith(b"event: snapshot"):
                        stream_events[0] += 1
                    if stop.is_set():
                        return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            errors["stream"] += 1

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.buffer.read1(1) else None)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            tasks = [asyncio.create_task(client(i, session, stop)) for i in range(n)]
            streamer = asyncio.create_task(stream(session, stop))
            await stop.wait()
            await asyncio.gather(*tasks)
            streamer.cancel()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(main())
    every = [x for v in latencies.values() for x in v]

    def pct(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        if not xs:
            return {"n": 0}
        return {"n": len(xs), "p50_ms": 1000 * xs[len(xs) // 2],
                "p99_ms": 1000 * xs[min(len(xs) - 1, int(len(xs) * 0.99))], "max_ms": 1000 * xs[-1]}

    result.write_text(json.dumps({"all": pct(every), **{k: pct(v) for k, v in latencies.items()},
                                  "errors": dict(errors), "stream_events": stream_events[0]}))


# ---------------------------------------------------------------------- the table
def table(results: list[dict[str, Any]]) -> str:
    head = ("| jobs | GPUs | busy (steady / whole) | jobs/s (sim / wall) | CPU ms/job (all / main / report child) "
            "| API p50 / p99 ms | commits/job (ledger+backup / queue) | fsyncs/job | RSS KB/job | wall s |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        c = r["commits_per_job"]
        api = r["api"].get("all", {})
        busy = "/".join("-" if x is None else f"{x:.3f}" for x in (r["busy_steady"], r["busy_whole"]))
        rows.append(f"| {r['jobs']} {r['kind']} | {r['gpus']} | {busy} "
                    f"| {r['jobs_per_s_sim']:.1f} / {r['jobs_per_s_wall']:.1f} "
                    f"| {r['cpu_ms_per_job']:.2f} / {r['main_cpu_ms_per_job']:.2f} "
                    f"/ {r['report_child_cpu_ms_per_job']:.2f} "
                    f"| {api.get('p50_ms', float('nan')):.1f} / {api.get('p99_ms', float('nan')):.1f} "
                    f"| {c.get('ledger', 0) + c.get('ledger backup', 0):.2f} / {c.get('queue', 0):.3f} "
                    f"| {r['fsyncs_per_job']:.1f} | {r['rss_kb_per_job']:.1f} | {r['wall_s']:.0f} |")
    return "\n".join(rows)


def curve(results: list[dict[str, Any]], width: int = 40) -> str:
    """The farm process's CPU per job and the GPUs' busy fraction against the GPUs, as bars (no
    plotting library here: docs/performance.md keeps the text)."""
    top = max(r["cpu_ms_per_job"] for r in results)
    lines = [f"{'':16} CPU ms/job (#: main thread, +: the API's and other threads)   busy (steady, else whole)"]
    for r in results:
        main, rest = r["main_cpu_ms_per_job"], r["cpu_ms_per_job"] - r["main_cpu_ms_per_job"]
        bar = "#" * round(width * main / top) + "+" * round(width * rest / top)
        busy = r["busy_steady"] if r["busy_steady"] is not None else r["busy_whole"]
        lines.append(f"{r['kind']:>6} {r['gpus']:>4} GPUs {bar:<{width}} {r['cpu_ms_per_job']:5.1f}  "
                     f"{'=' * round(20 * busy):<20} {busy:.2f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256, 1000])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--jobs", type=int, default=20000, help="jobs in all, over --batches batches")
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--owners", type=int, default=5)
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--poll-s", type=float, default=1.0)
    p.add_argument("--clock", choices=["charged", "virtual", "wall"], default="charged")
    p.add_argument("--speed", type=float, default=1.0, help="--clock wall: this many times the cost model's speed")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir(),
                   help="where the farm and its batches' folders go (default: tmpfs, so that the disk's fsyncs "
                        "do not hide the scheduler's CPU; they are counted all the same)")
    p.add_argument("--keep", action="store_true", help="keep each run's folders")
    p.add_argument("--out", type=Path, default=Path("bench-scale-out"))
    p.add_argument("--clients-url", help=argparse.SUPPRESS)
    p.add_argument("--tokens", help=argparse.SUPPRESS)
    p.add_argument("--clients-result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.clients_url:
        return run_clients(args.clients_url, args.tokens.split(","), args.clients, args.poll_s, args.clients_result)
    args.root = tempfile.mkdtemp(prefix="pan2-bench-scale-", dir=args.root)
    args.out.mkdir(parents=True, exist_ok=True)
    counts = Counts()
    counts.install()
    results = []
    try:
        for kind in args.kinds:
            for gpus in args.gpus:
                r = run_one(gpus, kind, args, counts)
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("rss_curve",)}), flush=True)
                (args.out / "bench_scale.json").write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(args.root, ignore_errors=True)
    print(table(results))
    print(curve(results))


if __name__ == "__main__":
    main()
