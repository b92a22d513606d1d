"""The ledger: a SQLite record of every job and stage in an output folder (``DIR/ledger.sqlite``).

The driver is the only writer (it holds ``DIR/.lock`` through :class:`FolderLock`); ``status`` and
``report`` only read. Every change is one transaction, made right after the ``os.replace`` of the
artifact it records, so a crash leaves either the old row or the new one.

The file is opened, checked, changed and copied by ``jobs/store.py``, as the farm's queue is: the
classic rollback journal, not WAL (store.py says why), symlinks refused, readers waiting up to 10 s
on a write (writes are a few rows each).

Job lifecycle (an explicit state machine, :data:`JOB_TRANSITIONS`)::

    pending --start--> running --finish--> done
       ^                  |--retry-----> pending   (retries_left decremented)
       |                  |--fail------> failed    (budget spent, or the error is not retryable)
       |                  '--interrupt-> pending   (the driver died while the job ran)
       |------revive---- failed                    (resume / re-run: a fresh retry budget)
       '------invalidate- done                     (resume found its video corrupt or missing)
    pending --fail--> failed                       (can never run: needs more GPUs than a node has)
    pending/running --cancel--> cancelled --revive--> pending   (a farm's client; a running job's
                                                    sampling stops at a step boundary)

Stage rows (one per job and :class:`Stage`) go pending -> running -> done | failed; a stage left
running when its job leaves ``running`` any other way than ``finish`` is put back to pending.

Damage: opening checks the file (``PRAGMA quick_check``, the schema) and raises :class:`LedgerError`
naming the path and what to do, never a raw ``sqlite3`` error. A copy is kept in
``ledger.sqlite.bak``: whole (SQLite's online backup API) once a batch is recorded, then brought up
to date with each job's rows as it is done, so a damaged ledger loses at most the last job's record
and a batch's backups cost in proportion to it; ``pan2-render repair`` rebuilds from that copy and
from the artifacts on disk.
"""

from __future__ import annotations

import enum
import fcntl
import json
import os
import socket
import sqlite3
import stat
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pan2render.hints import command
from pan2render.jobs import store
from pan2render.jobs.disk import is_disk_full
from pan2render.jobs.lifecycle import IllegalTransition as IllegalTransition  # next_job_state raises it
from pan2render.jobs.lifecycle import Lifecycle, Transition, transition_table
from pan2render.jobs.outdir import open_file
from pan2render.jobs.spec import JobSpec

LEDGER_NAME = "ledger.sqlite"
BACKUP_NAME = "ledger.sqlite.bak"
LOCK_NAME = ".lock"
SCHEMA_VERSION = 1
_TABLES = ("meta", "jobs", "stages", "events")
# A job's rows, by table and the column naming the job: what a backup after the job copies.
_JOB_ROWS = (("jobs", "id"), ("stages", "job_id"), ("documents", "job_id"))


class LedgerError(store.StoreError):
    """The ledger cannot be used (damaged, not a ledger, unreadable, holds no batch); the message
    names the file, what is wrong and what to do."""

    noun = "ledger"


def _repair_hint(path: Path) -> str:
    return (f"`{command('repair', path.parent)}` rebuilds it from its backup and the finished artifacts "
            f"(the damaged file is kept beside it)")


class JobState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"  # by a farm's client; resume and a farm's retry run it again


# Terminal for a run: the driver never leaves them on its own. Only the checks at the start of a
# run/resume do (revive a failed or cancelled job, invalidate a done job whose video is corrupt).
TERMINAL_JOB_STATES = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED})


class StageState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class Stage(str, enum.Enum):
    """The stages of one job, in order. Decode's output (frames) is never durable: it stays on the
    worker, which encodes it in the background, and only the mp4 comes back, so decode is marked
    done together with encode; so is interpolate, which works on those frames."""

    CONDITIONING = "conditioning"  # artifact: DIR/_cache/embeddings/<sha>.safetensors
    SAMPLING = "sampling"  # artifact: DIR/<job>/latents.safetensors (a chained job: DIR/<job>/segments/)
    DECODE = "decode"  # no artifact (frames stay in the worker)
    INTERPOLATE = "interpolate"  # no artifact (frames stay in the worker); nothing to do unless `interpolate` > 1
    ENCODE = "encode"  # artifact: DIR/<job>/video.mp4


STAGES: tuple[Stage, ...] = tuple(Stage)


def stage_name(stage: Stage | str) -> str:
    """A stage's name in the ledger: a :class:`Stage`'s value, or the name a flow declared."""
    return stage.value if isinstance(stage, Stage) else str(stage)


def _stage_key(name: str) -> Stage | str:
    """A stage row's key: the :class:`Stage` of that name, else the name itself (a stage only a
    flow declares). ``Stage`` is a str enum, so either looks up the same dict entry."""
    try:
        return Stage(name)
    except ValueError:
        return name


