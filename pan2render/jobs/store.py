"""The SQLite files pan2-render keeps (a batch's ledger, the farm's queue): opened, checked, changed
and copied one way.

Each kind of file is a :class:`Schema`: its tables, the error type that names it, and the remedy
that error gives. Opening a file of it:

- refuses a symlink at its name or at its journal's (SQLite opens both by name, so no flag of ours
  stops it following one: a write through a link planted there would land outside the folder);
- creates a missing file whole (:func:`create_whole`): built under an exclusive temp name, then
  renamed into place, so a reader never meets a file without its tables;
- sets the classic rollback journal, fully synced (``journal_mode=DELETE``, ``synchronous=FULL``),
  not WAL: one writer and occasional readers, so WAL's concurrency buys nothing, while its shared
  memory (``-shm``) breaks on the network filesystems render folders often live on;
- checks the file (``PRAGMA quick_check``, then the schema's tables) and raises the schema's
  error, naming the file, the problem and the remedy, never a raw ``sqlite3`` error.

A change is one :func:`transaction`, or a savepoint of a group of them (:class:`Changes`).
:func:`backup` copies a whole file with SQLite's online backup API, written whole (a temp name,
fsync, rename); :func:`restore` puts such a copy back in place of a damaged file, which it moves
aside, never deletes. SQLite's errors are told apart by their result
code's name (:func:`failure`), never by their text.
"""

from __future__ import annotations

import enum
import errno
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from pan2render.jobs.disk import sqlite_error_name
from pan2render.jobs.outdir import create_new, refuse_link

BUSY_TIMEOUT_S = 10.0  # a reader waits this long on a writer's change (a change is a few rows)


class StoreError(RuntimeError):
    """A database file cannot be used (damaged, not of its kind, unreadable, not writable); the
    message names the file, what is wrong and what to do. One subclass per kind of file names it."""

    noun = "database"  # how the message names the file ("the ledger DIR/ledger.sqlite is damaged")

    def __init__(self, path: Path, problem: str, remedy: str):
        self.path = path
        self.problem = problem
        self.remedy = remedy
        super().__init__(f"the {self.noun} {path} {problem}; {remedy}")


@dataclass(frozen=True)
class Schema:
    """One kind of database file."""

    script: str  # CREATE TABLE IF NOT EXISTS ... and its first rows (INSERT OR IGNORE): run at every writer's open
    tables: tuple[str, ...]  # the tables a file of this kind holds: one missing means damage
    error: type[StoreError]  # raised for a file of this kind that cannot be used
    repair: Callable[[Path], str]  # the remedy for a damaged file at this path (the command that repairs it)
    empty: str = "is empty (it holds no table: it was emptied)"  # the problem a file without tables is
    empty_remedy: Callable[[Path], str] | None = None  # what to do about one; None: ``repair``'s


class Failure(enum.Enum):
    """What a sqlite3 error means, by the names of the result codes that say it."""

    DISK_FULL = ("SQLITE_FULL",)
    LOCKED = ("SQLITE_BUSY", "SQLITE_LOCKED")  # another connection is mid-change: not damage
    NO_ACCESS = ("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")  # read-only, or another user's
    DAMAGED = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
    OTHER = ()  # an I/O error, a misuse: the file cannot be read


def failure(e: sqlite3.Error) -> Failure:
    name = sqlite_error_name(e)
    return next((f for f in Failure if name in f.value), Failure.OTHER)


def journal(path: Path) -> Path:
    """The rollback journal SQLite writes beside ``path`` during a change (and leaves if killed)."""
    return path.with_name(path.name + "-journal")


def refuse_links(path: Path) -> None:
    """UnsafePathError if the file or its journal is a symlink (both opened by SQLite by name)."""
    refuse_link(path)
    refuse_link(journal(path))


# ------------------------------------------------------------------------------------ opening
def open_writer(path: Path, schema: Schema, *, empty_ok: bool = True,
                check_same_thread: bool = True) -> sqlite3.Connection:
    """A connection to change ``path``, created whole if absent. Raises ``schema.error`` if the
    file is damaged or not of its kind (``empty_ok``: a file without tables is filled as a fresh
    one), UnsafePathError if it or its journal is a symlink."""
    refuse_links(path)
    if not path.exists():
        create_whole(path, schema)
    with _opening(path, schema, check_same_thread=check_same_thread) as conn:
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("PRAGMA synchronous=FULL")
        check_integrity(conn, path, schema, empty_ok=empty_ok)
        conn.executescript(schema.script)
    return conn


