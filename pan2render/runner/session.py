"""A batch served in its output folder, by `run`, `resume` or the farm: the one place that records a
batch in its ledger and holds the folder while the scheduler serves it.

A :class:`BatchSession` holds ``DIR/.lock`` (so no other process writes the folder), the ledger,
the run log (``DIR/run.log``) and the report that is kept current as jobs end. ``record`` writes a
validated batch (:class:`BatchRequest`, what a client asks for) into the ledger in one
transaction; ``reopen`` continues what a ledger already holds. Either way the ledger stays the
truth for the batch: ``status``, ``show``, ``report`` and ``resume DIR`` work with or without a farm.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pan2render.jobs import disk
from pan2render.checkpoint_files import checkpoint_problems as files_problems
from pan2render.jobs.batch import TINY_MODEL, Overrides
from pan2render.hints import command
from pan2render.jobs.ledger import BACKUP_NAME, LEDGER_NAME, EventKind, FolderLock, JobRecord, JobState, Ledger
from pan2render.jobs.spec import Batch, JobSpec
from pan2render.runner import errors
from pan2render.runner.errors import UnrecordedWork
from pan2render.runner.driver import prepare_jobs
from pan2render.runner.progress import RUN_LOG_NAME, RunLog


@dataclass(frozen=True)
class BatchRequest:
    """A validated batch to render into ``out_dir`` (an absolute path), with the flags it was given.
    Validation happens where the batch is read (the client), so a bad batch never reaches a farm."""

    out_dir: Path
    batch: Batch
    overrides: Overrides
    retries: int = 2

    def to_json(self) -> dict[str, Any]:
        b = self.batch
        return {"out_dir": str(self.out_dir), "retries": self.retries, "overrides": self.overrides.to_json(),
                "batch": {"path": b.path, "model": b.model, "preset": b.preset, "weights_files": b.weights_files,
                          "jobs": [j.to_dict() for j in b.jobs]}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BatchRequest:
        b = d["batch"]
        batch = Batch(path=b["path"], model=b["model"], preset=b["preset"], weights_files=b.get("weights_files") or {},
                      jobs=[JobSpec.from_dict(j) for j in b["jobs"]])
        return cls(out_dir=Path(d["out_dir"]), batch=batch, overrides=Overrides.from_json(d.get("overrides")),
                   retries=int(d.get("retries", 2)))


class BatchSession:
    """One output folder held for serving its batch: the lock, the ledger, the run log. Close it
    (or use it as a context manager) when the batch is served; the lock is released last."""

    def __init__(self, out_dir: Path, *, lock: FolderLock, ledger: Ledger, log: RunLog, job_ids: list[str],
                 flags: list[str]):
        self.out_dir = out_dir
        self.lock = lock
        self.ledger = ledger
        self.log = log
        self.job_ids = job_ids
        self.flags = flags

    # ------------------------------------------------------------------ opening
    @classmethod
    def record(cls, request: BatchRequest, *, stream: TextIO | None, title: str) -> BatchSession:
        """Hold ``request.out_dir`` and record the batch in its ledger (one transaction); ``title``:
        the run log's first line (the command as typed). ``stream``: where the log's lines also go
        (None: the run log alone)."""
        out, batch, overrides = request.out_dir, request.batch, request.overrides
        out.mkdir(parents=True, exist_ok=True)
        lock = FolderLock(out)
        lock.acquire()
        try:
            if (why := unrecorded_work(out)) is not None:
                raise UnrecordedWork(why)
            try:
                ledger = Ledger.open(out)
            except Exception as e:  # noqa: BLE001 - told apart by errors.explain
                raise errors.NothingRecorded(e) from e
            log = RunLog(out / RUN_LOG_NAME, stream=stream)
        except BaseException:
            lock.release()
            raise
        session = cls(out, lock=lock, ledger=ledger, log=log, job_ids=[j.job_id for j in batch.jobs],
                      flags=overrides.flags())
        try:
            previous = ledger.get_meta("batch") or {}
            try:
                added, present = ledger.record_batch(
                    {"path": batch.path, "model": batch.model, "preset": batch.preset,
                     "weights_files": batch.weights_files, "overrides": overrides.to_json()},
                    batch.jobs, retries=request.retries)
            except Exception as e:  # noqa: BLE001
                raise errors.NothingRecorded(e) from e
            log.line(title)
            warn_if_no_backup(ledger, log)
            note_superseded(ledger, batch, set(added), previous.get("weights_files") or {}, log)
            warn_if_short_of_space(out, ledger.jobs(added), log)
            n_done = sum(j.state is JobState.DONE for j in ledger.jobs(present))
            log.line(f"{out}: {len(added)} new job(s), {len(present)} already in the ledger "
                     f"({n_done} done, skipped unless their video is corrupt); log: {out / RUN_LOG_NAME}")
        except BaseException:
            session.close()
            raise
        return session

    @classmethod
    def reopen(cls, out_dir: Path, *, stream: TextIO | None, title: str,
               job_ids: list[str] | None = None) -> BatchSession:
        """Hold a folder whose ledger holds a batch, to continue it (``job_ids``: those of it to
        serve, default every job in the ledger)."""
        lock = FolderLock(out_dir)
        lock.acquire()
        try:
            ledger = Ledger.open(out_dir)
        except BaseException:
            lock.release()
            raise
        log = RunLog(out_dir / RUN_LOG_NAME, stream=stream)
        batch = ledger.get_meta("batch", {}) or {}
        # The recorded specs are the batch as run, --set/--sweep applied: serving them repeats them.
        flags = Overrides.from_json(batch.get("overrides")).flags()
        ids = job_ids if job_ids is not None else [j.id for j in ledger.jobs()]
        session = cls(out_dir, lock=lock, ledger=ledger, log=log, job_ids=ids, flags=flags)
        described = f"{batch.get('path', '?')} {' '.join(flags)}".strip()
        log.line(title.format(batch=described))
        warn_if_short_of_space(out_dir, [j for j in ledger.jobs(ids) if j.state is not JobState.DONE], log)
        return session

    # ------------------------------------------------------------------ serving
    def prepare(self, *, retries: int, revive_cancelled: bool = True) -> bool:
        """Bring the jobs to a runnable state (see driver.prepare_jobs); True when every one has
        ended (done with its video intact, or cancelled and kept so), so no worker is needed."""
        prepare_jobs(out_dir=self.out_dir, ledger=self.ledger, job_ids=self.job_ids, retries=retries,
                     say=self.log.line, revive_cancelled=revive_cancelled)
        return all(j.state in (JobState.DONE, JobState.CANCELLED) for j in self.ledger.jobs(self.job_ids))

    def note_run(self, *, command: str, gpus: int) -> None:
        """The ledger's list of runs (`status` shows the last: who serves the folder, with which flags)."""
        self.ledger.set_meta("runs", [*self.ledger.get_meta("runs", []), {
            "command": command, "started": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
            "flags": self.flags, "gpus": gpus}])

    def counts(self) -> dict[str, int]:
        jobs = self.ledger.jobs(self.job_ids)
        return {state.value: sum(j.state is state for j in jobs) for state in JobState} | {"total": len(jobs)}

    def close(self) -> None:
        try:
            self.log.close()
            self.ledger.close()
        finally:
            self.lock.release()

    def __enter__(self) -> BatchSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def note_superseded(ledger: Ledger, batch: Batch, added: set[str], old_files: dict[str, Any], log: RunLog) -> None:
    """A new job that is an old one with other weights (same name, sweep values and model path):
    the checkpoint was replaced in place. Say so, in the ledger and here, naming the files."""
    def key(spec: JobSpec) -> str:
        return json.dumps([spec.name, spec.sweep, spec.model], sort_keys=True, default=str)

    old = {key(j.spec): j for j in ledger.jobs() if j.id not in added}
    changed = sorted(r for r in set(old_files) | set(batch.weights_files)
                     if old_files.get(r) != batch.weights_files.get(r))
    files = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    # Folders recorded before the digest covered every byte hold sampled fingerprints: their
    # jobs are superseded by the new digest alone, whether or not the weights changed.
    sampled = any("sampled_sha256" in (fp or {}) for fp in old_files.values())
    for spec in batch.jobs:
        prev = old.get(key(spec))
        if spec.job_id in added and prev is not None and prev.spec.weights != spec.weights:
            why = (f"the weights' digest of {spec.model} now covers every byte (it sampled each file before)"
                   if sampled else f"the weights in {spec.model} changed" + (f" ({files})" if files else ""))
            ledger.log(prev.id, EventKind.SUPERSEDED, f"by {spec.job_id}: {why}")
            log.line(f"{prev.id} is superseded by {spec.job_id}: {why}")


