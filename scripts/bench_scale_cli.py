"""How the commands that read or record a whole batch scale with its number of jobs, on the CPU.

    python scripts/bench_scale_cli.py                          # 1,000, 5,000 and 20,000 jobs
    python scripts/bench_scale_cli.py --jobs 1000,4000 --limit 120 --json scale.json

For each size it writes a batch of the tiny model (``preset: tiny-preview``, 4 prompts x a sweep
over ``seed``) into a temp folder and times, in this process, one after the other:

- ``validate``: ``pan2-render validate BATCH`` (``cli.main``, its output thrown away);
- ``dry-run``: ``pan2-render run BATCH --out DIR --dry-run``;
- ``record``: ``BatchSession.record`` into an empty folder, what ``run`` and a farm's ``submit``
  do before any job starts (the ledger's one transaction, its backup, the batch's copy, the checks);
- ``status``: ``pan2-render status DIR`` of that folder made to look served: a quarter of the jobs
  done (stage seconds, a group load on the CPU, a video file each), 8 running, the folder's lock
  held, so the ETA is planned from its history;
- ``re-serve``: what a farm does for a batch when it starts again (``Farm.resume_unfinished``):
  its model folders checked, ``BatchSession.reopen``, ``prepare`` (8 interrupted jobs back to
  pending, 1% failed ones revived), and ``Scheduler.serve`` queueing every pending job.

A measurement past ``--limit`` seconds is stopped (SIGALRM) and shown as ``>LIMIT``; with
``--repeat N`` each size is measured N times and the quickest kept. Figures: docs/performance.md,
"Validation and status at scale".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import signal
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import LEDGER_NAME, FolderLock, JobState, Ledger
from pan2render.jobs.overrides import Overrides
from pan2render.runner.cli.main import main as cli
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.jobflow import BatchFlow
from pan2render.runner.serve.progress import RunProgress
from pan2render.runner.serve.scheduler import Scheduler, ServedBatch
from pan2render.runner.serve.session import BatchRequest, BatchSession, model_folder_problems
from pan2render.runner.serve.steps import PAN2_FLOW

PATHS = ("validate", "dry-run", "record", "status", "re-serve")
PROMPTS = ("a red fox trots through fresh snow at dawn", "fishing boats rock in a harbour at dusk",
           "a paper lantern drifts up into a starry night", "rain runs down a window of a night train")
RUNNING, FAILED_SHARE, DONE_SHARE = 8, 0.01, 0.25


class OverLimit(BaseException):
    """A measurement ran past --limit (not an Exception: the CLI turns those into an exit code)."""


def batch_file(folder: Path, n: int) -> Path:
    """A batch of ``n`` jobs (a multiple of 4): 4 prompts x ``n / 4`` seeds."""
    seeds = ", ".join(str(s) for s in range(n // len(PROMPTS)))
    jobs = "\n".join(f"  - {{name: p{i}, prompt: \"{p}\"}}" for i, p in enumerate(PROMPTS))
    path = folder / f"batch-{n}.yaml"
    path.write_text(f"model: tiny\npreset: tiny-preview\njobs:\n{jobs}\nsweep:\n  seed: [{seeds}]\n")
    return path


class _StubExecutor:
    """What ``Scheduler.serve`` asks of an executor (no group is made: nothing is dispatched)."""

    starts_in_background = False

    def total_gpus(self) -> int:
        return 8

    def max_group_size(self) -> int:
        return 8


def _sql(out: Path, statements: list[tuple[str, list[tuple[Any, ...]]]]) -> None:
    """The bench's own edits of a recorded ledger (the states a served batch would have), in one
    transaction on the file."""
    conn = sqlite3.connect(out / LEDGER_NAME, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for sql, rows in statements:
            conn.executemany(sql, rows)
        conn.execute("COMMIT")
    finally:
        conn.close()


def _ids(out: Path) -> list[str]:
    conn = sqlite3.connect(out / LEDGER_NAME)
    try:
        return [r[0] for r in conn.execute("SELECT id FROM jobs ORDER BY position")]
    finally:
        conn.close()


def make_served(out: Path) -> None:
    """A quarter of the jobs done (stage seconds, a 1-byte video each), 8 running, the rest
    pending; a run on 2 logical GPUs of this CPU recorded."""
    ids = _ids(out)
    done, running = ids[:int(len(ids) * DONE_SHARE)], ids[int(len(ids) * DONE_SHARE):][:RUNNING]
    now = time.time()
    for jid in done:
        (out / jid).mkdir(exist_ok=True)
        (out / jid / "video.mp4").write_bytes(b"v")
    seconds = {"conditioning": 0.03, "sampling": 0.5, "decode": 0.05, "encode": 0.02}
    _sql(out, [
        ("UPDATE jobs SET state = 'done', attempts = 1 WHERE id = ?", [(j,) for j in done]),
        ("UPDATE stages SET state = 'done', seconds = ? WHERE job_id = ? AND stage = ?",
         [(s, j, stage) for j in done for stage, s in seconds.items()]),
        ("UPDATE stages SET artifact = ?, size = 1 WHERE job_id = ? AND stage = 'encode'",
         [(f"{j}/video.mp4", j) for j in done]),
        ("UPDATE jobs SET state = 'running', attempts = 1 WHERE id = ?", [(j,) for j in running]),
        ("INSERT INTO events (at, job_id, kind, detail) VALUES (?, NULL, 'group-load', ?)",
         [(now, "group 1: model tiny on device cpu, 1.2 s")]),
        ("INSERT OR REPLACE INTO meta VALUES ('runs', ?)",
         [(json.dumps([{"command": "run", "started": now - 600, "pid": os.getpid(), "host": "bench",
                        "flags": [], "gpus": 2}]),)]),
    ])


def make_interrupted(out: Path) -> None:
    """A farm killed mid-batch: 8 jobs left running, 1% failed, the rest pending."""
    ids = _ids(out)
    failed = ids[RUNNING:][:max(1, int(len(ids) * FAILED_SHARE))]
    _sql(out, [("UPDATE jobs SET state = 'running', attempts = 1 WHERE id = ?", [(j,) for j in ids[:RUNNING]]),
               ("UPDATE jobs SET state = 'failed', attempts = 3, retries_left = 0, error = 'x' WHERE id = ?",
                [(j,) for j in failed])])


@contextlib.contextmanager
def limit(seconds: float) -> Iterator[None]:
    def expired(*_: object) -> None:
        raise OverLimit

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def timed(fn: Callable[[], object], *, limit_s: float) -> float | None:
    """Seconds ``fn`` took (stdout thrown away), None past the limit."""
    t0 = time.perf_counter()
    try:
        with limit(limit_s), contextlib.redirect_stdout(io.StringIO()):
            fn()
    except OverLimit:
        return None
    return time.perf_counter() - t0


def _cli(*argv: str) -> None:
    code = cli(list(argv))
    if code not in (0, 4):  # status: 4 = not finished
        raise SystemExit(f"pan2-render {' '.join(argv)} exited {code}")


def record(batch_path: Path, out: Path) -> None:
    batch = load_batch(batch_path, check_model=False)
    request = BatchRequest(out_dir=out.absolute(), batch=batch, overrides=Overrides())
    BatchSession.record(request, stream=None, title="bench record").close()


def reserve(out: Path) -> None:
    """What ``Farm.resume_unfinished`` and ``Farm.serve`` do for one batch: its model folders
    checked (``Farm.broken_model_folders``), the session reopened, prepared and served."""
    ledger = Ledger.open_readonly(out)
    try:
        model_folder_problems([j.spec for j in ledger.jobs() if j.state is not JobState.DONE])
    finally:
        ledger.close()
    session = BatchSession.reopen(out, stream=None, title="bench re-serve ({batch})")
    try:
        session.prepare(retries=2, revive_cancelled=False)
        session.note_run(command="farm", gpus=8)
        scheduler = Scheduler(executor=_StubExecutor(), config=ServingConfig())  # type: ignore[arg-type]
        progress = RunProgress(log=session.log, live=False)
        holder: dict[str, ServedBatch] = {}
        flow = BatchFlow(out_dir=out, ledger=session.ledger, flow=PAN2_FLOW, say=session.log.line,
                         upcoming=lambda: scheduler.upcoming(holder["batch"]), models_per_group=1)
        holder["batch"] = batch = ServedBatch(flow=flow, progress=progress)
        jobs = session.ledger.jobs(session.job_ids)
        progress.begin(total=len(jobs), done=0, failed=0)
        scheduler.serve(batch, session.job_ids)
        assert len(scheduler.pending(batch)) == len(jobs), "every job of the re-served batch is queued"
    finally:
        session.close()


def bench(n: int, work: Path, paths: tuple[str, ...], limit_s: float) -> dict[str, float | None]:
    folder = work / f"n{n}"
    folder.mkdir(parents=True)
    batch = batch_file(folder, n)
    out, again = folder / "out", folder / "again"
    row: dict[str, float | None] = {}
    if "validate" in paths:
        row["validate"] = timed(lambda: _cli("validate", str(batch)), limit_s=limit_s)
    if "dry-run" in paths:
        row["dry-run"] = timed(lambda: _cli("run", str(batch), "--out", str(folder / "dry"), "--dry-run"),
                               limit_s=limit_s)
    if not {"record", "status", "re-serve"} & set(paths):
        return row
    # The folders the later paths read are made with the code as it stands, however long it takes.
    row["record"] = timed(lambda: record(batch, out), limit_s=limit_s if "record" in paths else 1e9)
    if row["record"] is None:
        return row
    if "re-serve" in paths:
        again.mkdir()
        shutil.copy(out / LEDGER_NAME, again / LEDGER_NAME)
        make_interrupted(again)
        row["re-serve"] = timed(lambda: reserve(again), limit_s=limit_s)
    if "status" in paths:
        make_served(out)
        lock = FolderLock(out)
        with lock:  # served: status plans the ETA of the jobs left from the folder's history
            row["status"] = timed(lambda: _cli("status", str(out)), limit_s=limit_s)
    if "record" not in paths:
        del row["record"]
    shutil.rmtree(folder)
    return row


def quickest(values: list[float | None]) -> float | None:
    """The quickest of a path's runs; None (past the limit) if any run was."""
    return None if any(v is None for v in values) else min(v for v in values if v is not None)


