"""The farm's durable queue: which batches it serves, in what order, and what was asked of them.

``ROOT/farm.sqlite`` holds one row per submitted batch (its output folder, owner, priority, state,
the jobs it asked for) and the farm's own events (submitted, paused, priority changed, ...). The
batches' jobs are in their folders' ledgers, as for `run`; this table only says which folders the
farm serves and how. The farm process is its only writer, in one transaction per change, so a farm
killed at any moment restarts from it: every batch not ended is served again from its ledger.

Batch lifecycle (:data:`BATCH_TRANSITIONS`)::

    active --pause--> paused --unpause--> active
    active/paused --cancel--> cancelling   (its running jobs stop; none starts)
    active/paused/cancelling --end--> failed | cancelled | done   (every job ended: failed if one
                                      failed, else cancelled if one was, else done)
    active/paused/cancelling --stop--> stopped   (its folder refused a write: disk full, permission)
    failed/cancelled/stopped/done --retry--> active   (failed, cancelled and interrupted jobs again)

A cancel is durable once answered: the batch is ``cancelling`` in the queue, its queued jobs are
cancelled in its ledger and its running ones marked there to be cancelled, so a farm killed before
they stop cancels them when it starts again, and renders nothing more of the batch.

A batch may be a video made through ``/v1/videos`` (its ``video_id`` and the request's ``video``
parameters), and may be hidden from the lists (``hidden``: deleted through the API, archived).

The file takes the ledger's care (``jobs/store.py``): a symlink at its name is refused, it is
checked on open (a damaged one raises :class:`QueueFileError`, naming the file and `farm repair`),
and after each change it is copied whole to ``ROOT/farm.sqlite.bak`` (a small file: a copy costs
about what the change's own fsyncs do). ``pan2-render farm repair`` (:func:`repair`) puts that
copy back; without a usable copy it starts an empty queue, and each batch's folder and ledger,
which are its truth, let ``submit`` serve it again with nothing done redone.
"""

from __future__ import annotations

import enum
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pan2render.hints import command
from pan2render.jobs import store
from pan2render.jobs.lifecycle import IllegalTransition, Lifecycle, Transition, transition_table
from pan2render.jobs.outdir import UnsafePathError

QUEUE_NAME = "farm.sqlite"
BACKUP_NAME = "farm.sqlite.bak"


class BatchState(str, enum.Enum):
    ACTIVE = "active"  # its jobs are queued or running
    PAUSED = "paused"  # no new job of it starts; running ones finish
    DONE = "done"
    FAILED = "failed"  # ended with failed jobs
    CANCELLING = "cancelling"  # cancelled; its running jobs stop at their next step boundary
    CANCELLED = "cancelled"
    STOPPED = "stopped"  # its output folder refused a write; retry once fixed

    @property
    def ended(self) -> bool:
        return self not in _NOT_ENDED


_NOT_ENDED = {BatchState.ACTIVE, BatchState.PAUSED, BatchState.CANCELLING}


def shown_state(state: BatchState, *, running: bool) -> str:
    """A batch's state as `queue` and the monitor show it: an active batch is running (a job of it
    runs) or queued (its jobs wait for GPUs); any other by its name (paused, cancelling, done, ...)."""
    if state is BatchState.ACTIVE:
        return "running" if running else "queued"
    return state.value
_SERVED = {BatchState.ACTIVE, BatchState.PAUSED}  # what a client may still pause, cancel or end


class BatchEvent(Transition):
    """An event of a batch's lifecycle: the states it leaves, the state it enters."""

    PAUSE = "pause", {BatchState.ACTIVE}, BatchState.PAUSED
    UNPAUSE = "unpause", {BatchState.PAUSED}, BatchState.ACTIVE
    CANCEL = "cancel", _SERVED, BatchState.CANCELLING
    # Every job ended (paused or cancelling while its last jobs ran: nothing is left to hold back):
    # failed if one failed, else cancelled if one was, else done.
    END_CANCELLED = "cancelled", _NOT_ENDED, BatchState.CANCELLED
    END_DONE = "done", _NOT_ENDED, BatchState.DONE
    END_FAILED = "failed", _NOT_ENDED, BatchState.FAILED
    STOP = "stop", _NOT_ENDED, BatchState.STOPPED
    RETRY = "retry", set(BatchState) - _NOT_ENDED, BatchState.ACTIVE