class EventKind(str, enum.Enum):
    """What an event of the ledger records (the ``events.kind`` column). A job's state change is
    stored as ``"<from>-><to>"`` and a stage reset as ``"reset:<stage>"``; :class:`Event` reads
    them back typed."""

    ADDED = "added"
    SPEC_UPDATED = "spec-updated"
    TRANSITION = "transition"  # stored as "<from>-><to>"
    TRACEBACK = "traceback"
    RESTORED = "restored"
    RESET = "reset"  # stored as "reset:<stage>"
    SUPERSEDED = "superseded"
    PARAMS_REWRITTEN = "params-rewritten"
    GROUP_LOAD = "group-load"
    CONDITIONING = "conditioning"
    ENCODE = "encode"
    GROUP_DISCARDED = "group-discarded"
    GROUP_DIED = "group-died"
    CHECKPOINT_DROPPED = "checkpoint-dropped"
    CHECKPOINT_RESUMED = "checkpoint-resumed"  # a sampling continues from the job's step checkpoint
    SEGMENT = "segment"  # a chained job's segment sampled, or its last frame recorded
    DROPPED = "dropped"  # a job removed from the ledger (`run --prune`); its id leads the detail
    STAGE_ADDED = "stage-added"  # a ledger from before a stage existed got its rows (Ledger.open_file)
    OTHER = "other"  # a kind this version does not know (a newer version wrote it)


@dataclass(frozen=True)
class Event:
    at: float
    job_id: str | None
    kind: EventKind
    detail: str
    label: str  # the kind as stored, what `show` prints ("pending->running", "reset:sampling", ...)
    transition: tuple[JobState, JobState] | None = None  # kind TRANSITION: (from, to)
    stage: str | None = None  # kind RESET: the stage reset (with every later one)

    @classmethod
    def from_row(cls, at: float, job_id: str | None, kind: str, detail: str) -> Event:
        if "->" in kind:
            old, _, new = kind.partition("->")
            try:
                return cls(at, job_id, EventKind.TRANSITION, detail, kind, transition=(JobState(old), JobState(new)))
            except ValueError:
                return cls(at, job_id, EventKind.OTHER, detail, kind)
        if kind.startswith("reset:"):
            return cls(at, job_id, EventKind.RESET, detail, kind, stage=kind.removeprefix("reset:"))
        try:
            return cls(at, job_id, EventKind(kind), detail, kind)
        except ValueError:
            return cls(at, job_id, EventKind.OTHER, detail, kind)

    def ended(self) -> JobState | None:
        """The state a running job ended in, for a transition out of running."""
        if self.transition is not None and self.transition[0] is JobState.RUNNING:
            return self.transition[1]
        return None

    @property
    def started(self) -> bool:
        return self.transition == (JobState.PENDING, JobState.RUNNING)


class JobEvent(Transition):
    """An event of a job's lifecycle: the states it leaves, the state it enters. Anything not
    declared is an illegal transition and raises."""

    START = "start", {JobState.PENDING}, JobState.RUNNING
    FINISH = "finish", {JobState.RUNNING}, JobState.DONE
    RETRY = "retry", {JobState.RUNNING}, JobState.PENDING
    FAIL = "fail", {JobState.RUNNING, JobState.PENDING}, JobState.FAILED  # pending: needs more GPUs than there are
    INTERRUPT = "interrupt", {JobState.RUNNING}, JobState.PENDING
    REVIVE = "revive", {JobState.FAILED, JobState.CANCELLED}, JobState.PENDING
    INVALIDATE = "invalidate", {JobState.DONE}, JobState.PENDING  # its video is gone or corrupt
    # Running: its sampling stopped at a step boundary.
    CANCEL = "cancel", {JobState.PENDING, JobState.RUNNING}, JobState.CANCELLED


class StageEvent(Transition):
    """What happens to a job's stage row, declared as a job's events are: the states it leaves, the
    one it enters. A stage is set back to pending, with every later stage, only by a reset (its
    input is redone: ``Ledger.reset_stages``), which logs why."""

    # Its call went out; from running too: an attempt interrupted (its group lost, the run
    # stopped) left the row running, and the next attempt starts it again.
    START = "start", {StageState.PENDING, StageState.FAILED, StageState.RUNNING}, StageState.RUNNING
    # Its result recorded; from pending or failed too: a result another job's call made (the
    # prompts encoded ahead of their jobs).
    FINISH = "finish", {StageState.RUNNING, StageState.PENDING, StageState.FAILED}, StageState.DONE
    # Charged a failure: its call failed, or the driver failed it before its call went out, or
    # again after an earlier failure of the same stage (a group that never formed for its retry).
    FAIL = "fail", {StageState.RUNNING, StageState.PENDING, StageState.FAILED}, StageState.FAILED
    STOP = "stop", {StageState.RUNNING}, StageState.PENDING  # a sampling stopped at a step boundary


STAGE_TRANSITIONS: dict[tuple[StageState, StageEvent], StageState] = transition_table(StageEvent)
STAGE_LIFECYCLE: Lifecycle[StageState, StageEvent] = Lifecycle("stage", STAGE_TRANSITIONS)


# (from, event) -> to, as the events declare it.
JOB_TRANSITIONS: dict[tuple[JobState, JobEvent], JobState] = transition_table(JobEvent)
JOB_LIFECYCLE: Lifecycle[JobState, JobEvent] = Lifecycle("job", JOB_TRANSITIONS)


def next_job_state(state: JobState, event: JobEvent) -> JobState:
    return JOB_LIFECYCLE.next(state, event)


@dataclass(frozen=True)
class JobTally:
    """What counts and timings need of one job (:meth:`Ledger.tallies`): its state, its error, the
    spec fields that size it, and the seconds of each of its stages recorded done."""

    id: str
    state: JobState
    error: str | None
    model: str
    width: int
    height: int
    frames: int
    fps: float
    steps: int
    stage_seconds: dict[str, float]