def open_reader(path: Path, schema: Schema, *, check_same_thread: bool = True) -> sqlite3.Connection:
    """A connection that only reads an existing file (the file itself or its backup)."""
    # Not `mode=ro`: a read-only connection cannot roll back the hot journal a killed writer may
    # leave, so a reader would fail until the next writer. query_only forbids writes; that roll
    # back writes, so links are refused here too.
    refuse_links(path)
    with _opening(path, schema, check_same_thread=check_same_thread) as conn:
        conn.execute("PRAGMA query_only=ON")
        check_integrity(conn, path, schema, empty_ok=False)
    return conn


def check_integrity(conn: sqlite3.Connection, path: Path, schema: Schema, *, empty_ok: bool) -> None:
    """Raise ``schema.error`` unless ``conn`` is a readable file of the schema (or, if ``empty_ok``,
    an empty one about to become one). Cheap: quick_check reads each page once, and these files
    are a few MB at most."""
    (verdict,) = conn.execute("PRAGMA quick_check").fetchone()
    if verdict != "ok":
        raise schema.error(path, f"is damaged (SQLite's check: {verdict})", schema.repair(path))
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables and empty_ok:
        return
    if not tables:
        raise schema.error(path, schema.empty, (schema.empty_remedy or schema.repair)(path))
    missing = [t for t in schema.tables if t not in tables]
    if missing:
        raise schema.error(path, f"lacks the table(s) {', '.join(missing)}: it is not a pan2-render "
                                 f"{schema.error.noun} or it is damaged", schema.repair(path))


@contextmanager
def _opening(path: Path, schema: Schema, *, check_same_thread: bool = True) -> Iterator[sqlite3.Connection]:
    """A connection to ``path`` for the block that sets it up: closed if that fails, with a
    sqlite3 error raised as the StoreError it means."""
    try:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=check_same_thread)
    except sqlite3.Error as e:
        raise_as_store_error(path, e, schema)
    try:
        yield conn
    except sqlite3.Error as e:
        conn.close()
        raise_as_store_error(path, e, schema)
    except BaseException:
        conn.close()
        raise


def raise_as_store_error(path: Path, e: sqlite3.Error, schema: Schema) -> NoReturn:
    """Raise a sqlite3 error met on opening as the ``schema.error`` it means. A full disk and a
    writer mid-change stay themselves: not damage (the CLI's disk-full handling names the folder
    and what to free)."""
    kind = failure(e)
    if kind in (Failure.DISK_FULL, Failure.LOCKED):
        raise e
    if kind is Failure.NO_ACCESS:
        raise schema.error(path, f"cannot be written ({e}): the file or its folder is read-only, or belongs "
                                 "to another user",
                           f"give this user write access to {path} and to {path.parent} (SQLite writes a "
                           f"journal beside the {schema.error.noun}), then run the command again") from e
    raise schema.error(path, f"cannot be read ({e})", schema.repair(path)) from e


# ------------------------------------------------------------------------------------ changing
@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One change: BEGIN IMMEDIATE (the write lock taken now, not at the first write) ... COMMIT,
    rolled back if the block raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        # SQLite rolls back by itself on some errors (SQLITE_FULL, SQLITE_IOERR); a second
        # ROLLBACK would raise "no transaction is active" over the error that matters.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


class CommitError(RuntimeError):
    """A group's commit failed (its cause: SQLite's error): none of its changes were made."""