def warn_if_no_backup(ledger: Ledger, log: RunLog) -> None:
    """The ledger's backup is taken quietly (its failure never fails a job); say when it failed."""
    if ledger.backup_error:
        log.line(f"warning: the ledger's backup could not be written ({ledger.backup_error}); `repair` would "
                 f"have only the job folders to rebuild it from")


def warn_if_short_of_space(out: Path, jobs: list[JobRecord], log: RunLog) -> None:
    """Before starting: warn (only) when the unfinished jobs' artifacts may not fit. An estimate:
    each write is checked against its real size, and a full disk stops the batch cleanly."""
    from pan2render.runner.artifacts import estimated_bytes  # noqa: PLC0415

    need = sum(estimated_bytes(j.spec) for j in jobs)
    free = disk.free_bytes(out)
    if need + disk.HEADROOM_BYTES > free:
        log.line(f"warning: {len(jobs)} job(s) need about {need / 2**30:.2f} GiB in {out} but only "
                 f"{free / 2**30:.2f} GiB is free; the batch will stop when the disk fills (`resume` "
                 f"continues once space is freed)")


def checkpoint_problems(specs: list[JobSpec]) -> dict[str, list[str]]:
    """Checkpoint folder -> every reason its load would fail (from its files alone, no weights
    read), for the folders the jobs name that have any. Checked once per batch before any job
    starts: a broken folder would fail every job's load the same way."""
    models = sorted({s.model for s in specs if s.model != TINY_MODEL})
    found = {m: files_problems(Path(m)) for m in models}
    return {m: problems for m, problems in found.items() if problems}