@dataclass(frozen=True)
class StageRecord:
    job_id: str
    stage: Stage | str  # a Stage, or the name of a stage only a flow declares
    state: StageState
    artifact: str | None  # path relative to DIR
    sha256: str | None
    size: int | None
    seconds: float | None
    error: str | None
    traceback: str | None


@dataclass(frozen=True)
class JobRecord:
    id: str
    name: str
    spec: JobSpec
    spec_hash: str
    state: JobState
    attempts: int  # how many times the job was started, ever
    retries_left: int  # retries left in the current budget (reset by revive)
    error: str | None
    error_stage: str | None
    position: int  # order of insertion, so status lists jobs as the batch did
    created_at: float
    updated_at: float


def superseded(jobs: Iterable[JobRecord]) -> dict[str, str]:
    """Old id -> newest id, for every job that has a newer version among ``jobs``: the same name and
    sweep values under another spec hash (the batch was edited and run again into the folder).
    Newest = added to the ledger last."""
    jobs = list(jobs)
    newest: dict[str, str] = {}
    for job in sorted(jobs, key=lambda j: j.position):
        newest[job.spec.version_key] = job.id
    return {j.id: newest[j.spec.version_key] for j in jobs if newest[j.spec.version_key] != j.id}


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, spec_json TEXT NOT NULL, spec_hash TEXT NOT NULL,
    state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, retries_left INTEGER NOT NULL,
    error TEXT, error_stage TEXT, position INTEGER NOT NULL,
    created_at REAL NOT NULL, updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS stages (
    job_id TEXT NOT NULL REFERENCES jobs(id), stage TEXT NOT NULL, state TEXT NOT NULL,
    artifact TEXT, sha256 TEXT, size INTEGER, seconds REAL, error TEXT, traceback TEXT,
    updated_at REAL NOT NULL, PRIMARY KEY (job_id, stage)
);
CREATE TABLE IF NOT EXISTS documents (
    job_id TEXT NOT NULL REFERENCES jobs(id), name TEXT NOT NULL, body TEXT NOT NULL,
    updated_at REAL NOT NULL, PRIMARY KEY (job_id, name)
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, job_id TEXT, kind TEXT NOT NULL,
    detail TEXT NOT NULL
);
"""


def _empty_remedy(path: Path) -> str:
    return (_repair_hint(path) + "; if the batch never ran, start it with "
            f"`{command('run', 'BATCH', '--out', path.parent)}`")


_LEDGER = store.Schema(
    script=_SCHEMA + f"INSERT OR IGNORE INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}');",
    tables=_TABLES, error=LedgerError, repair=_repair_hint,
    empty="is empty (no batch was ever recorded in it, or it was emptied)", empty_remedy=_empty_remedy)


class Ledger:
    """One output folder's ledger. Open with :meth:`open` (writer) or :meth:`open_readonly`."""

    def __init__(self, conn: sqlite3.Connection, *, path: Path):
        self._conn = conn
        self.path = path
        self.backup_error: str | None = None
        self._backup_conn: tuple[int, sqlite3.Connection] | None = None  # the backup's inode, a connection to it
        self._stage_names: tuple[str, ...] | None = None
        self._changes = store.Changes(conn)

    @property
    def stage_names(self) -> tuple[str, ...]:
        """The stages each job has a row for, in order: the flow's the batch was recorded with
        (meta ``stages``), else the standard :data:`STAGES`."""
        if self._stage_names is None:
            recorded = self.get_meta("stages") if self._has_meta() else None
            self._stage_names = tuple(recorded) if recorded else tuple(s.value for s in STAGES)
        return self._stage_names

    def _has_meta(self) -> bool:
        return self._conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() \
            is not None

    # ---------------------------------------------------------------- opening
    @classmethod
    def open(cls, out_dir: str | Path) -> "Ledger":
        return cls.open_file(Path(out_dir) / LEDGER_NAME)

    @classmethod
    def open_file(cls, path: Path) -> "Ledger":
        """Open (creating if absent) a ledger file for writing; raises LedgerError if damaged, and
        UnsafePathError if it or its journal is a symlink (SQLite would write through it)."""
        ledger = cls(store.open_writer(path, _LEDGER), path=path)
        ledger._add_new_stages()
        return ledger

    def _add_new_stages(self) -> None:
        """A ledger recorded with the standard stages before one was added (interpolate) gets that
        stage's row for each of its jobs, in one transaction: done where the stage before it is done
        (a stage added since is recorded done with the video, as decode is), else pending. A ledger
        of a flow of its own (meta ``stages``) keeps the stages it was recorded with."""
        if self.get_meta("stages") is not None:
            return
        # (A stage present is found at the first rows; only a missing one costs a scan, once.)
        present = [self._conn.execute("SELECT 1 FROM stages WHERE stage = ? LIMIT 1", (s.value,)).fetchone()
                   is not None for s in STAGES]
        missing = [(i, s) for i, s in enumerate(STAGES) if not present[i] and i > 0]
        if not any(present) or not missing:
            return
        now = time.time()
        with self._tx() as c:
            for i, stage in missing:
                c.execute("INSERT INTO stages (job_id, stage, state, updated_at) SELECT job_id, ?, CASE state WHEN ? "
                          "THEN ? ELSE ? END, ? FROM stages WHERE stage = ?",
                          (stage.value, StageState.DONE.value, StageState.DONE.value, StageState.PENDING.value, now,
                           STAGES[i - 1].value))
                self._event(c, None, EventKind.STAGE_ADDED, f"stage {stage.value} added to every job (recorded "
                                                            f"before it existed): done where {STAGES[i - 1].value} is")

    @classmethod
    def open_readonly(cls, out_dir: str | Path) -> "Ledger":
        path = Path(out_dir) / LEDGER_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"no ledger at {path}: {out_dir} is not a pan2-render output folder "
                f"(create one with `{command('run', 'BATCH', '--out', out_dir)}`)"
            )
        return cls.open_file_readonly(path)

    @classmethod
    def open_file_readonly(cls, path: Path) -> "Ledger":
        """Open an existing ledger file (the ledger or its backup) for reading only."""
        return cls(store.open_reader(path, _LEDGER), path=path)

    def has_batch(self) -> bool:
        """Was a batch recorded? (record_batch writes its jobs in one transaction: any job is proof.)"""
        return self._conn.execute("SELECT 1 FROM jobs LIMIT 1").fetchone() is not None

    def backup(self) -> Path:
        """Copy the ledger to ``ledger.sqlite.bak`` with SQLite's online backup API (a consistent
        snapshot even mid-transaction elsewhere), via a temp name and a rename: the previous copy
        stays whole until the new one is."""
        self._drop_backup_conn()  # (it would write to the file the rename replaces)
        return store.backup(self._conn, self.path.with_name(BACKUP_NAME))

    def backup_job(self, job_id: str) -> None:
        """Bring the backup up to date with one job's rows (the job, its stages, its documents) in
        one transaction on the backup file: a write the size of the job, where a whole copy after
        every job made a batch's backups quadratic in its length. A backup that is absent or not a
        ledger is made whole instead. The connection to the backup stays open between jobs (while
        the file is the same one): opening it cost as much as the write."""
        dest = self.path.with_name(BACKUP_NAME)
        store.refuse_links(dest)
        try:
            st = dest.stat()
        except FileNotFoundError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            self.backup()
            return
        rows = {table: self._conn.execute(f"SELECT * FROM {table} WHERE {key} = ?", (job_id,)).fetchall()
                for table, key in _JOB_ROWS}
        try:
            target = self._backup_target(dest, st.st_ino)
        except sqlite3.Error:
            self.backup()
            return
        try:
            with store.transaction(target):
                for table, found in rows.items():
                    for row in found:
                        target.execute(f"INSERT OR REPLACE INTO {table} VALUES ({', '.join('?' * len(row))})", row)
            return
        except sqlite3.DatabaseError as e:
            self._drop_backup_conn()
            if is_disk_full(e):
                raise
        self.backup()  # not a ledger's copy (damaged, or of another schema): a whole one

    def _backup_target(self, dest: Path, inode: int) -> sqlite3.Connection:
        if self._backup_conn is not None and self._backup_conn[0] != inode:
            self._drop_backup_conn()  # replaced since (a repair, a whole copy by another writer)
        if self._backup_conn is None:
            conn = sqlite3.connect(dest, timeout=store.BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            try:
                conn.execute("PRAGMA synchronous=FULL")
            except sqlite3.Error:
                conn.close()
                raise
            self._backup_conn = (inode, conn)
        return self._backup_conn[1]

    def _drop_backup_conn(self) -> None:
        if self._backup_conn is not None:
            self._backup_conn[1].close()  # (an unfinished transaction is rolled back)
            self._backup_conn = None

    def backup_quietly(self, job_id: str | None = None) -> None:
        """A backup at a safe point: the whole ledger, or only ``job_id``'s rows. Its failure (e.g.
        the disk just filled) never fails the change it follows; the next safe point tries again,
        and ``backup_error`` says why it failed."""
        try:
            if job_id is None:
                self.backup()
            else:
                self.backup_job(job_id)
            self.backup_error = None
        except (OSError, sqlite3.Error) as e:
            self.backup_error = f"{type(e).__name__}: {e}"

    def close(self) -> None:
        self._drop_backup_conn()
        self._conn.close()

    def _tx(self, *, one_write: bool = False) -> AbstractContextManager[sqlite3.Connection]:
        """One change (``one_write``: it makes at most one write statement, see ``store.Changes``)."""
        return self._changes.change(one_write=one_write)

    def grouped(self) -> AbstractContextManager[None]:
        """Every change made inside committed as one transaction when the block ends (the
        scheduler's step boundaries: a reply recorded and the job's next stage marked started);
        a backup asked for inside is made after that commit. See ``store.Changes``: a group the
        disk refuses makes every later change of this ledger fail as the disk did."""
        return self._changes.grouped()

    # ---------------------------------------------------------------- meta
    def set_meta(self, key: str, value: Any) -> None:
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    # ---------------------------------------------------------------- jobs
    def record_batch(self, batch: dict[str, Any], specs: Iterable[JobSpec], *, retries: int,
                     stages: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
        """The batch's description and every job in ONE transaction (then a backup): after a crash
        or a full disk the ledger holds the whole batch or nothing of it. ``stages``: the stage
        names of the flow that runs it, when not the standard ones (a ledger keeps the stages it
        was first recorded with). Returns what add_jobs does."""
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", ("batch", json.dumps(batch)))
            if stages is not None and self.get_meta("stages") is None:
                c.execute("INSERT INTO meta VALUES (?, ?)", ("stages", json.dumps(list(stages))))
                self._stage_names = tuple(stages)
            result = self._add_jobs(c, specs, retries=retries)
        self.backup_quietly()
        return result

    def add_jobs(self, specs: Iterable[JobSpec], *, retries: int) -> tuple[list[str], list[str]]:
        """Insert jobs not yet in the ledger. Returns (added ids, ids already present).

        The id ends in the spec hash, so an id already present renders the same pixels. Fields the
        hash leaves out (``gpus``, ``checkpoint_every``, the image's path) may still have changed: a
        present job that is not done takes the batch's spec, so lowering ``gpus`` or moving an image
        fixes a failed job.
        (The caller holds the folder lock, so no job is really running.)"""
        with self._tx() as c:
            return self._add_jobs(c, specs, retries=retries)

    def _add_jobs(self, c: sqlite3.Connection, specs: Iterable[JobSpec], *,
                  retries: int) -> tuple[list[str], list[str]]:
        added: list[str] = []
        present: list[str] = []
        now = time.time()
        (pos,) = c.execute("SELECT COALESCE(MAX(position), -1) + 1 FROM jobs").fetchone()
        for spec in specs:
            jid = spec.job_id
            row = c.execute("SELECT state, spec_json FROM jobs WHERE id = ?", (jid,)).fetchone()
            if row:
                present.append(jid)
                spec_json = json.dumps(spec.to_dict(), sort_keys=True)
                if row[0] != JobState.DONE.value and row[1] != spec_json:
                    c.execute("UPDATE jobs SET spec_json = ?, updated_at = ? WHERE id = ?",
                              (spec_json, now, jid))
                    # Read back through the schema: fields added since the row was written take
                    # their defaults instead of counting as changed.
                    before, after = JobSpec.from_dict(json.loads(row[1])).to_dict(), spec.to_dict()
                    changed = sorted(k for k in after if before.get(k) != after[k])
                    self._event(c, jid, EventKind.SPEC_UPDATED, f"fields outside the spec hash changed "
                                f"({', '.join(changed)}); the batch's values apply")
                continue
            c.execute(
                "INSERT INTO jobs (id, name, spec_json, spec_hash, state, attempts, retries_left,"
                " position, created_at, updated_at) VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?, ?)",
                (jid, spec.name, json.dumps(spec.to_dict(), sort_keys=True), spec.spec_hash,
                 JobState.PENDING.value, retries, pos, now, now),
            )
            for stage in self.stage_names:
                c.execute(
                    "INSERT INTO stages (job_id, stage, state, updated_at) VALUES (?, ?, ?, ?)",
                    (jid, stage, StageState.PENDING.value, now),
                )
            self._event(c, jid, EventKind.ADDED, f"spec_hash {spec.spec_hash[:12]}")
            pos += 1
            added.append(jid)
        return added, present

    def jobs(self, ids: Iterable[str] | None = None) -> list[JobRecord]:
        rows = self._conn.execute("SELECT * FROM jobs ORDER BY position").fetchall()
        wanted = None if ids is None else set(ids)
        return [_job_record(r) for r in rows if wanted is None or r[0] in wanted]

    def job(self, job_id: str) -> JobRecord:
        row = self._conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(f"job {job_id!r} is not in the ledger {self.path}")
        return _job_record(row)

    def job_states(self, ids: Iterable[str] | None = None) -> dict[str, JobState]:
        """Job id -> state (of ``ids``, default every job), in the ledger's order, without reading
        the specs: what a count or a check of a whole batch needs, at a fraction of :meth:`jobs`."""
        rows = self._conn.execute("SELECT id, state FROM jobs ORDER BY position").fetchall()
        wanted = None if ids is None else set(ids)
        return {job_id: JobState(state) for job_id, state in rows if wanted is None or job_id in wanted}

    def transition(self, job_id: str, event: JobEvent, *, reason: str, error: str | None = None,
                   error_stage: Stage | str | None = None, retries: int | None = None) -> JobState:
        """Apply one lifecycle event (see :data:`JOB_TRANSITIONS`) and log it with its reason."""
        with self._tx() as c:
            new = self._transition(c, job_id, event, reason=reason, error=error, error_stage=error_stage,
                                   retries=retries)
        if event is JobEvent.FINISH:  # a safe point: a damaged ledger then loses at most this job
            self._changes.after_commit(lambda: self.backup_quietly(job_id))
        return new

    def transition_many(self, job_ids: Iterable[str], event: JobEvent, *, reason: str) -> None:
        """One event for many jobs, in one transaction (a batch cancelled: all its queued jobs, or none)."""
        assert event not in (JobEvent.REVIVE, JobEvent.RETRY, JobEvent.FINISH), event
        with self._tx() as c:
            for job_id in job_ids:
                self._transition(c, job_id, event, reason=reason)

    def _transition(self, c: sqlite3.Connection, job_id: str, event: JobEvent, *, reason: str,
                    error: str | None = None, error_stage: Stage | str | None = None,
                    retries: int | None = None) -> JobState:
        job = _job_record(c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())
        new = next_job_state(job.state, event)
        attempts = job.attempts + (1 if event is JobEvent.START else 0)
        retries_left = job.retries_left
        if event is JobEvent.RETRY:
            assert retries_left > 0, f"retry of {job_id} with no budget left"
            retries_left -= 1
        if event is JobEvent.REVIVE:
            assert retries is not None
            retries_left = retries
        keep_error = event in (JobEvent.RETRY, JobEvent.FAIL)
        c.execute(
            "UPDATE jobs SET state = ?, attempts = ?, retries_left = ?, error = ?, error_stage = ?,"
            " updated_at = ? WHERE id = ?",
            (new.value, attempts, retries_left, error if keep_error else None,
             stage_name(error_stage) if (keep_error and error_stage) else None, time.time(), job_id),
        )
        if event is not JobEvent.START and event is not JobEvent.FINISH:
            # A stage left "running" (by a dead driver or worker, or decode when encode failed)
            # did not finish: back to pending. The stage that failed is already "failed".
            c.execute("UPDATE stages SET state = ? WHERE job_id = ? AND state = ?",
                      (StageState.PENDING.value, job_id, StageState.RUNNING.value))
        self._event(c, job_id, f"{job.state.value}->{new.value}", reason)  # EventKind.TRANSITION
        if keep_error and error_stage is not None:
            # The failed stage's row keeps only its latest traceback; this attempt's is kept
            # with its events so `show` can list every attempt's.
            row = c.execute("SELECT traceback FROM stages WHERE job_id = ? AND stage = ?",
                            (job_id, stage_name(error_stage))).fetchone()
            if row and row[0]:
                self._event(c, job_id, EventKind.TRACEBACK, row[0])
        return new

    def restore_job(self, spec: JobSpec, *, state: JobState, attempts: int, retries: int,
                    stages: dict[str, dict[str, Any]], reason: str) -> None:
        """Insert a job rebuilt by ``repair`` with the state and stage records its artifacts prove
        (``stages``: stage -> StageRecord fields for the stages found done; the rest are pending)."""
        now = time.time()
        with self._tx() as c:
            (pos,) = c.execute("SELECT COALESCE(MAX(position), -1) + 1 FROM jobs").fetchone()
            c.execute(
                "INSERT INTO jobs (id, name, spec_json, spec_hash, state, attempts, retries_left,"
                " position, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (spec.job_id, spec.name, json.dumps(spec.to_dict(), sort_keys=True), spec.spec_hash,
                 state.value, attempts, retries, pos, now, now))
            for stage in self.stage_names:
                c.execute("INSERT INTO stages (job_id, stage, state, updated_at) VALUES (?, ?, ?, ?)",
                          (spec.job_id, stage, StageState.PENDING.value, now))
                if stage in stages:
                    self._set_stage(c, spec.job_id, stage, StageState.DONE, **stages[stage])
            self._event(c, spec.job_id, EventKind.RESTORED, reason)

    # ---------------------------------------------------------------- stages
    def stages(self, job_id: str) -> dict[Stage | str, StageRecord]:
        """The job's stage rows in the ledger's order, keyed by :class:`Stage` (or a flow's own name)."""
        return self._stage_maps(" WHERE job_id = ?", (job_id,)).get(job_id, {})

    def all_stages(self, ids: Iterable[str] | None = None) -> dict[str, dict[Stage | str, StageRecord]]:
        """Every job's stage rows (of ``ids``, default every job; job id -> what :meth:`stages`
        gives), in one query: what a view of the whole folder reads (status, the report, the
        estimates' history), where one query per job cost more than the rows."""
        return self._stage_maps("", (), wanted=None if ids is None else set(ids))

    def _stage_maps(self, where: str, params: tuple[Any, ...], *,
                    wanted: set[str] | None = None) -> dict[str, dict[Stage | str, StageRecord]]:
        rows = self._conn.execute(
            "SELECT job_id, stage, state, artifact, sha256, size, seconds, error, traceback FROM stages" + where,
            params).fetchall()
        order = {name: i for i, name in enumerate(self.stage_names)}
        by_job: dict[str, list[StageRecord]] = {}
        for r in rows:
            if wanted is None or r[0] in wanted:
                by_job.setdefault(r[0], []).append(StageRecord(r[0], _stage_key(r[1]), StageState(r[2]), *r[3:]))
        return {job_id: {r.stage: r for r in sorted(recs, key=lambda r: order.get(stage_name(r.stage), len(order)))}
                for job_id, recs in by_job.items()}

    def set_stage(self, job_id: str, stage: Stage | str, event: StageEvent, *, artifact: str | None = None,
                  sha256: str | None = None, size: int | None = None, seconds: float | None = None,
                  error: str | None = None, traceback: str | None = None) -> None:
        """Move a stage row by ``event`` (STAGE_TRANSITIONS; anything else raises IllegalTransition)."""
        with self._tx(one_write=True) as c:  # (a read, the check, one UPDATE)
            self._move_stage(c, job_id, stage, event, artifact=artifact, sha256=sha256, size=size,
                             seconds=seconds, error=error, traceback=traceback)

    def set_stages(self, job_id: str, updates: list[tuple[Stage | str, StageEvent, dict[str, Any]]], *,
                   documents: dict[str, str] | None = None) -> None:
        """Several stage rows in one transaction (decode + encode finish together), with the text of
        the small files written beside the artifact (``documents``: name -> text)."""
        with self._tx() as c:
            for stage, event, fields in updates:
                self._move_stage(c, job_id, stage, event, **fields)
            for name, body in (documents or {}).items():
                self._set_document(c, job_id, name, body)

    # ---------------------------------------------------------------- documents
    # Small text files written beside a job's artifacts (params.json): the ledger keeps their exact
    # text, so a damaged copy on disk is rewritten on resume rather than rebuilt.
    def document(self, job_id: str, name: str) -> str | None:
        row = self._conn.execute("SELECT body FROM documents WHERE job_id = ? AND name = ?",
                                 (job_id, name)).fetchone()
        return None if row is None else row[0]

    def documents(self, job_id: str) -> dict[str, str]:
        """Every document recorded for the job: name -> text."""
        return dict(self._conn.execute("SELECT name, body FROM documents WHERE job_id = ?", (job_id,)).fetchall())

    def set_document(self, job_id: str, name: str, body: str) -> None:
        with self._tx(one_write=True) as c:
            self._set_document(c, job_id, name, body)

    def set_documents(self, job_ids: Iterable[str], name: str, body: str) -> None:
        """The same document for many jobs, in one transaction."""
        with self._tx() as c:
            for job_id in job_ids:
                self._set_document(c, job_id, name, body)

    def set_each_document(self, name: str, bodies: dict[str, str]) -> None:
        """Document ``name`` of each job of ``bodies`` (job id -> its text), in one transaction."""
        with self._tx() as c:
            for job_id, body in bodies.items():
                self._set_document(c, job_id, name, body)

    def with_document(self, name: str) -> dict[str, str]:
        """Job id -> the text of its document ``name``, for every job that has one."""
        return dict(self._conn.execute("SELECT job_id, body FROM documents WHERE name = ?", (name,)).fetchall())

    def delete_document(self, job_id: str, name: str) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM documents WHERE job_id = ? AND name = ?", (job_id, name))

    @staticmethod
    def _set_document(c: sqlite3.Connection, job_id: str, name: str, body: str) -> None:
        c.execute("INSERT OR REPLACE INTO documents (job_id, name, body, updated_at) VALUES (?, ?, ?, ?)",
                  (job_id, name, body, time.time()))

    def reset_stages(self, job_id: str, from_stage: Stage | str, *, reason: str) -> None:
        """Mark ``from_stage`` and every later stage pending (their inputs are being redone)."""
        names = self.stage_names
        later = list(names[names.index(stage_name(from_stage)):])
        with self._tx() as c:
            c.execute(
                f"UPDATE stages SET state = ?, artifact = NULL, sha256 = NULL, size = NULL,"
                f" seconds = NULL, error = NULL, traceback = NULL, updated_at = ?"
                f" WHERE job_id = ? AND stage IN ({','.join('?' * len(later))})",
                (StageState.PENDING.value, time.time(), job_id, *later),
            )
            self._event(c, job_id, f"reset:{stage_name(from_stage)}", reason)  # EventKind.RESET

    def _move_stage(self, c: sqlite3.Connection, job_id: str, stage: Stage | str, event: StageEvent,
                    **fields: Any) -> None:
        row = c.execute("SELECT state FROM stages WHERE job_id = ? AND stage = ?",
                        (job_id, stage_name(stage))).fetchone()
        assert row is not None, f"no stage row {job_id}/{stage_name(stage)}"
        self._set_stage(c, job_id, stage, STAGE_LIFECYCLE.next(StageState(row[0]), event), **fields)

    def _set_stage(self, c: sqlite3.Connection, job_id: str, stage: Stage | str, state: StageState, *,
                   artifact: str | None = None, sha256: str | None = None, size: int | None = None,
                   seconds: float | None = None, error: str | None = None,
                   traceback: str | None = None) -> None:
        cur = c.execute(
            "UPDATE stages SET state = ?, artifact = ?, sha256 = ?, size = ?, seconds = ?, error = ?,"
            " traceback = ?, updated_at = ? WHERE job_id = ? AND stage = ?",
            (state.value, artifact, sha256, size, seconds, error, traceback, time.time(), job_id,
             stage_name(stage)),
        )
        assert cur.rowcount == 1, f"no stage row {job_id}/{stage_name(stage)}"

    def drop_jobs(self, job_ids: Sequence[str], *, reason: str) -> None:
        """Remove jobs from the ledger (their rows, stages and documents; their events stay, and a
        folder-wide event names each), in one transaction, then a whole backup (a backup that still
        held them would bring them back on `repair`). Their folders on disk are left alone."""
        with self._tx() as c:
            for job_id in job_ids:
                for table, key in reversed(_JOB_ROWS):  # the stages and documents before the job
                    c.execute(f"DELETE FROM {table} WHERE {key} = ?", (job_id,))
                self._event(c, None, EventKind.DROPPED, f"{job_id}: {reason}")
        self.backup_quietly()

    # ---------------------------------------------------------------- tallies
    def tallies(self) -> list[JobTally]:
        """Every job as counts and timings need it, in two queries and without building its
        JobSpec (a reader that follows thousands of jobs, as the farm's metrics do, reads them often)."""
        seconds: dict[str, dict[str, float]] = {}
        for job_id, stage, secs in self._conn.execute(
                "SELECT job_id, stage, seconds FROM stages WHERE state = ? AND seconds IS NOT NULL",
                (StageState.DONE.value,)):
            seconds.setdefault(job_id, {})[stage] = float(secs)
        rows = self._conn.execute(
            "SELECT id, state, error, json_extract(spec_json, '$.model'), json_extract(spec_json, '$.width'),"
            " json_extract(spec_json, '$.height'), json_extract(spec_json, '$.frames'),"
            " json_extract(spec_json, '$.fps'), json_extract(spec_json, '$.steps') FROM jobs ORDER BY position")
        return [JobTally(id=jid, state=JobState(state), error=error, model=str(model), width=int(w or 0),
                         height=int(h or 0), frames=int(frames or 0), fps=float(fps or 0.0), steps=int(steps or 0),
                         stage_seconds=seconds.get(jid, {}))
                for jid, state, error, model, w, h, frames, fps, steps in rows]

    # ---------------------------------------------------------------- events
    def events_after(self, seq: int) -> list[tuple[int, Event]]:
        """The events after the one numbered ``seq`` (0: every one), oldest first, each with its
        number: events are only ever appended, so a reader that follows the ledger reads each once."""
        rows = self._conn.execute("SELECT seq, at, job_id, kind, detail FROM events WHERE seq > ? ORDER BY seq",
                                  (seq,)).fetchall()
        return [(n, Event.from_row(at, job_id, kind, detail)) for n, at, job_id, kind, detail in rows]

    def log(self, job_id: str | None, kind: EventKind, detail: str) -> None:
        with self._tx(one_write=True) as c:
            self._event(c, job_id, kind, detail)

    def log_many(self, events: Iterable[tuple[str | None, EventKind, str]]) -> None:
        """Several events (job id, kind, detail) in one transaction: one sync of the file for a
        batch's worth of them, where one each cost a sync per job."""
        with self._tx() as c:
            for job_id, kind, detail in events:
                self._event(c, job_id, kind, detail)

    def events(self, job_id: str | None = None) -> list[Event]:
        if job_id is None:
            rows = self._conn.execute("SELECT at, job_id, kind, detail FROM events ORDER BY seq").fetchall()
        else:
            rows = self._conn.execute("SELECT at, job_id, kind, detail FROM events WHERE job_id = ?"
                                      " ORDER BY seq", (job_id,)).fetchall()
        return [Event.from_row(*r) for r in rows]

    @staticmethod
    def _event(c: sqlite3.Connection, job_id: str | None, kind: EventKind | str, detail: str) -> None:
        """``kind``: an EventKind, or the stored forms of a transition and a reset (see EventKind)."""
        c.execute("INSERT INTO events (at, job_id, kind, detail) VALUES (?, ?, ?, ?)",
                  (time.time(), job_id, kind.value if isinstance(kind, EventKind) else kind, detail))


def _job_record(r: tuple[Any, ...]) -> JobRecord:
    (jid, name, spec_json, spec_hash, state, attempts, retries_left, error, error_stage, position,
     created_at, updated_at) = r
    return JobRecord(id=jid, name=name, spec=JobSpec.from_dict(json.loads(spec_json)),
                     spec_hash=spec_hash, state=JobState(state), attempts=attempts,
                     retries_left=retries_left, error=error, error_stage=error_stage,
                     position=position, created_at=created_at, updated_at=updated_at)


# -------------------------------------------------------------------- folder lock
class FolderLockedError(RuntimeError):
    """Another live process holds the output folder."""


class FolderLock:
    """``fcntl.flock`` on ``DIR/.lock``; the file names the holder (pid, host, start time).

    The kernel drops a flock when its process dies, so a lock left by a killed driver is stale by
    construction: the next run takes it over and overwrites the holder line.
    """

    def __init__(self, out_dir: str | Path):
        self.path = Path(out_dir) / LOCK_NAME
        self._fd: int | None = None
        self.taken_over: str | None = None  # the stale holder line replaced by acquire(), if any

    def acquire(self) -> None:
        fd = open_file(self.path, os.O_RDWR | os.O_CREAT)
        try:
            _flock_soon(fd, fcntl.LOCK_EX)
        except BlockingIOError:
            holder = _describe_holder(os.read(fd, 4096).decode(errors="replace"))
            os.close(fd)
            raise FolderLockedError(
                f"{self.path.parent} is in use by another pan2-render run ({holder}); wait for it to"
                f" finish, or stop that process, then run again"
            ) from None
        previous = os.read(fd, 4096).decode(errors="replace").strip()
        holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode() + b"\n", 0)
        os.fsync(fd)
        self._fd = fd
        self.taken_over = previous or None  # the stale holder we replaced, if any

    @staticmethod
    def holder(out_dir: str | Path) -> dict[str, Any] | None:
        """The live run holding ``out_dir`` (its holder line: pid, host, started; ``{}`` when it has
        not written one yet), or None. Asked of the kernel, which drops the lock of a process that
        died, by taking a shared lock for an instant: a pid in the holder line proves nothing (it
        may be of another PID namespace, or reused)."""
        path = Path(out_dir) / LOCK_NAME
        try:
            fd = open_file(path, os.O_RDONLY)
        except OSError:  # no lock file (never run), or one that is not ours to read (a link)
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    h = json.loads(os.read(fd, 4096).decode(errors="replace") or "{}")
                except ValueError:
                    h = {}
                return h if isinstance(h, dict) else {}
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "FolderLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _flock_soon(fd: int, operation: int, *, patience_s: float = 1.0) -> None:
    """``flock(fd, operation | LOCK_NB)``, tried again for up to ``patience_s``: ``status`` takes a
    shared lock for an instant to see whether a run holds the folder. A run holding it answers
    BlockingIOError after the wait."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _describe_holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on host {h['host']}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return f"holder: {text.strip() or 'unknown'}"
