"""The ledger: job state machine, stage rows, persistence across connections, the folder lock."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pan2render.jobs.ledger import (
    JOB_TRANSITIONS,
    TERMINAL_JOB_STATES,
    EventKind,
    FolderLock,
    FolderLockedError,
    IllegalTransition,
    JobEvent,
    JobState,
    Ledger,
    Stage,
    StageEvent,
    StageState,
    next_job_state,
)
from pan2render.jobs.spec import JobSpec


def _spec(name: str = "a", seed: int = 0) -> JobSpec:
    return JobSpec(name=name, model="tiny", prompt=f"prompt {name}", negative_prompt="", image=None,
                   image_sha256=None, seed=seed, steps=2, guidance=2.5, height=64, width=64, frames=5,
                   fps=8.0, flow_shift=5.0, sampler="unipc", gpus=1, crf=18, preset="tiny-preview")


def test_state_machine_rules() -> None:
    assert next_job_state(JobState.PENDING, JobEvent.START) is JobState.RUNNING
    assert next_job_state(JobState.RUNNING, JobEvent.RETRY) is JobState.PENDING
    assert next_job_state(JobState.FAILED, JobEvent.REVIVE) is JobState.PENDING
    # Terminal states are left only by resume's checks (revive / invalidate), never by the loop.
    for state in TERMINAL_JOB_STATES:
        leaving = {e for (s, e) in JOB_TRANSITIONS if s == state}
        print(state.value, "->", sorted(e.value for e in leaving))
        assert leaving <= {JobEvent.REVIVE, JobEvent.INVALIDATE}
    with pytest.raises(IllegalTransition, match="'done' has no transition 'start'"):
        next_job_state(JobState.DONE, JobEvent.START)


def test_jobs_stages_and_events_persist(tmp_path: Path) -> None:
    led = Ledger.open(tmp_path)
    added, present = led.add_jobs([_spec("a"), _spec("b")], retries=2)
    assert len(added) == 2 and present == []
    # Same specs again: nothing added (the id ends in the spec hash).
    added2, present2 = led.add_jobs([_spec("a"), _spec("c")], retries=2)
    assert present2 == [_spec("a").job_id] and added2 == [_spec("c").job_id]

    jid = _spec("a").job_id
    led.transition(jid, JobEvent.START, reason="test")
    led.set_stage(jid, Stage.SAMPLING, StageEvent.FAIL, error="boom", traceback="tb")
    led.transition(jid, JobEvent.RETRY, reason="test", error="boom", error_stage=Stage.SAMPLING)
    led.close()

    ro = Ledger.open_readonly(tmp_path)
    job = ro.job(jid)
    print("job after one retry:", job.state.value, job.attempts, job.retries_left, job.error_stage)
    assert (job.state, job.attempts, job.retries_left, job.error) == (JobState.PENDING, 1, 1, "boom")
    assert job.spec == _spec("a")  # the spec round-trips through the ledger (resume needs no YAML)
    assert ro.stages(jid)[Stage.SAMPLING].traceback == "tb"
    # The retry keeps the failed stage's traceback with the attempt (`show` lists every attempt's).
    assert [e.label for e in ro.events(jid)] == ["added", "pending->running", "running->pending", "traceback"]
    assert ro.events(jid)[-1].detail == "tb"
    assert [j.name for j in ro.jobs()] == ["a", "b", "c"]  # batch order kept
    with pytest.raises(sqlite_readonly_error()):
        ro.set_meta("x", 1)


def sqlite_readonly_error() -> type[Exception]:
    import sqlite3

    return sqlite3.OperationalError


def test_retry_without_budget_is_a_bug(tmp_path: Path) -> None:
    led = Ledger.open(tmp_path)
    (jid,), _ = led.add_jobs([_spec()], retries=0)
    led.transition(jid, JobEvent.START, reason="t")
    with pytest.raises(AssertionError):
        led.transition(jid, JobEvent.RETRY, reason="t")
    led.transition(jid, JobEvent.FAIL, reason="t", error="e", error_stage=Stage.DECODE)
    led.transition(jid, JobEvent.REVIVE, reason="resume", retries=2)
    job = led.job(jid)
    assert (job.state, job.retries_left, job.error) == (JobState.PENDING, 2, None)


_HOLD = textwrap.dedent("""
    import sys, time
    from pan2render.jobs.ledger import FolderLock, StageEvent
    lock = FolderLock(sys.argv[1]); lock.acquire()
    print("held", flush=True)
    time.sleep(60)
