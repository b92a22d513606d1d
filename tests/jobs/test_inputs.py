"""Reading a file a batch names (`jobs/inputs.py`): a regular file within its limit, or a refusal
saying what it is instead; never a wait on a FIFO, and never longer than the stall limit on a read
that does not answer."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pan2render.jobs.inputs import InputFileError, read_regular_file, sha256_regular_file, stall_bounded

pytestmark = pytest.mark.timeout(30)


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result or what it raised, failing the test if it has not returned in ``seconds``
    (so that a read that blocks fails instead of hanging the run)."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:
            box.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    ok, value = box[0]
    if not ok:
        raise value
    return value


@pytest.fixture
def fifo(tmp_path: Path) -> Any:
    """A FIFO nobody writes to; any reader still stuck on it is let go afterwards."""
    path = tmp_path / "first.png"
    os.mkfifo(path)
    yield path
    try:  # a writer that opens and closes: a reader blocked in open() or read() gets end-of-file
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader waiting (ENXIO), as when the test passed
        pass


@pytest.mark.parametrize("read", [lambda p: read_regular_file(p, limit=1 << 20),
                                  lambda p: read_regular_file(p, limit=1 << 20, first=8),
                                  lambda p: sha256_regular_file(p, limit=1 << 20)])
def test_a_fifo_is_refused_without_waiting_for_a_writer(fifo: Path, read: Callable[[Path], Any]) -> None:
    with pytest.raises(InputFileError, match=r"is a FIFO \(named pipe\); allowed: a regular file"):
        within(5, lambda: read(fifo))


def test_a_link_to_a_regular_file_is_read_and_a_link_to_a_fifo_is_refused(tmp_path: Path, fifo: Path) -> None:
    target = tmp_path / "real.png"
    target.write_bytes(b"\x89PNG pixels")
    (tmp_path / "link.png").symlink_to(target)
    assert read_regular_file(tmp_path / "link.png", limit=100) == b"\x89PNG pixels"
    (tmp_path / "to-fifo.png").symlink_to(fifo)
    with pytest.raises(InputFileError, match="is a FIFO"):
        within(5, lambda: read_regular_file(tmp_path / "to-fifo.png", limit=100))


def test_a_folder_a_device_and_a_large_file_are_refused_with_what_they_are(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="is a folder"):
        read_regular_file(tmp_path, limit=100)
    with pytest.raises(InputFileError, match="is a device"):
        within(5, lambda: read_regular_file("/dev/zero", limit=100))
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 101)
    with pytest.raises(InputFileError, match="is 101 bytes; allowed: at most 100 bytes"):
        sha256_regular_file(big, limit=100)
    assert sha256_regular_file(big, limit=101) == hashlib.sha256(b"x" * 101).hexdigest()
    assert read_regular_file(big, limit=101, first=3) == b"xxx"  # the first bytes only
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "nowhere.png", limit=100)


def test_a_read_that_stalls_is_given_up_after_the_limit() -> None:
    """A read of a dead network filesystem blocks in the kernel: here, a read that never returns."""
    never = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(InputFileError, match=r"gave no data for 0.3 s .*allowed: a file that can be read"):
        stall_bounded(lambda progress: never.wait(), stall_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2
    never.set()  # lets the abandoned thread end


def test_a_slow_read_that_keeps_giving_data_is_not_given_up() -> None:
    """The limit is on a stall, not on the whole read: a large file on a slow disk still reads."""
    def slow(progress: Callable[[], None]) -> str:
        for _ in range(8):  # 0.8 s in all, well past the stall limit, with data every 0.1 s
            time.sleep(0.1)
            progress()
        return "read"

    assert stall_bounded(slow, stall_s=0.3) == "read"


def test_what_the_read_raised_reaches_the_caller() -> None:
    def fails(progress: Callable[[], None]) -> None:
        raise PermissionError(13, "Permission denied")

    with pytest.raises(PermissionError):
        stall_bounded(fails)
