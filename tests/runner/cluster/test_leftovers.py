"""The record of a local Ray cluster's processes, and their end once its driver is gone: only the
recorded processes that are still the same ones (pid and start time), and what they started; never
a process that merely has the pid, or the name, never while the driver runs, never from a record
someone else could have written. Plain processes (`sleep`) stand in for Ray's."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pan2render.runner.cluster.leftovers import (
    ProcessId,
    boot_id,
    end_leftovers,
    identify,
    read_record,
    record_cluster,
    records_to_check,
    run_record_path,
)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; whatever is left of them is killed at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def _sleep(procs: list[subprocess.Popen[bytes]], *, name: str = "sleep") -> subprocess.Popen[bytes]:
    """A process whose argv[0] is ``name`` (a Ray-like name for the ones that must be left alone)."""
    p = subprocess.Popen(["bash", "-c", f'exec -a "{name}" sleep 120'])
    procs.append(p)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[0] != name.encode():  # exec'd
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return p


def _write(path: Path, *, driver: ProcessId, processes: list[ProcessId]) -> Path:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text(json.dumps({"boot_id": boot_id(), "uid": os.getuid(), "driver": [driver.pid, driver.started],
                                "session_dir": "/tmp/ray/session_x", "processes": [[p.pid, p.started]
                                                                                   for p in processes]}))
    return path


def _dead_driver(procs: list[subprocess.Popen[bytes]]) -> ProcessId:
    driver = _sleep(procs)
    ident = identify(driver.pid)
    assert ident is not None
    driver.kill()
    driver.wait()
    return ident


def _alive(p: subprocess.Popen[bytes]) -> bool:
    return p.poll() is None


def test_what_a_dead_driver_left_is_ended_and_nothing_else(tmp_path: Path, procs: list) -> None:
    driver = _dead_driver(procs)
    agent = _sleep(procs, name="ray::DashboardAgent")  # recorded: the killed driver's
    decoy = _sleep(procs, name="ray::DashboardAgent")  # same name, not recorded
    record = _write(tmp_path / "rec" / "ray-cluster.json", driver=driver, processes=[identify(agent.pid)])
    notes = end_leftovers([record], grace_s=1.0)
    print(notes)
    assert not _alive(agent) and _alive(decoy)
    assert len(notes) == 1 and "ended 1 process(es)" in notes[0] and f"pid {driver.pid}" in notes[0]
    assert not record.exists()  # done with


def test_a_reused_pid_is_not_the_recorded_process(tmp_path: Path, procs: list) -> None:
    driver = _dead_driver(procs)
    other = _sleep(procs)
    ident = identify(other.pid)
    record = _write(tmp_path / "rec" / "r.json", driver=driver,
                    processes=[ProcessId(pid=other.pid, started=ident.started + 1)])  # its pid, not its start
    assert end_leftovers([record], grace_s=1.0) == []
    assert _alive(other) and not record.exists()  # nothing of it runs: the record is dropped


def test_a_running_drivers_cluster_is_its_own(tmp_path: Path, procs: list) -> None:
    driver = _sleep(procs)
    agent = _sleep(procs)
    record = _write(tmp_path / "rec" / "r.json", driver=identify(driver.pid), processes=[identify(agent.pid)])
    assert end_leftovers([record], grace_s=1.0) == []
    assert _alive(agent) and record.exists()  # kept for when it is killed


def test_a_record_others_could_have_written_is_refused(tmp_path: Path, procs: list) -> None:
    driver = _dead_driver(procs)
    agent = _sleep(procs)
    record = _write(tmp_path / "rec" / "r.json", driver=driver, processes=[identify(agent.pid)])
    record.parent.chmod(0o777)
    (notes,) = end_leftovers([record], grace_s=1.0)
    assert "was not acted on" in notes and "writable by others" in notes and "mode 777" in notes
    record.parent.chmod(0o700)
    link = record.with_name("link.json")
    link.symlink_to(record)
    (notes,) = end_leftovers([link], grace_s=1.0)
    assert "was not acted on" in notes
    assert _alive(agent) and record.exists()


def test_this_drivers_record_round_trips_and_is_found_among_the_runs(
        tmp_path: Path, procs: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAN2_RENDER_CACHE", str(tmp_path / "cache"))
    child = subprocess.Popen(["sleep", "120"])  # a child of this process, as ray.init's are
    procs.append(child)
    path = run_record_path()
    written = record_cluster(path, session_dir="/tmp/ray/session_y", pids=[child.pid, 999_999_999])
    assert written is not None and read_record(path) == written
    assert written.processes == (identify(child.pid),)  # a pid that does not run is not recorded
    assert written.driver == identify(os.getpid())
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    farm = tmp_path / "farm" / "ray-cluster.json"
    assert records_to_check(farm) == [farm, path]
    assert end_leftovers([path]) == [] and _alive(child)  # this process runs: its cluster is its own