BATCH_TRANSITIONS: dict[tuple[BatchState, BatchEvent], BatchState] = transition_table(BatchEvent)
BATCH_LIFECYCLE: Lifecycle[BatchState, BatchEvent] = Lifecycle("batch", BATCH_TRANSITIONS)


class QueueEventKind(str, enum.Enum):
    """What an event of the queue records (the ``events.kind`` column). A transition is stored as
    its :class:`BatchEvent`'s value, so those kinds take their spelling from there."""

    SUBMITTED = "submitted"
    PAUSE = BatchEvent.PAUSE.value
    UNPAUSE = BatchEvent.UNPAUSE.value
    CANCEL = BatchEvent.CANCEL.value
    END_CANCELLED = BatchEvent.END_CANCELLED.value
    END_DONE = BatchEvent.END_DONE.value
    END_FAILED = BatchEvent.END_FAILED.value
    STOP = BatchEvent.STOP.value
    RETRY = BatchEvent.RETRY.value
    PRIORITY = "priority"
    HIDDEN = "hidden"  # deleted through the API or archived: no longer listed
    REPAIRED = "repaired"  # `farm repair` put the backup back, or started an empty queue

    @classmethod
    def of(cls, event: BatchEvent) -> QueueEventKind:
        return cls(event.value)


class QueueError(RuntimeError):
    """A request the queue refuses (an unknown batch, a transition its state does not allow)."""


class QueueFileError(store.StoreError):
    """``farm.sqlite`` cannot be used (damaged, not a queue, unreadable, not writable, or gone while
    its backup is there); the message names the file, what is wrong and what to do."""

    noun = "farm queue"


@dataclass(frozen=True)
class QueuedBatch:
    id: str  # "b<seq>": short to type, stable across restarts
    seq: int  # submission order
    out_dir: str
    batch_path: str | None
    owner: str
    priority: int
    state: BatchState
    job_ids: list[str]
    submitted_at: float
    updated_at: float
    reason: str | None  # why it is in its state (the last transition's reason)
    preempt: bool  # its jobs may stop a lower-priority batch's sampling at a step boundary
    video_id: str | None = None  # a video made through /v1/videos: its id there
    video: dict[str, Any] | None = None  # and what its request asked for (model name, size, seconds, ...)
    hidden: bool = False  # deleted through the API or archived: no longer listed

    @property
    def paused(self) -> bool:
        return self.state is BatchState.PAUSED