def recorded(out: Path | None) -> bool:
    """Does ``out`` hold a ledger with a recorded batch (so that `resume` has something to do)?"""
    if out is None or not (out / LEDGER_NAME).is_file() or (out / LEDGER_NAME).stat().st_size == 0:
        return False  # (an empty file is what SQLite calls an empty database)
    try:
        ledger = Ledger.open_readonly(out)
    except Exception:  # noqa: BLE001 - damaged or unreadable: its own message says what to do
        return True
    try:
        return ledger.has_batch()
    finally:
        ledger.close()


def unrecorded_work(out: Path) -> str | None:
    """Why ``run`` must not start in ``out``: its ledger is gone or holds no batch, yet job folders
    with artifacts are there (a ledger deleted or emptied). A run would record a new batch and
    render those jobs again over their videos; `repair` rebuilds the ledger from them. None when
    there is nothing of the kind."""
    from pan2render.runner.repair import JOB_FILES  # noqa: PLC0415 - numpy, safetensors

    if recorded(out) or not out.is_dir():
        return None
    folders = sorted(f.name for f in out.iterdir()
                     if not f.name.startswith((".", "_")) and not f.is_symlink() and f.is_dir()
                     and any((f / name).is_file() for name in JOB_FILES))
    backup = (out / BACKUP_NAME).is_file() and not (out / BACKUP_NAME).is_symlink()
    if not folders and not backup:
        return None
    found = " and ".join(([f"{len(folders)} job folder(s) with rendered artifacts (e.g. {folders[0]})"] if folders
                          else []) + ([f"the ledger's backup {BACKUP_NAME}"] if backup else []))
    return (f"{out} holds {found}, but its ledger {LEDGER_NAME} is missing or holds no batch (deleted or emptied): "
            f"a run now would render those jobs again over their videos. `{command('repair', out)}` rebuilds the "
            f"ledger from them (with `--batch BATCH` for jobs that left nothing on disk); then run again. "
            f"Nothing was written.")
