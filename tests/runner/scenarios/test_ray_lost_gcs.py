"""A real Ray cluster whose GCS is killed mid-batch.

With its GCS gone, Ray's calls that need it block (signals do not interrupt them) until Ray ends
the driver after RAY_gcs_rpc_server_reconnect_timeout_s, printing only "Failed to connect to GCS
within N seconds" (exit 1, the running jobs left "running"). The runner watches the GCS itself and
ends first, after half that timeout: exit 3, one paragraph naming the cluster, the running jobs
back to pending uncharged; ``resume`` against a new cluster then finishes. The test shortens Ray's
timeout to 30 s (so the run gives up after 15 s).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from runner_helpers import one_done_and_one_sampling, write_batch

from pan2render.jobs.ledger import JobState, Ledger, Stage

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]
RAY = str(Path(sys.executable).with_name("ray"))
EXIT_ENVIRONMENT = 3


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_ENABLE_UV_RUN_RUNTIME_ENV="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
               **extra)
    return env


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def _head() -> Iterator[tuple[str, subprocess.Popen]]:
    """A one-node cluster from `ray start --head --block` (1 logical GPU) in its own session and
    temp folder; yields its GCS address and the `ray start` process. --block: when one of the
    head's processes dies (its GCS), `ray start` takes the others down, as a dead head does."""
    with tempfile.TemporaryDirectory(prefix="r", dir="/tmp") as tmp:  # short: socket paths
        head = subprocess.Popen(
            [RAY, "start", "--head", "--port", "0", "--num-cpus", "1", "--num-gpus", "1", "--temp-dir", tmp,
             "--include-dashboard", "false", "--disable-usage-stats", "--block"],
            # The workers inherit the node's environment, not the driver's: ~3 s of sampling per
            # job, time to kill the GCS under one.
            env=_env(PAN2_FAKE_STEP_SECONDS="0.3"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        try:
            assert head.stdout is not None
            address = None
            deadline = time.monotonic() + 90
            for line in head.stdout:  # `ray start --address='HOST:PORT'` names the GCS
                if m := re.search(r"ray start --address='([^']+)'", line):
                    address = m.group(1)
                    break
                assert time.monotonic() < deadline, "the head did not start within 90 s"
            assert address, "ray start ended without an address"
            yield address, head
        finally:
            _kill_session(head)
            head.wait(timeout=30)


def _kill_gcs(head: subprocess.Popen) -> None:
    """SIGKILL the GCS of this head: the one gcs_server process of its session."""
    gcs = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getsid(int(entry.name)) == head.pid and \
                    (entry / "comm").read_text().strip() == "gcs_server":
                gcs.append(int(entry.name))
        except (OSError, ProcessLookupError):  # gone meanwhile, or not ours to read
            continue
    assert len(gcs) == 1, gcs
    os.kill(gcs[0], signal.SIGKILL)


def _fingerprint(path: Path) -> tuple[int, str]:
    return path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


def test_gcs_killed_mid_run_ends_cleanly_and_resume_finishes(tmp_path: Path) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": f"j{i}", "prompt": f"clip {i}"} for i in range(3)],
                        defaults={"steps": 10})
    out = tmp_path / "out"
    env = _env(PAN2_RENDER_PIPELINE="pan2render.runner.worker.fake_pipeline:load_fake_pipeline",
               RAY_gcs_rpc_server_reconnect_timeout_s="30")
    with _head() as (address, head):
        run = subprocess.Popen([*CLI, "run", str(batch), "--out", str(out), "--address", address,
                                "--no-progress"], env=env, start_new_session=True, stderr=subprocess.PIPE,
                               text=True)
        try:
            deadline = time.monotonic() + 90
            while not one_done_and_one_sampling(out):
                assert run.poll() is None, f"the run ended first: {run.stderr.read() if run.stderr else ''}"
                assert time.monotonic() < deadline, "no job sampling after another finished within 90 s"
                time.sleep(0.05)
            _kill_gcs(head)
            _, err = run.communicate(timeout=120)
        finally:
            _kill_session(run)
    print(err[-2000:])
    assert run.returncode == EXIT_ENVIRONMENT, err
    assert "Traceback" not in err and "Failed to connect to GCS" not in err
    assert f"the Ray cluster at {address} is gone" in err and f"pan2-render resume {out}" in err

    led = Ledger.open_readonly(out)
    jobs = led.jobs()
    requeued = [e.detail for e in led.events() if e.label == "running->pending"]
    # Nothing claims more than was done: every done job's video is the one the ledger recorded.
    done = {}
    for j in jobs:
        if j.state is JobState.DONE:
            rec = led.stages(j.id)[Stage.ENCODE]
            assert hashlib.sha256((out / rec.artifact).read_bytes()).hexdigest() == rec.sha256
            done[j.id] = (j.attempts, _fingerprint(out / rec.artifact))
    led.close()
    print("after the kill:", {j.name: (j.state.value, j.retries_left) for j in jobs}, requeued)
    assert not any(j.state is JobState.RUNNING for j in jobs)  # the running ones went back to pending
    assert all(j.retries_left == 2 and j.state is not JobState.FAILED for j in jobs)  # none charged
    assert requeued and done and len(done) < len(jobs)

    with _head() as (address, _):  # a new cluster: resume finishes, redoing no done job
        resume = subprocess.Popen([*CLI, "resume", str(out), "--address", address, "--no-progress"],
                                  env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
        try:
            _, err = resume.communicate(timeout=150)
        finally:
            _kill_session(resume)
    print(err[-800:])
    assert resume.returncode == 0, err
    led = Ledger.open_readonly(out)
    try:
        assert all(j.state is JobState.DONE for j in led.jobs())
        for jid, (attempts, fp) in done.items():
            assert led.job(jid).attempts == attempts and _fingerprint(out / jid / "video.mp4") == fp
    finally:
        led.close()
