"""The local Ray cluster `run` and the farm start, seen from outside: every process of it listens on
the loopback address alone, Ray's token file is readable by its owner alone, and what a killed
farm's cluster leaves running (Ray's dashboard and runtime-env agents, which outlive it by minutes)
is ended by the next `farm start`, and nothing else is.

Each test's Ray lives in a temp folder of its own (RAY_TMPDIR) with a HOME of its own (the token)
and a pan2-render cache of its own (the runs' records): nothing else on the machine sees it, and the
test ends only what it started.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runner_helpers import jobs_done, wait_while_running, write_batch

from pan2render.runner.cluster.leftovers import RECORD_NAME, RUN_RECORDS, read_record, running
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    ray_tmp = tempfile.mkdtemp(prefix="p2l", dir="/tmp")  # short: Ray's socket paths are limited
    (tmp_path / "home").mkdir()
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "HOME": str(tmp_path / "home"), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "PAN2_RENDER_FARM": str(tmp_path / "farm"),
           "PAN2_RENDER_CACHE": str(tmp_path / "cache"), "PAN2_RENDER_PIPELINE": FAKE_FACTORY,
           "PAN2_FAKE_STEP_SECONDS": "0.3"}
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
                 "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(name, None)
    try:
        yield env
    finally:
        subprocess.run([*CLI, "farm", "stop"], env=env, capture_output=True, timeout=120, check=False)
        for pid in _carrying(ray_tmp):  # what a failed test left of its Ray
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _carrying(mark: str) -> dict[int, str]:
    """Live processes whose environment or command line holds ``mark`` (the test's RAY_TMPDIR: every
    Ray process its run or farm started, the agents that rename themselves included) -> argv[0]."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if state != "Z" and (mark.encode() in cmdline or mark.encode() in environ):
            found[int(entry.name)] = cmdline.split(b"\0")[0].decode(errors="replace")
    return found


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of the kernel's socket table: each 32-bit word printed in the machine's order."""
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    return (ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else ip


def _listening(pids: set[int]) -> dict[int, list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]]:
    """pid -> the (address, port) pairs its TCP sockets listen on: the listening rows of the kernel's
    socket tables (/proc/net/tcp and tcp6), matched by inode to each process's open sockets."""
    listeners = {}
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A":  # LISTEN
                host, port = fields[1].split(":")
                listeners[fields[9]] = (_address(host), int(port, 16))
    found: dict[int, list] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = target.removeprefix("socket:[").removesuffix("]")
            if target.startswith("socket:[") and inode in listeners:
                found.setdefault(pid, []).append(listeners[inode])
    return found


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=240)
    print(f"$ pan2-render {' '.join(args)} -> {done.returncode}\n{done.stdout}{done.stderr[-3000:]}")
    return done


def test_a_runs_cluster_listens_on_loopback_alone_and_keeps_its_token_private(
        tmp_path: Path, env: dict[str, str]) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": f"j{i}", "prompt": f"clip {i}"} for i in range(2)],
                        defaults={"steps": 8})
    out = tmp_path / "out"
    run = subprocess.Popen([*CLI, "run", str(batch), "--out", str(out), "--cpu-gpus", "1", "--no-progress"],
                           env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        # Once a job is done the next one samples: the GCS, raylet, agents, the worker actor and the
        # driver itself are all up.
        wait_while_running(run, lambda: jobs_done(out) >= 1, within_s=180, what="no job done")
        procs = _carrying(env["RAY_TMPDIR"]) | {run.pid: "driver"}
        listening = _listening(set(procs))
        print({f"{pid} {procs[pid]}": [f"{ip}:{port}" for ip, port in socks] for pid, socks in listening.items()})
        names = {Path(procs[pid]).name for pid in listening}
        assert {"gcs_server", "raylet", "driver"} <= names  # the check below sees the cluster's sockets
        exposed = {procs[pid]: [f"{ip}:{port}" for ip, port in socks if not ip.is_loopback]
                   for pid, socks in listening.items()}
        assert not any(exposed.values()), exposed

        token = Path(env["HOME"]) / ".ray" / "auth_token"  # Ray's token authentication is on, with this token
        assert oct(token.stat().st_mode & 0o777) == "0o600"
        records = list(run_records_of(env).glob("*.json"))
        assert len(records) == 1 and read_record(records[0]).driver.pid == run.pid
        _, err = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=10)
    assert run.returncode == 0, err[-2000:]
    assert not list(run_records_of(env).glob("*.json"))  # the cluster ended with the run: nothing to end later


def run_records_of(env: dict[str, str]) -> Path:
    """The runs' records in the test's pan2-render cache."""
    return Path(env["PAN2_RENDER_CACHE"]) / RUN_RECORDS.format(uid=os.getuid())


def test_a_farm_started_after_a_killed_one_ends_what_its_cluster_left_and_nothing_else(
        tmp_path: Path, env: dict[str, str]) -> None:
    root = Path(env["PAN2_RENDER_FARM"])
    assert _cli(env, "farm", "start", "--cpu-gpus", "1").returncode == 0
    farm_pid = json.loads((root / "farm.json").read_text())["pid"]
    record = read_record(root / RECORD_NAME)
    assert record.driver.pid == farm_pid and len(record.processes) >= 4  # GCS, raylet, two agents, ...

    os.kill(farm_pid, signal.SIGKILL)
    time.sleep(5)  # Ray's GCS and raylet notice their driver is gone and end; its agents do not
    left = [p for p in record.processes if running(p)]
    print("left running by the killed farm:", {p.pid: Path(f"/proc/{p.pid}/cmdline").read_bytes()[:40] for p in left})
    assert left, "nothing of the killed farm's cluster ran on: the test shows nothing"

    # Processes of the test's own with Ray's names, which no record names: never ended.
    (tmp_path / "raylet").symlink_to(shutil.which("sleep"))
    decoys = [subprocess.Popen(["bash", "-c", "exec -a ray::DashboardAgent sleep 300"]),
              subprocess.Popen([str(tmp_path / "raylet"), "300"])]
    try:
        assert _cli(env, "farm", "start", "--cpu-gpus", "1").returncode == 0
        assert not [p for p in left if running(p)]
        assert all(d.poll() is None for d in decoys)
        log = (root / "farm.log").read_text()
        assert f"left running by the local Ray cluster of a killed run or farm (pid {farm_pid}" in log, log[-3000:]
        assert read_record(root / RECORD_NAME).driver.pid != farm_pid  # the new farm's own cluster
        assert _cli(env, "farm", "stop").returncode == 0
        assert not (root / RECORD_NAME).exists()  # stopped cleanly: nothing left to end
    finally:
        for d in decoys:
            d.kill()
            d.wait(timeout=10)