_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, out_dir TEXT NOT NULL, batch_path TEXT, owner TEXT NOT NULL,
    priority INTEGER NOT NULL, state TEXT NOT NULL, job_ids TEXT NOT NULL, submitted_at REAL NOT NULL,
    updated_at REAL NOT NULL, reason TEXT, preempt INTEGER NOT NULL DEFAULT 0, video_id TEXT, video TEXT,
    hidden INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, batch TEXT, kind TEXT NOT NULL, detail TEXT NOT NULL
);
"""


def _repair_hint(path: Path) -> str:
    return (f"`{command('farm', 'repair', '--root', path.parent)}` puts back its backup {BACKUP_NAME}, or "
            f"starts an empty queue without a usable one (the damaged file is kept beside it)")


# An existing farm.sqlite without tables is damage, not a fresh queue: the farm creates it whole.
_QUEUE = store.Schema(script=_SCHEMA, tables=("batches", "events"), error=QueueFileError, repair=_repair_hint)


_COLUMNS = ("seq", "out_dir", "batch_path", "owner", "priority", "state", "job_ids", "submitted_at", "updated_at",
            "reason", "preempt", "video_id", "video", "hidden")
# Columns a queue written by an earlier version lacks, added when it is opened for writing.
_ADDED_COLUMNS = {"video_id": "TEXT", "video": "TEXT", "hidden": "INTEGER NOT NULL DEFAULT 0"}
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM batches"
MAX_LIST = 100  # most rows one page of a list returns


class FarmQueue:
    def __init__(self, root: Path, *, readonly: bool = False):
        """Open ``ROOT/farm.sqlite`` (created if absent; the farm holds ROOT's lock). Raises
        QueueFileError if it is damaged, or gone while its backup is there (starting an empty queue
        would drop every batch it served); UnsafePathError if it or its journal is a symlink.
        ``readonly``: for the API's reads, beside the farm's main thread that writes."""
        self.path = Path(root) / QUEUE_NAME
        self.backup_error: str | None = None  # why the last backup failed, until one succeeds
        self.changes = 0  # changes made through this object: what was read before one is stale
        self.readonly = readonly
        if readonly:
            self._conn = store.open_reader(self.path, _QUEUE, check_same_thread=False)
            return
        copy = self.path.with_name(BACKUP_NAME)
        if not self.path.exists() and copy.exists():
            raise QueueFileError(self.path, f"is missing, while its backup {copy} is there (this farm served "
                                            f"batches)", _repair_hint(self.path))
        # Any thread: the Farm that opens it may be served from another thread (the tests do).
        self._conn = store.open_writer(self.path, _QUEUE, empty_ok=False, check_same_thread=False)
        self._add_columns()
        self._backup_quietly()  # the file just passed its check: a good copy, and one there from the start

    def _add_columns(self) -> None:
        have = {r[1] for r in self._conn.execute("PRAGMA table_info(batches)")}
        missing = [(name, decl) for name, decl in _ADDED_COLUMNS.items() if name not in have]
        if missing:
            with store.transaction(self._conn) as c:
                for name, decl in missing:
                    c.execute(f"ALTER TABLE batches ADD COLUMN {name} {decl}")
        self._conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS batches_video ON batches(video_id)")

    def close(self) -> None:
        self._conn.close()

    def backup(self) -> Path:
        """Copy the queue whole to ``farm.sqlite.bak`` (a temp name, then a rename)."""
        return store.backup(self._conn, self.path.with_name(BACKUP_NAME))

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One change, then a backup: the copy is never more than a failed backup behind."""
        with store.transaction(self._conn) as c:
            yield c
        self.changes += 1
        self._backup_quietly()

    def _backup_quietly(self) -> None:
        """A failed backup (a full disk) never fails the change it follows; the next one tries again."""
        try:
            self.backup()
            self.backup_error = None
        except (OSError, sqlite3.Error) as e:
            self.backup_error = f"{type(e).__name__}: {e}"

    # ------------------------------------------------------------------ reading
    def batches(self, *, include_ended: bool = True, include_hidden: bool = True) -> list[QueuedBatch]:
        where = [] if include_ended else [f"state IN ({', '.join(repr(s.value) for s in _NOT_ENDED)})"]
        where += [] if include_hidden else ["hidden = 0"]
        rows = self._conn.execute(_SELECT + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY seq")
        return [_row(r) for r in rows.fetchall()]

    def ended(self, limit: int) -> list[QueuedBatch]:
        """The latest ``limit`` ended batches not hidden, in submission order."""
        rows = self._conn.execute(_SELECT + f" WHERE state NOT IN ({', '.join(repr(s.value) for s in _NOT_ENDED)})"
                                  " AND hidden = 0 ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
        return [_row(r) for r in reversed(rows)]

    def get(self, batch_id: str) -> QueuedBatch:
        seq = _seq(batch_id)
        row = self._conn.execute(_SELECT + " WHERE seq = ?", (seq,)).fetchone() if seq else None
        if row is None:
            raise QueueError(f"no batch {batch_id!r} on this farm (`pan2-render queue` lists them)")
        return _row(row)

    def by_video(self, video_id: str) -> QueuedBatch | None:
        row = self._conn.execute(_SELECT + " WHERE video_id = ?", (video_id,)).fetchone()
        return None if row is None else _row(row)

    def videos(self, *, owner: str | None, after: str | None, limit: int, newest_first: bool
               ) -> tuple[list[QueuedBatch], bool]:
        """A page of the videos made through the API (``owner``: one user's; None: everyone's), in
        order of creation, after the video ``after``; and whether more follow."""
        where, args = ["video_id IS NOT NULL", "hidden = 0"], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if after is not None:
            anchor = self.by_video(after)
            if anchor is None:
                raise QueueError(f"no video {after!r} to list after")
            where.append("seq < ?" if newest_first else "seq > ?")
            args.append(anchor.seq)
        order = "DESC" if newest_first else "ASC"
        rows = self._conn.execute(_SELECT + f" WHERE {' AND '.join(where)} ORDER BY seq {order} LIMIT ?",
                                  (*args, limit + 1)).fetchall()
        return [_row(r) for r in rows[:limit]], len(rows) > limit

    def active_for(self, out_dir: str) -> QueuedBatch | None:
        """The batch not ended whose output folder is ``out_dir``, if any."""
        return next((b for b in self.batches(include_ended=False) if b.out_dir == out_dir), None)

    def events(self, batch_id: str | None = None, *, limit: int = 200) -> list[dict[str, Any]]:
        q = "SELECT at, batch, kind, detail FROM events"
        rows = (self._conn.execute(q + " WHERE batch = ? ORDER BY seq DESC LIMIT ?", (batch_id, limit))
                if batch_id else self._conn.execute(q + " ORDER BY seq DESC LIMIT ?", (limit,))).fetchall()
        return [{"at": at, "batch": b, "kind": k, "detail": d} for at, b, k, d in reversed(rows)]

    # ------------------------------------------------------------------ writing
    def add(self, *, out_dir: str, batch_path: str | None, owner: str, priority: int, job_ids: list[str],
            preempt: bool = False, video_id: str | None = None,
            video: dict[str, Any] | None = None) -> QueuedBatch:
        now = time.time()
        with self._tx() as c:
            cur = c.execute("INSERT INTO batches (out_dir, batch_path, owner, priority, state, job_ids, submitted_at,"
                            " updated_at, reason, preempt, video_id, video)"
                            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (out_dir, batch_path, owner, priority, BatchState.ACTIVE.value, json.dumps(job_ids),
                             now, now, "submitted", int(preempt), video_id,
                             None if video is None else json.dumps(video, sort_keys=True)))
            seq = int(cur.lastrowid or 0)
            what = f"video {video_id}" if video_id else f"{len(job_ids)} job(s)"
            self._event(c, f"b{seq}", QueueEventKind.SUBMITTED, f"{what} into {out_dir} by {owner}, "
                        f"priority {priority}" + (", preempting" if preempt else ""))
        return self.get(f"b{seq}")

    def transition(self, batch_id: str, event: BatchEvent, *, reason: str) -> QueuedBatch:
        b = self.get(batch_id)
        try:
            new = BATCH_LIFECYCLE.next(b.state, event)
        except IllegalTransition as e:
            allowed = [a.value for a in e.allowed]
            raise QueueError(f"batch {b.id} is {b.state.value}: it cannot be {_past(event)} "
                             f"(from {b.state.value}: {', '.join(allowed) or 'nothing'})") from None
        with self._tx() as c:
            c.execute("UPDATE batches SET state = ?, updated_at = ?, reason = ? WHERE seq = ?",
                      (new.value, time.time(), reason, b.seq))
            self._event(c, b.id, QueueEventKind.of(event), reason)
        return self.get(b.id)

    def set_priority(self, batch_id: str, priority: int) -> QueuedBatch:
        b = self.get(batch_id)
        with self._tx() as c:
            c.execute("UPDATE batches SET priority = ?, updated_at = ? WHERE seq = ?", (priority, time.time(), b.seq))
            self._event(c, b.id, QueueEventKind.PRIORITY, f"{b.priority} -> {priority}")
        return self.get(b.id)

    def hide(self, batch_id: str, *, reason: str) -> QueuedBatch:
        """No longer listed (deleted through the API, archived); an ended batch only."""
        b = self.get(batch_id)
        if not b.state.ended:
            raise QueueError(f"batch {b.id} is {b.state.value}: cancel it or let it end before it is hidden")
        with self._tx() as c:
            c.execute("UPDATE batches SET hidden = 1, updated_at = ? WHERE seq = ?", (time.time(), b.seq))
            self._event(c, b.id, QueueEventKind.HIDDEN, reason)
        return self.get(b.id)

    def log(self, batch_id: str | None, kind: QueueEventKind, detail: str) -> None:
        with self._tx() as c:
            self._event(c, batch_id, kind, detail)

    @staticmethod
    def _event(c: sqlite3.Connection, batch_id: str | None, kind: QueueEventKind, detail: str) -> None:
        c.execute("INSERT INTO events (at, batch, kind, detail) VALUES (?, ?, ?, ?)",
                  (time.time(), batch_id, kind.value, detail))


def repair(root: Path) -> str:
    """``pan2-render farm repair``: put a damaged or missing ``farm.sqlite`` back from its backup,
    or, without a usable backup, start an empty queue. The caller holds ROOT's lock (no farm runs).
    The damaged file and its journal are moved aside, never deleted. Returns what was done."""
    path, copy = Path(root) / QUEUE_NAME, Path(root) / BACKUP_NAME
    problem = _problem(path)
    if problem is None:
        return f"the farm queue {path} is healthy; nothing was changed"
    copy_problem = _problem(copy)
    if copy_problem is None:
        aside = store.restore(copy, path, _QUEUE)  # a failure here (a full disk) raises: nothing is lost
        done = f"put back from its backup {copy.name}"
    else:
        aside = store.move_aside(path) + store.move_aside(copy)  # (the copy: the new queue's backup replaces it)
        store.create_whole(path, _QUEUE)
        done = (f"started empty, as its backup {copy.name} {copy_problem}. Each batch's folder and ledger "
                f"still hold its jobs: `{command('submit', 'BATCH', '--out', 'DIR')}` serves it again from "
                f"there, redoing nothing done (give its --priority again; a paused batch, pause it again)")
    queue = FarmQueue(path.parent)
    try:
        queue.log(None, QueueEventKind.REPAIRED, f"{QUEUE_NAME} {problem}: {done}")
    finally:
        queue.close()
    kept = f"; kept as they were: {', '.join(p.name for p in aside)}" if aside else ""
    return f"the farm queue {path} {problem}: {done}{kept}"


def _problem(path: Path) -> str | None:
    """What is wrong with a queue file, as a phrase ("is damaged (...)"); None: nothing."""
    if not os.path.lexists(path):
        return "is missing"
    try:
        store.open_reader(path, _QUEUE).close()
    except QueueFileError as e:
        return e.problem
    except UnsafePathError:
        return "is a symbolic link"
    return None


def _past(event: BatchEvent) -> str:
    return {BatchEvent.PAUSE: "paused", BatchEvent.UNPAUSE: "unpaused", BatchEvent.CANCEL: "cancelled",
            BatchEvent.END_CANCELLED: "marked cancelled",
            BatchEvent.RETRY: "retried", BatchEvent.STOP: "stopped"}.get(event, f"marked {event.value}")


def _seq(batch_id: str) -> int | None:
    """The sequence number a batch id ("b12") names; None for anything else (no number past what
    SQLite's integers hold: such an id names no batch)."""
    text = batch_id.strip().lower().removeprefix("b")
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _row(r: tuple[Any, ...]) -> QueuedBatch:
    d = dict(zip(_COLUMNS, r))
    return QueuedBatch(id=f"b{d['seq']}", seq=d["seq"], out_dir=d["out_dir"], batch_path=d["batch_path"],
                       owner=d["owner"], priority=d["priority"], state=BatchState(d["state"]),
                       job_ids=json.loads(d["job_ids"]), submitted_at=d["submitted_at"], updated_at=d["updated_at"],
                       reason=d["reason"], preempt=bool(d["preempt"]), video_id=d["video_id"],
                       video=None if d["video"] is None else json.loads(d["video"]), hidden=bool(d["hidden"]))
