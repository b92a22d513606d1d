"""``pan2-render node start|stop``: a Ray node kept up on this machine, which runs join by default.

The node lives in a Ray temp folder of the test's own (RAY_TMPDIR: where Ray records the node for
``ray.init()`` to find) with a HOME of its own (Ray's token authentication, on by default, keeps its
token there), on a free port: nothing else on the machine sees it, and it sees nothing else.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.ledger import JobState, Ledger

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def node_env(tmp_path: Path):
    # A short folder: Ray's unix sockets live under it and their paths are limited to ~107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="p2n", dir="/tmp")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "PAN2_RENDER_CACHE": str(tmp_path / "cache"),
           "PAN2_RENDER_PIPELINE": "pan2render.runner.worker.fake_pipeline:load_fake_pipeline"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_MODE", None)
    try:
        yield env
    finally:
        subprocess.run([*CLI, "node", "stop"], env=env, capture_output=True, timeout=120, check=False)
        _kill_leftovers(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _kill_leftovers(ray_tmp: str) -> None:
    """Every process whose command line names this test's Ray folder, and their children (Ray's
    agents rename themselves): a failed stop leaves none running past the test, and other Ray
    processes on the machine are not touched."""
    parents: dict[int, int] = {}
    named: set[int] = set()
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
            if ray_tmp.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                named.add(pid)
        except (OSError, ValueError, IndexError):
            continue
    doomed = set(named)
    while grown := {p for p, parent in parents.items() if parent in doomed} - doomed:
        doomed |= grown
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _startup_lines(out: Path) -> list[str]:
    return [ln for ln in (out / "run.log").read_text().splitlines() if "start-up:" in ln]


def test_runs_join_the_node_kept_up_here(tmp_path: Path, node_env: dict) -> None:
    port = _free_port()
    start = subprocess.run([*CLI, "node", "start", "--cpu-gpus", "1", "--port", str(port)], env=node_env,
                           capture_output=True, text=True, timeout=180)
    print(start.stdout, start.stderr[-2000:])
    assert start.returncode == 0 and "Ray node up on this machine: 1 logical GPU(s) on CPU" in start.stdout

    again = subprocess.run([*CLI, "node", "start", "--cpu-gpus", "1", "--port", str(port)], env=node_env,
                           capture_output=True, text=True, timeout=180)
    print(again.stdout, again.stderr)
    said = (again.stdout + again.stderr).strip().splitlines()
    assert again.returncode == 0 and len(said) == 1 and "already up" in said[0] and f":{port}" in said[0]

    batch = write_batch(tmp_path / "b.yaml", [{"name": f"j{i}", "prompt": f"clip {i}"} for i in range(2)],
                        defaults={"steps": 2})
    run = subprocess.run([*CLI, "run", str(batch), "--out", str(tmp_path / "out"), "--no-progress"],
                         env=node_env, capture_output=True, text=True, timeout=180)
    print(run.stderr[-3000:])
    assert run.returncode == 0, run.stderr[-2000:]
    lines = _startup_lines(tmp_path / "out")
    assert any("the Ray node running on this machine (GCS at " in ln and f":{port})" in ln for ln in lines), lines
    assert "`pan2-render node start` keeps up on this machine" in (tmp_path / "out" / "run.log").read_text()
    ledger = Ledger.open_readonly(tmp_path / "out")
    try:
        assert [j.state for j in ledger.jobs()] == [JobState.DONE] * 2
    finally:
        ledger.close()

    # --address local: a cluster of the run's own, beside the node.
    own = subprocess.run([*CLI, "run", str(batch), "--out", str(tmp_path / "own"), "--no-progress",
                          "--address", "local", "--cpu-gpus", "1"], env=node_env, capture_output=True,
                         text=True, timeout=180)
    assert own.returncode == 0, own.stderr[-2000:]
    assert any("the local Ray cluster this run started" in ln for ln in _startup_lines(tmp_path / "own"))

    stop = subprocess.run([*CLI, "node", "stop"], env=node_env, capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0 and "Ray node stopped" in stop.stdout


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def test_node_stop_leaves_another_ray_cluster_running(tmp_path: Path, node_env: dict) -> None:
    """`node stop` ends the node `node start` started, and nothing else: a cluster started with
    plain `ray start` beside it (someone else's batches) keeps running."""
    other_tmp = tempfile.mkdtemp(prefix="p2o", dir="/tmp")
    other_port, ours = _free_port(), _free_port()
    other_env = {**node_env, "RAY_TMPDIR": other_tmp}
    try:
        other = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={other_port}",
                                "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats"],
                               env=other_env, capture_output=True, text=True, timeout=180)
        assert other.returncode == 0, other.stderr[-2000:]
        start = subprocess.run([*CLI, "node", "start", "--cpu-gpus", "1", "--port", str(ours)], env=node_env,
                               capture_output=True, text=True, timeout=180)
        assert start.returncode == 0, start.stderr[-2000:]
        assert _answers(ours) and _answers(other_port)
        stop = subprocess.run([*CLI, "node", "stop"], env=node_env, capture_output=True, text=True, timeout=120)
        print(stop.stdout, stop.stderr)
        assert stop.returncode == 0 and "Ray node stopped" in stop.stdout
        assert not _answers(ours)
        assert _answers(other_port), "node stop ended a Ray cluster it did not start"
        assert _processes_naming(other_tmp)  # its processes are all still there
        assert not _processes_naming(node_env["RAY_TMPDIR"])
    finally:
        _kill_leftovers(other_tmp)
        shutil.rmtree(other_tmp, ignore_errors=True)


def _processes_naming(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_node_recorded_but_gone_is_not_joined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray start` records its node for ray.init to join; a node killed without `ray stop` leaves
    the record behind. A run then starts a cluster of its own and says why."""
    from pan2render.runner.cluster.ray_cluster import running_local_node

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    assert running_local_node() == (None, None)
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{_free_port()}")
    node, note = running_local_node()
    assert node is None and note is not None and "does not answer" in note and "starting a local cluster" in note
    with socket.socket() as listening:  # something answers there now: that is the node to join
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        (tmp_path / "ray" / "ray_current_cluster").write_text(address)
        assert running_local_node() == (address, None)