def shown(value: float | None, limit_s: float) -> str:
    return f">{limit_s:g}" if value is None else f"{value:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="1000,5000,20000", help="batch sizes, comma-separated (multiples of 4)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"which of {', '.join(PATHS)}")
    p.add_argument("--limit", type=float, default=600.0, help="seconds after which a measurement is stopped")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each size this many times (fresh folders) and keep the quickest: other work on a "
                        "shared machine only ever adds time")
    p.add_argument("--work", type=Path, help="where the batches and folders go (default: a temp folder)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    sizes = [int(s) for s in args.jobs.split(",")]
    paths = tuple(s.strip() for s in args.paths.split(","))
    if bad := [s for s in sizes if s % len(PROMPTS) or s < len(PROMPTS)]:
        p.error(f"--jobs {bad}: each size must be a positive multiple of {len(PROMPTS)}")
    if bad := [s for s in paths if s not in PATHS]:
        p.error(f"--paths {bad}: allowed: {', '.join(PATHS)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    import pan2render

    print(f"pan2-render {pan2render.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU(s), "
          f"SQLite {sqlite3.sqlite_version}; limit {args.limit:g} s per measurement, best of {args.repeat}", flush=True)
    table: dict[int, dict[str, float | None]] = {}
    for n in sizes:
        runs = [bench(n, work / f"run{i}", paths, args.limit) for i in range(args.repeat)]
        table[n] = {k: quickest([r[k] for r in runs]) for k in runs[0]}
        print(f"{n:>7,} jobs: " + ", ".join(f"{k} {shown(v, args.limit)} s" for k, v in table[n].items()), flush=True)
    print(f"\n| seconds | {' | '.join(f'{n:,} jobs' for n in sizes)} |\n|---|{'---|' * len(sizes)}")
    for path in paths:
        print(f"| {path} | {' | '.join(shown(table[n].get(path), args.limit) for n in sizes)} |")
    if args.json is not None:
        args.json.write_text(json.dumps({str(n): row for n, row in table.items()}, indent=1) + "\n")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
