"""The SQLite store under the ledger and the farm's queue: links refused, damage refused with its
remedy, the check on open, transactions, errors told apart by name, whole backups and restore."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from pan2render.jobs import store
from pan2render.jobs.outdir import UnsafePathError


class NotesError(store.StoreError):
    noun = "notebook"


def _repair(path: Path) -> str:
    return f"`fix-notes {path}` mends it"


NOTES = store.Schema(
    script="CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL);"
           "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
           "INSERT OR IGNORE INTO meta VALUES ('version', '1');",
    tables=("notes", "meta"), error=NotesError, repair=_repair)


def _notes(path: Path, *bodies: str) -> None:
    conn = store.open_writer(path, NOTES)
    try:
        with store.transaction(conn):
            conn.executemany("INSERT INTO notes (body) VALUES (?)", [(b,) for b in bodies])
    finally:
        conn.close()


def _bodies(path: Path) -> list[str]:
    conn = store.open_reader(path, NOTES)
    try:
        return [r[0] for r in conn.execute("SELECT body FROM notes ORDER BY id")]
    finally:
        conn.close()


# ------------------------------------------------------------------------------------ opening
def test_a_fresh_file_is_created_whole_and_reopened_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "notes.sqlite"
    _notes(path, "a", "b")
    _notes(path, "c")
    assert _bodies(path) == ["a", "b", "c"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.sqlite"]  # no temp, no journal left
    conn = store.open_writer(path, NOTES)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
        assert conn.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
        assert conn.execute("SELECT value FROM meta").fetchall() == [("1",)]  # first rows written once
    finally:
        conn.close()


@pytest.mark.parametrize("at", ["file", "journal"])
@pytest.mark.parametrize("opening", ["writer", "reader"])
def test_a_symlink_at_the_file_or_its_journal_is_refused(tmp_path: Path, at: str, opening: str) -> None:
    path = tmp_path / "notes.sqlite"
    _notes(path, "a")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not yours")
    link = path if at == "file" else store.journal(path)
    if at == "file":
        path.unlink()
    os.symlink(elsewhere, link)
    with pytest.raises(UnsafePathError, match=f"{link} is a symbolic link"):
        (store.open_writer if opening == "writer" else store.open_reader)(path, NOTES)
    assert elsewhere.read_bytes() == b"not yours"


def _damage(path: Path, how: str) -> None:
    if how == "garbage":
        path.write_bytes(os.urandom(8192))
    elif how == "header":  # a page of another kind of file where SQLite's header should be
        path.write_bytes(b"PK\x03\x04" + path.read_bytes()[4:])
    elif how == "page":  # a b-tree page overwritten: reading it fails
        data = bytearray(path.read_bytes())
        data[4096:8192] = os.urandom(4096)
        path.write_bytes(bytes(data))
    elif how == "freelist":  # the header's count of free pages wrong: only SQLite's check finds it
        data = bytearray(path.read_bytes())
        data[36] ^= 0xFF
        path.write_bytes(bytes(data))
    else:  # a table gone: a file of another kind, or of this one damaged
        conn = sqlite3.connect(path)
        conn.execute("DROP TABLE notes")
        conn.close()


@pytest.mark.parametrize("how", ["garbage", "header", "page", "freelist", "table"])
@pytest.mark.parametrize("opening", ["writer", "reader"])
def test_a_damaged_file_is_refused_naming_it_the_problem_and_the_remedy(tmp_path: Path, how: str,
                                                                        opening: str) -> None:
    path = tmp_path / "notes.sqlite"
    _notes(path, *[f"note {i}" * 200 for i in range(40)])  # several pages
    _damage(path, how)
    before = path.read_bytes()
    with pytest.raises(NotesError) as err:
        (store.open_writer if opening == "writer" else store.open_reader)(path, NOTES)
    print(err.value)
    assert str(err.value).startswith(f"the notebook {path} ")
    assert err.value.path == path and err.value.remedy == _repair(path)
    assert str(err.value).endswith(f"; `fix-notes {path}` mends it")
    expected = {"garbage": ("cannot be read",), "header": ("cannot be read",),
                "page": ("is damaged (SQLite's check", "cannot be read (database disk image is malformed)"),
                "freelist": ("is damaged (SQLite's check: *** in database main ***",),
                "table": ("lacks the table(s) notes: it is not a pan2-render notebook",)}[how]
    assert err.value.problem.startswith(expected)
    assert path.read_bytes() == before  # refused, not "fixed" by writing over it


def test_an_empty_file_is_fresh_to_a_writer_that_allows_it_and_damage_to_the_others(tmp_path: Path) -> None:
    path = tmp_path / "notes.sqlite"
    path.write_bytes(b"")
    with pytest.raises(NotesError, match="is empty"):
        store.open_reader(path, NOTES)
    with pytest.raises(NotesError, match="is empty .*; `fix-notes"):
        store.open_writer(path, NOTES, empty_ok=False)
    assert path.read_bytes() == b""
    store.open_writer(path, NOTES).close()
    assert _bodies(path) == []


def test_a_read_only_file_says_whose_access_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notes.sqlite"
    _notes(path, "a")
    real = sqlite3.connect
    # A read-only file (the tests may run as root, whom chmod does not stop): SQLite's own ro mode.
    monkeypatch.setattr(sqlite3, "connect", lambda p, **kw: real(f"file:{p}?mode=ro", uri=True, **kw))
    with pytest.raises(NotesError) as err:
        store.open_writer(path, NOTES)
    print(err.value)
    assert "cannot be written" in err.value.problem
    assert f"give this user write access to {path} and to {tmp_path}" in err.value.remedy
    assert "journal beside the notebook" in err.value.remedy


# ------------------------------------------------------------------------------------ changing
def test_a_transaction_that_raises_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "notes.sqlite"
    _notes(path, "kept")
    conn = store.open_writer(path, NOTES)
    try:
        with pytest.raises(RuntimeError, match="half-way"), store.transaction(conn) as c:
            c.execute("INSERT INTO notes (body) VALUES ('lost')")
            raise RuntimeError("half-way")
        assert not conn.in_transaction
        # SQLite rolls some failures back itself (a full disk): the error that matters comes out,
        # not "no transaction is active" from a second rollback.
        with pytest.raises(KeyError, match="the real one"), store.transaction(conn) as c:
            c.execute("INSERT INTO notes (body) VALUES ('lost too')")
            c.execute("ROLLBACK")
            raise KeyError("the real one")
        with store.transaction(conn) as c:
            c.execute("INSERT INTO notes (body) VALUES ('later')")
    finally:
        conn.close()
    assert _bodies(path) == ["kept", "later"]


def test_a_transaction_takes_the_write_lock_at_its_start(tmp_path: Path) -> None:
    path = tmp_path / "notes.sqlite"
    _notes(path, "a")
    first = store.open_writer(path, NOTES)
    second = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        with store.transaction(first):
            with pytest.raises(sqlite3.OperationalError) as err:
                second.execute("BEGIN IMMEDIATE")
            assert store.failure(err.value) is store.Failure.LOCKED
    finally:
        second.close()
        first.close()


# ------------------------------------------------------------------------------------ errors by name
def _raised(action: str, tmp_path: Path) -> sqlite3.Error:
    path = tmp_path / "x.sqlite"
    sqlite3.connect(path).execute("CREATE TABLE IF NOT EXISTS t (x)").connection.close()
    try:
        if action == "full":  # a database capped at two pages refuses a larger row: SQLite's own SQLITE_FULL
            conn = sqlite3.connect(":memory:")
            conn.execute("CREATE TABLE t (x)")
            conn.execute("PRAGMA max_page_count = 2")
            conn.execute("INSERT INTO t VALUES (zeroblob(100000))")
        elif action == "locked":  # another connection is mid-change, and this one does not wait
            holder = sqlite3.connect(path, isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")
            try:
                sqlite3.connect(path, timeout=0, isolation_level=None).execute("BEGIN IMMEDIATE")
            finally:
                holder.close()
        elif action == "read-only":
            sqlite3.connect(f"file:{path}?mode=ro", uri=True).execute("INSERT INTO t VALUES (1)")
        elif action == "not a database":
            path.write_bytes(b"x" * 4096)
            sqlite3.connect(path).execute("SELECT * FROM t")
        elif action == "cannot open":
            sqlite3.connect(tmp_path / "no such folder" / "x.sqlite")
        elif action == "misuse":
            conn = sqlite3.connect(path)
            conn.close()
            conn.execute("SELECT 1")
        else:  # a constraint: not a failure of the file
            conn = sqlite3.connect(path)
            conn.execute("CREATE TABLE u (x PRIMARY KEY)")
            conn.execute("INSERT INTO u VALUES (1), (1)")
    except sqlite3.Error as e:
        return e
    raise AssertionError(f"{action}: SQLite raised nothing")


@pytest.mark.parametrize(("action", "expected"), [
    ("full", store.Failure.DISK_FULL), ("locked", store.Failure.LOCKED), ("read-only", store.Failure.NO_ACCESS),
    ("not a database", store.Failure.DAMAGED), ("cannot open", store.Failure.NO_ACCESS),
    ("misuse", store.Failure.OTHER), ("constraint", store.Failure.OTHER)])
def test_errors_are_told_apart_by_their_code_not_their_text(tmp_path: Path, action: str,
                                                            expected: store.Failure) -> None:
    e = _raised(action, tmp_path)
    print(action, getattr(e, "sqlite_errorname", None), e)
    assert store.failure(e) is expected


def test_a_full_disk_and_a_lock_are_not_called_damage(tmp_path: Path) -> None:
    path = tmp_path / "notes.sqlite"
    for action in ("full", "locked"):
        e = _raised(action, tmp_path)
        with pytest.raises(sqlite3.OperationalError) as err:
            store.raise_as_store_error(path, e, NOTES)
        assert err.value is e  # itself: the CLI names the folder and what to free
    damaged = _raised("not a database", tmp_path)
    with pytest.raises(NotesError, match="cannot be read") as err2:
        store.raise_as_store_error(path, damaged, NOTES)
    assert err2.value.__cause__ is damaged


# ------------------------------------------------------------------------------------ backup, restore
def test_backup_is_a_whole_copy_and_restore_puts_it_back_keeping_the_damaged_file(tmp_path: Path) -> None:
    path, copy = tmp_path / "notes.sqlite", tmp_path / "notes.sqlite.bak"
    _notes(path, "a", "b")
    conn = store.open_writer(path, NOTES)
    try:
        assert store.backup(conn, copy) == copy
    finally:
        conn.close()
    assert _bodies(copy) == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.sqlite", "notes.sqlite.bak"]  # no temp left

    _damage(path, "garbage")
    store.journal(path).write_bytes(b"a journal of the damaged file")
    damaged = path.read_bytes()
    aside = store.restore(copy, path, NOTES)
    print("moved aside:", [p.name for p in aside])
    assert _bodies(path) == ["a", "b"]
    assert not store.journal(path).exists()  # else SQLite would roll it into the restored file
    assert [p.name.split(".damaged-")[0] for p in aside] == ["notes.sqlite", "notes.sqlite-journal"]
    assert aside[0].read_bytes() == damaged  # moved, never deleted


def test_a_damaged_or_missing_copy_is_not_restored_and_the_file_is_left_alone(tmp_path: Path) -> None:
    path, copy = tmp_path / "notes.sqlite", tmp_path / "notes.sqlite.bak"
    _notes(path, "a")
    with pytest.raises(FileNotFoundError, match="no backup at"):
        store.restore(copy, path, NOTES)
    assert not copy.exists()  # (opening a missing file would have created it)
    copy.write_bytes(os.urandom(4096))
    with pytest.raises(NotesError, match=f"the notebook {copy} cannot be read"):
        store.restore(copy, path, NOTES)
    assert _bodies(path) == ["a"] and sorted(p.name for p in tmp_path.iterdir()) == ["notes.sqlite",
                                                                                     "notes.sqlite.bak"]


def test_a_backup_never_writes_through_a_link_at_its_name_or_its_temp_name(tmp_path: Path) -> None:
    path, copy = tmp_path / "notes.sqlite", tmp_path / "notes.sqlite.bak"
    _notes(path, "a")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    tmp = tmp_path / f".notes.sqlite.bak.tmp-{os.getpid()}"
    os.symlink(victim, tmp)  # a link planted at the predictable temp name is replaced, not followed
    conn = store.open_writer(path, NOTES)
    try:
        store.backup(conn, copy)
        assert _bodies(copy) == ["a"] and victim.read_bytes() == b"precious" and not tmp.exists()
        copy.unlink()
        os.symlink(victim, copy)
        with pytest.raises(UnsafePathError):
            store.backup(conn, copy)
    finally:
        conn.close()
    assert victim.read_bytes() == b"precious"