class Changes:
    """A writer connection's changes, each one :func:`transaction`, or, inside :meth:`grouped`, each
    a savepoint of one transaction that the group commits when it ends: the changes of one step
    (a reply recorded and the next stage marked started) then cost one commit, its four fsyncs,
    instead of one each. Each change is still all or nothing; the group's changes reach the disk
    together. ``after_commit`` runs what must follow the changes' commit (a backup that copies them).

    If SQLite rolls the whole group back under a change (it does on a full disk or an I/O error)
    or the commit fails, the changes the group had made are gone while their writer believes them
    made: the error is raised, and raised again for every later change, so the writer stops as on
    a full disk and the next one starts from the file (``lost``)."""

    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn
        self._depth = 0
        self._after: list[Callable[[], None]] = []
        self.lost: BaseException | None = None

    @contextmanager
    def change(self, *, one_write: bool = False) -> Iterator[sqlite3.Connection]:
        """``one_write``: the block makes at most one write statement, after whatever it reads and
        checks: inside a group it needs no savepoint (a write that fails is undone by SQLite, the
        statement alone or the whole group, which ``lost`` then says), which cost two statements a
        change, a quarter of all a scheduler's ledger ran."""
        if self.lost is not None:
            raise self.lost
        if not self._depth:
            with transaction(self._conn) as c:
                yield c
            return
        if not self._conn.in_transaction:
            self._conn.execute("BEGIN IMMEDIATE")
        if one_write:
            try:
                yield self._conn
            except BaseException as e:
                if not self._conn.in_transaction:  # SQLite rolled the whole group back
                    self.lost = e
                raise
            return
        self._conn.execute("SAVEPOINT change")
        try:
            yield self._conn
            self._conn.execute("RELEASE change")
        except BaseException as e:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK TO change")
                self._conn.execute("RELEASE change")
            else:  # SQLite rolled the whole group back: what it had made is gone too
                self.lost = e
            raise

    @contextmanager
    def grouped(self) -> Iterator[None]:
        """The changes made inside as one transaction, committed at the end (also when the block
        raises: what was changed before stays changed). Nested, the outermost commits."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self._commit()

    def after_commit(self, run: Callable[[], None]) -> None:
        """``run()`` once the changes made so far are committed: now, outside a group."""
        if self._depth and self._conn.in_transaction:
            self._after.append(run)
        else:
            run()

    def _commit(self) -> None:
        after, self._after = self._after, []
        if self._conn.in_transaction:
            try:
                self._conn.execute("COMMIT")
            except sqlite3.Error as e:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                self.lost = e
                raise CommitError(f"a group of changes was not committed: {e}") from e
        for run in after:
            run()


# ------------------------------------------------------------------------------------ whole files
def create_whole(path: Path, schema: Schema) -> None:
    """A fresh file of the schema at ``path``, made under a temp name and renamed into place: a
    reader (``status`` while ``run`` starts) sees no file or one with its whole schema, never one
    without tables, which would read as damaged or empty. Writers hold their folder's lock, so
    nothing races the rename."""

    def fill(tmp: Path) -> None:
        with _opening(tmp, schema) as conn:
            try:
                conn.execute("PRAGMA journal_mode=DELETE")
                conn.executescript(schema.script)
            finally:
                conn.close()

    write_whole(path, fill, tmp=path.with_name(f".{path.name}.new-{os.getpid()}"))


def backup(conn: sqlite3.Connection, dest: Path) -> Path:
    """Copy ``conn``'s database to ``dest`` with SQLite's online backup API (a consistent snapshot
    even mid-transaction elsewhere), via a temp name and a rename: the previous copy stays whole
    until the new one is."""

    def fill(tmp: Path) -> None:
        target = sqlite3.connect(tmp)
        try:
            conn.backup(target)
        finally:
            target.close()

    write_whole(dest, fill, tmp=dest.with_name(f".{dest.name}.tmp-{os.getpid()}"))
    return dest


def restore(copy: Path, dest: Path, schema: Schema) -> list[Path]:
    """Put ``copy`` (a backup) in place of ``dest``, once it passes the check: the file at
    ``dest`` and its journal are moved aside first (:func:`move_aside`; where they went is
    returned). Raises ``schema.error`` for a damaged copy and FileNotFoundError for a missing one,
    leaving ``dest`` alone."""
    if not copy.is_file():  # (opening it would create an empty file there)
        raise FileNotFoundError(errno.ENOENT, f"no backup at {copy}", str(copy))
    source = open_reader(copy, schema)
    try:
        aside = move_aside(dest)
        backup(source, dest)
    finally:
        source.close()
    return aside


def move_aside(path: Path) -> list[Path]:
    """Move the file at ``path`` and its journal (which belongs to it: left beside a new file,
    SQLite would roll it into that one) to ``*.damaged-<time>``; returns their new paths."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    for victim in (path, journal(path)):
        if os.path.lexists(victim):
            dest = victim.with_name(f"{victim.name}.damaged-{stamp}")
            os.replace(victim, dest)
            moved.append(dest)
    return moved


def write_whole(dest: Path, fill: Callable[[Path], None], *, tmp: Path) -> None:
    """``fill(tmp)`` writes a database file; it is made durable and renamed to ``dest``, so
    ``dest`` is always either what it was or the whole new file. A failure leaves no temp file."""
    refuse_link(dest)
    try:
        os.close(create_new(tmp))  # the temp name is predictable: never a link planted there
        fill(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