""")


def test_folder_lock_refuses_live_holder_and_takes_over_stale(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderLockedError) as err:
            FolderLock(tmp_path).acquire()
        print("second lock:", err.value)
        assert f"pid {holder.pid}" in str(err.value) and "host" in str(err.value)
    finally:
        holder.kill()  # SIGKILL: the lock file still names it, but the kernel dropped the flock
        holder.wait()
    lock = FolderLock(tmp_path)
    lock.acquire()
    print("took over from:", lock.taken_over)
    assert lock.taken_over is not None and str(holder.pid) in lock.taken_over
    lock.release()


def test_present_job_takes_fields_outside_the_hash_unless_done(tmp_path: Path) -> None:
    import dataclasses

    led = Ledger.open(tmp_path)
    wide, other = dataclasses.replace(_spec("a"), gpus=4), _spec("b")
    led.add_jobs([wide, other], retries=0)
    # "a" failed because no group of 4 exists; the user lowers gpus to 2 (same pixels, same id).
    led.transition(wide.job_id, JobEvent.START, reason="test")
    led.transition(wide.job_id, JobEvent.FAIL, reason="test", error="no group of 4")
    for jid in (other.job_id,):
        led.transition(jid, JobEvent.START, reason="test")
        led.transition(jid, JobEvent.FINISH, reason="test")
    narrow = dataclasses.replace(wide, gpus=2)
    assert narrow.job_id == wide.job_id
    _, present = led.add_jobs([narrow, dataclasses.replace(other, gpus=8)], retries=0)
    assert sorted(present) == sorted([wide.job_id, other.job_id])
    assert led.job(wide.job_id).spec.gpus == 2  # the failed job takes the batch's new value
    assert led.job(other.job_id).spec.gpus == 1  # a done job's record is history: unchanged
    updates = [e.detail for e in led.events(wide.job_id) if e.label == "spec-updated"]
    assert len(updates) == 1 and "(gpus)" in updates[0]  # the event names what changed
    led.close()


def test_a_new_ledger_appears_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader polling the folder (`status` while `run` starts) must never find a ledger file
    without its tables: it would report the ledger empty or damaged. The file appears by a rename
    of a complete one."""
    import pan2render.jobs.ledger as ledger_module

    target = tmp_path / "ledger.sqlite"
    renamed: list[str] = []
    real_replace = ledger_module.os.replace

    def checked_replace(src: str | Path, dst: str | Path) -> None:
        if Path(dst) == target:
            assert not target.exists()
            seen = Ledger.open_file_readonly(Path(src))  # raises unless every table is there
            try:
                assert seen.get_meta("schema_version") is not None
            finally:
                seen.close()
            renamed.append(str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(ledger_module.os, "replace", checked_replace)
    Ledger.open(tmp_path).close()
    assert renamed == [str(target)]
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.sqlite"]


def test_stage_rows_move_only_through_the_declared_table(tmp_path: Path) -> None:
    """A done stage is not started, failed or stopped again (only a reset, which logs why, takes it
    back); a stage never started cannot be stopped."""
    led = Ledger.open(tmp_path)
    jid = led.add_jobs([_spec("s")], retries=1)[0][0]
    led.set_stage(jid, Stage.SAMPLING, StageEvent.START)
    led.set_stage(jid, Stage.SAMPLING, StageEvent.FINISH, artifact="a", sha256="x", size=1)
    for event in (StageEvent.START, StageEvent.FAIL, StageEvent.STOP, StageEvent.FINISH):
        with pytest.raises(IllegalTransition, match="stage state 'done'"):
            led.set_stage(jid, Stage.SAMPLING, event)
    assert led.stages(jid)[Stage.SAMPLING].artifact == "a"  # the refused moves wrote nothing
    with pytest.raises(IllegalTransition, match="stage state 'pending' has no transition 'stop'"):
        led.set_stage(jid, Stage.DECODE, StageEvent.STOP)
    led.reset_stages(jid, Stage.SAMPLING, reason="its latents were lost")
    assert led.stages(jid)[Stage.SAMPLING].state is StageState.PENDING
    led.set_stage(jid, Stage.SAMPLING, StageEvent.START)


def test_a_group_of_changes_is_one_commit_each_change_still_all_or_nothing(tmp_path: Path) -> None:
    """The scheduler's step boundary: the changes made inside ``grouped()`` reach the file (and
    another process) together when it ends, one commit; a change refused inside (an illegal
    transition) is undone alone, the others stay; the backup a finished job asks for follows the commit."""
    led = Ledger.open(tmp_path)
    a, b = _spec("a").job_id, _spec("b").job_id
    led.add_jobs([_spec("a"), _spec("b")], retries=1)
    reader = Ledger.open_readonly(tmp_path)
    with led.grouped():
        led.transition(a, JobEvent.START, reason="on group g")
        led.set_stage(a, Stage.CONDITIONING, StageEvent.START)
        with pytest.raises(IllegalTransition):
            led.transition(b, JobEvent.FINISH, reason="b never started")
        led.transition(a, JobEvent.FINISH, reason="done")
        assert led.job(a).state is JobState.DONE  # this connection sees its own changes
        assert reader.job(a).state is JobState.PENDING  # another sees none before the commit
        assert not (tmp_path / "ledger.sqlite.bak").exists()  # the finished job's backup waits for the commit
    assert reader.job(a).state is JobState.DONE and reader.job(b).state is JobState.PENDING
    assert reader.stages(a)[Stage.CONDITIONING].state is StageState.RUNNING
    backup = Ledger.open_file_readonly(tmp_path / "ledger.sqlite.bak")
    assert backup.job(a).state is JobState.DONE  # the job's rows copied once committed
    backup.close()
    reader.close()
    led.close()


def test_one_write_changes_in_a_group_are_all_or_nothing_without_a_savepoint(tmp_path: Path) -> None:
    """``set_stage``, ``log`` and ``set_document`` make one write after their reads and checks, so
    inside a group they take no savepoint: a refused move writes nothing, a write SQLite refuses is
    undone alone (its statement), and what the group changed before stays, committed together."""
    import sqlite3

    from pan2render.jobs import store

    led = Ledger.open(tmp_path)
    a = _spec("a").job_id
    led.add_jobs([_spec("a")], retries=1)
    statements: list[str] = []
    led._conn.set_trace_callback(statements.append)
    with led.grouped():
        led.transition(a, JobEvent.START, reason="on group g")
        led.set_stage(a, Stage.CONDITIONING, StageEvent.START)
        with pytest.raises(IllegalTransition):
            led.set_stage(a, Stage.DECODE, StageEvent.STOP)  # pending has no stop: refused before its write
        with led._changes.change(one_write=True) as c, pytest.raises(sqlite3.IntegrityError):
            c.execute("INSERT INTO jobs (id) VALUES (NULL)")  # refused by SQLite: the statement undone
        led.log(a, EventKind.CONDITIONING, "one event")
        led.set_document(a, "params.json", "{}")
    led._conn.set_trace_callback(None)
    reader = Ledger.open_readonly(tmp_path)
    assert reader.job(a).state is JobState.RUNNING
    assert reader.stages(a)[Stage.CONDITIONING].state is StageState.RUNNING
    assert reader.stages(a)[Stage.DECODE].state is StageState.PENDING
    assert reader.document(a, "params.json") == "{}"
    assert [e.detail for e in reader.events(a) if e.kind is EventKind.CONDITIONING] == ["one event"]
    reader.close()
    # One savepoint: the transition's (several writes); one commit for the group.
    assert sum(s.startswith("SAVEPOINT") for s in statements) == 1
    assert statements.count("COMMIT") == 1
    assert isinstance(led._changes, store.Changes) and led._changes.lost is None
    led.close()


def test_job_backups_keep_one_connection_to_the_backup_while_it_is_the_same_file(tmp_path: Path) -> None:
    """Each finished job's rows reach the backup through one open connection; a backup replaced
    (another inode), deleted or damaged in place since is written whole again, never through a
    connection to a file that is gone."""
    led = Ledger.open(tmp_path)
    specs = [_spec(n) for n in "abcde"]
    led.add_jobs(specs, retries=1)
    ids = [s.job_id for s in specs]
    bak = tmp_path / "ledger.sqlite.bak"

    def finish(jid: str) -> None:
        led.transition(jid, JobEvent.START, reason="on g")
        led.transition(jid, JobEvent.FINISH, reason="done")

    def backed_up() -> dict[str, JobState]:
        copy = Ledger.open_file_readonly(bak)
        try:
            return copy.job_states()
        finally:
            copy.close()

    finish(ids[0])  # no backup yet: a whole copy
    finish(ids[1])
    conn = led._backup_conn
    assert conn is not None
    finish(ids[2])
    assert led._backup_conn is conn  # the same connection, job after job
    assert [backed_up()[j] for j in ids[:3]] == [JobState.DONE] * 3

    # Replaced by another copy (a new inode): that file gets the next job's rows.
    other = tmp_path / "other.bak"
    other.write_bytes(bak.read_bytes())
    os.replace(other, bak)
    finish(ids[3])
    assert led._backup_conn is not conn and backed_up()[ids[3]] is JobState.DONE
    # Damaged in place (same inode): found on the next write, and written whole.
    with open(bak, "r+b") as f:
        f.write(b"not a database" * 100)
    finish(ids[4])
    assert set(backed_up().values()) == {JobState.DONE}
    led.close()
    assert led._backup_conn is None


def test_a_group_the_disk_refuses_stops_every_later_change(tmp_path: Path) -> None:
    """A full disk under a group: SQLite rolls the whole transaction back, so the group's earlier
    changes are gone too; the ledger then refuses every change with the disk's error (the writer
    stops as on a full disk, and the next one starts from the file), never one that would rest on
    what was lost."""
    from pan2render.jobs.disk import is_disk_full

    led = Ledger.open(tmp_path)
    a = _spec("a").job_id
    led.add_jobs([_spec("a")], retries=1)
    (pages,) = led._conn.execute("PRAGMA page_count").fetchone()  # a disk that fills within a page
    led._conn.execute(f"PRAGMA max_page_count = {pages + 1}")
    with led.grouped():
        led.transition(a, JobEvent.START, reason="on group g")
        with pytest.raises(Exception) as full:
            led.set_document(a, "big", "x" * 100_000)
        assert is_disk_full(full.value)
        with pytest.raises(Exception) as again:
            led.set_stage(a, Stage.CONDITIONING, StageEvent.START)
        assert is_disk_full(again.value)
    with pytest.raises(Exception) as later:
        led.transition(a, JobEvent.INTERRUPT, reason="stopping")
    assert is_disk_full(later.value)
    led.close()
    reader = Ledger.open_readonly(tmp_path)
    assert reader.job(a).state is JobState.PENDING and reader.job(a).attempts == 0  # the start went with the group
    reader.close()
