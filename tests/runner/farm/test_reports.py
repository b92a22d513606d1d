"""The farm's reports, written by its child process: the final page is on disk before a batch
counts as finished, live updates coalesce, a writer that dies or cannot write costs a message and
never the batch, and a farm killed with SIGKILL leaves no writer behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pan2render.runner.farm.reports import Reports
from tests.runner.views.test_report import Page, job, render

WAIT_S = 60  # generous: a deadline for the child's answer, not a timing assertion


def until(check: Callable[[], bool], reports: Reports, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        reports.poll()
        time.sleep(0.01)


@pytest.fixture
def reports():
    r = Reports(min_interval_s=3600.0)
    yield r
    r.close()


def test_final_page_written_by_the_child_before_the_batch_counts_finished(tmp_path: Path, reports: Reports) -> None:
    said: list[str] = []
    render(tmp_path, [job("a", seed=s) for s in range(3)])
    reports.add("b1", tmp_path, say=said.append)
    reports.request("b1")
    assert not reports.finish("b1")  # asked, not yet written
    until(lambda: reports.finish("b1"), reports, "the final page")
    assert reports.path("b1") == tmp_path / "index.html" and not said
    assert len(Page((tmp_path / "index.html").read_text()).videos) == 3
    child = reports._child
    assert child is not None and child.proc.pid != os.getpid() and reports.writes == 1

    # Job ends within the interval coalesce into no live write (the first page started the
    # interval); the final page is written at once, for the last job that ended.
    for _ in range(20):
        reports.request("b1")
    reports.poll()
    assert reports.writes == 1 and not reports._sent
    until(lambda: reports.finish("b1"), reports, "the second final page")
    assert reports.writes == 2

    # Ended: closing the writer ends the child.
    reports.close()
    assert child.proc.poll() == 0


def test_a_failed_write_or_a_dead_writer_costs_a_message_not_the_batch(tmp_path: Path, reports: Reports) -> None:
    said: list[str] = []
    reports.add("gone", tmp_path / "not-a-run", say=said.append)
    until(lambda: reports.finish("gone"), reports, "the refused page")
    assert reports.path("gone") is None
    assert len(said) == 1 and "could not write" in said[0] and "no ledger" in said[0]

    # The child killed while a page is on its way: said, and the next page gets a new child.
    render(tmp_path / "run", [job("a", seed=0)])
    reports.add("b2", tmp_path / "run", say=said.append)
    reports.request("b2")
    reports.finish("b2")
    reports.poll()
    first = reports._child
    assert first is not None and list(reports._sent) == ["b2"]
    first.proc.kill()
    until(lambda: reports.finish("b2"), reports, "the lost page given up")
    assert "the report writer exited" in said[-1] and reports.path("b2") is None
    reports.request("b2")
    until(lambda: reports.finish("b2"), reports, "the page from a new writer")
    assert reports._child is not first and reports.path("b2") == tmp_path / "run" / "index.html"


def test_a_stuck_writer_never_holds_a_batch_open(tmp_path: Path) -> None:
    now = [0.0]
    said: list[str] = []
    reports = Reports(final_wait_s=120.0, clock=lambda: now[0])
    try:
        reports.add("b", tmp_path, say=said.append)
        reports._send = lambda batch_id, at: setattr(reports.batches[batch_id], "in_flight", 0)  # never answered
        assert not reports.finish("b")
        reports.poll()
        now[0] = 119.0
        assert not reports.finish("b")
        now[0] = 121.0
        assert reports.finish("b") and reports.path("b") is None
        assert "not written within 120 s" in said[-1] and "pan2-render report" in said[-1]
    finally:
        reports.close()


def test_a_farm_killed_with_sigkill_leaves_no_writer(tmp_path: Path) -> None:
    render(tmp_path, [job("a", seed=0)])
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from pan2render.runner.farm.reports import Reports
        r = Reports()
        r.add("b", Path({str(tmp_path)!r}), say=print)
        r.request("b"); r.finish("b")
        while not r.finish("b"):
            r.poll(); time.sleep(0.01)
        print(r._child.proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        child_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + WAIT_S
    while _alive(child_pid):
        assert time.monotonic() < deadline, "the report writer outlived its farm"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Running, not a zombie awaiting its (killed) parent's reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
