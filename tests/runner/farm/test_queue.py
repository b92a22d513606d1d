"""The farm's queue file (ROOT/farm.sqlite) alone: its events typed, a link at its name refused, a
damaged file refused with the command that repairs it, a backup after each change, and
`pan2-render farm repair` putting it back (or starting an empty queue, saying how to resubmit)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pan2render.jobs.outdir import UnsafePathError
from pan2render.runner.cli import main as cli
from pan2render.runner.farm.queue import (
    BACKUP_NAME,
    QUEUE_NAME,
    BatchEvent,
    BatchState,
    FarmQueue,
    QueueError,
    QueueEventKind,
    QueueFileError,
)


def _queue_with_two_batches(root: Path) -> FarmQueue:
    q = FarmQueue(root)
    q.add(out_dir=str(root / "a"), batch_path="a.yaml", owner="ann", priority=0, job_ids=["a1", "a2"])
    b = q.add(out_dir=str(root / "b"), batch_path=None, owner="bob", priority=1, job_ids=["b1"], preempt=True)
    q.transition(b.id, BatchEvent.PAUSE, reason="paused by a client")
    q.set_priority("b1", 5)
    return q


def _rows(root: Path, name: str = QUEUE_NAME) -> list[tuple[str, str, int, str]]:
    conn = sqlite3.connect(f"file:{root / name}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT out_dir, owner, priority, state FROM batches ORDER BY seq").fetchall()
    finally:
        conn.close()


def test_every_event_kind_is_stored_as_before_and_an_illegal_request_is_refused(tmp_path: Path) -> None:
    q = _queue_with_two_batches(tmp_path)
    q.transition("b1", BatchEvent.END_DONE, reason="every job done")
    q.log("b2", QueueEventKind.STOP, "its folder refused a write")
    kinds = [e["kind"] for e in q.events()]
    print(kinds)
    assert kinds == ["submitted", "submitted", "pause", "priority", "done", "stop"]
    assert all(type(k) is str for k in kinds)  # the monitor serves them as JSON
    assert {QueueEventKind.of(e).value for e in BatchEvent} == {e.value for e in BatchEvent}
    with pytest.raises(QueueError, match=r"batch b1 is done: it cannot be paused \(from done: retry\)"):
        q.transition("b1", BatchEvent.PAUSE, reason="no")
    q.close()


def test_a_symlink_at_the_queue_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.sqlite"
    elsewhere.write_bytes(b"someone else's file")
    os.symlink(elsewhere, tmp_path / QUEUE_NAME)
    with pytest.raises(UnsafePathError, match=f"{tmp_path / QUEUE_NAME} is a symbolic link"):
        FarmQueue(tmp_path)
    assert elsewhere.read_bytes() == b"someone else's file"


@pytest.mark.parametrize("how", ["garbage", "zero", "not a queue"])
def test_a_damaged_queue_is_refused_naming_the_repair_and_left_as_it_was(tmp_path: Path, how: str) -> None:
    _queue_with_two_batches(tmp_path).close()
    path = tmp_path / QUEUE_NAME
    if how == "garbage":
        path.write_bytes(os.urandom(8192))
    elif how == "zero":  # no longer a fresh queue to fill: the farm creates its file whole
        path.write_bytes(b"")
    else:
        sqlite3.connect(path).execute("DROP TABLE batches").connection.close()
    before = path.read_bytes()
    with pytest.raises(QueueFileError) as err:
        FarmQueue(tmp_path)
    print(err.value)
    assert str(err.value).startswith(f"the farm queue {path} ")
    assert f"`pan2-render farm repair --root {tmp_path}` puts back its backup {BACKUP_NAME}" in str(err.value)
    assert path.read_bytes() == before


def test_the_farm_does_not_start_on_a_damaged_queue(tmp_path: Path) -> None:
    from runner_helpers import RecordingExecutor

    from pan2render.runner.farm.service import Farm, FarmConfig
    from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY
    from pan2render.runner.worker.render_worker import WorkerConfig

    _queue_with_two_batches(tmp_path).close()
    (tmp_path / QUEUE_NAME).write_bytes(os.urandom(8192))
    executor = RecordingExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    with pytest.raises(QueueFileError, match="farm repair"):
        Farm(FarmConfig(root=tmp_path), executor, log=lambda text: None)


def test_a_queue_gone_while_its_backup_is_there_is_not_started_empty(tmp_path: Path) -> None:
    _queue_with_two_batches(tmp_path).close()
    (tmp_path / QUEUE_NAME).unlink()
    with pytest.raises(QueueFileError, match="is missing, while its backup .* is there.*farm repair"):
        FarmQueue(tmp_path)
    assert not (tmp_path / QUEUE_NAME).exists()


def test_the_backup_follows_every_change(tmp_path: Path) -> None:
    q = FarmQueue(tmp_path)
    assert _rows(tmp_path, BACKUP_NAME) == []  # made at the first open
    q.add(out_dir="/r/a", batch_path=None, owner="ann", priority=0, job_ids=["a1"])
    assert _rows(tmp_path, BACKUP_NAME) == [("/r/a", "ann", 0, "active")]
    q.set_priority("b1", 3)
    assert _rows(tmp_path, BACKUP_NAME) == [("/r/a", "ann", 3, "active")]
    q.transition("b1", BatchEvent.CANCEL, reason="by a client")
    assert _rows(tmp_path, BACKUP_NAME) == _rows(tmp_path) == [("/r/a", "ann", 3, "cancelling")]
    q.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [QUEUE_NAME, BACKUP_NAME]  # no temp, no journal


def test_a_failed_backup_never_fails_the_change(tmp_path: Path) -> None:
    q = FarmQueue(tmp_path)
    (tmp_path / BACKUP_NAME).unlink()
    os.symlink(tmp_path / "elsewhere", tmp_path / BACKUP_NAME)  # refused: the copy cannot be written
    q.add(out_dir="/r/a", batch_path=None, owner="ann", priority=0, job_ids=["a1"])
    assert q.get("b1").state is BatchState.ACTIVE
    assert q.backup_error is not None and "symbolic link" in q.backup_error
    q.close()


# ------------------------------------------------------------------------------------ farm repair
def _repair(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["farm", "repair", "--root", str(root)])
    captured = capsys.readouterr()
    print(f"$ pan2-render farm repair --root {root} -> {code}\n{captured.out}{captured.err}")
    return code, captured.out + captured.err


@pytest.mark.parametrize("how", ["garbage", "delete"])
def test_repair_puts_the_backup_back_and_keeps_the_damaged_file(tmp_path: Path, how: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    _queue_with_two_batches(tmp_path).close()
    before = _rows(tmp_path)
    path = tmp_path / QUEUE_NAME
    if how == "garbage":
        path.write_bytes(os.urandom(8192))
    else:
        path.unlink()
    code, text = _repair(tmp_path, capsys)
    assert code == 0 and f"put back from its backup {BACKUP_NAME}" in text
    assert (how == "garbage") == bool(list(tmp_path.glob(f"{QUEUE_NAME}.damaged-*")))
    q = FarmQueue(tmp_path)  # opens: the farm starts again with every batch as it was
    assert _rows(tmp_path) == before and q.get("b2").state is BatchState.PAUSED
    assert q.events()[-1]["kind"] == "repaired"
    q.close()
    assert "is healthy; nothing was changed" in _repair(tmp_path, capsys)[1]


def test_repair_without_a_usable_backup_starts_empty_and_says_how_to_resubmit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _queue_with_two_batches(tmp_path).close()
    (tmp_path / QUEUE_NAME).write_bytes(os.urandom(8192))
    (tmp_path / BACKUP_NAME).write_bytes(os.urandom(8192))
    code, text = _repair(tmp_path, capsys)
    assert code == 0 and "started empty" in text and "pan2-render submit BATCH --out DIR" in text
    assert len(list(tmp_path.glob("*.damaged-*"))) == 2  # the queue and its copy, both kept
    q = FarmQueue(tmp_path)
    assert q.batches() == [] and [e["kind"] for e in q.events()] == ["repaired"]
    q.close()


_HOLD = textwrap.dedent("""
    import sys, time
    from pan2render.jobs.ledger import FolderLock
    lock = FolderLock(sys.argv[1]); lock.acquire()
    print("held", flush=True)
    time.sleep(60)
""")


def test_repair_refuses_while_a_farm_holds_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _queue_with_two_batches(tmp_path).close()
    (tmp_path / QUEUE_NAME).write_bytes(b"damaged")
    farm = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert farm.stdout is not None and farm.stdout.readline().strip() == "held"
        code, text = _repair(tmp_path, capsys)
    finally:
        farm.kill()
        farm.wait()
    assert code == 3 and "a farm runs at" in text and "farm stop --root" in text
    assert (tmp_path / QUEUE_NAME).read_bytes() == b"damaged"
