"""A real Ray cluster losing the node that holds the GPUs, mid-batch: ``ray.cluster_utils.Cluster``
with a head without GPUs and a worker node with one logical GPU, the node's processes killed
(raylet included) while a job runs. The job goes back to pending uncharged and the batch waits
for GPUs: a node that comes back lets it finish; otherwise the command ends after
``--cluster-wait`` with one paragraph (exit 3) and ``resume`` on the restored cluster finishes
without redoing a done job.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import jobs_by_name, one_done_and_one_sampling, write_batch

from pan2render.jobs.ledger import JobState, Ledger

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]
# The GCS declares a node dead after missing 2 health checks 0.5 s apart (Ray's defaults take
# about 15 s), so the loss is seen within seconds.
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                   "health_check_timeout_ms": 500, "health_check_failure_threshold": 2}
EXIT_ENVIRONMENT = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head without GPUs, for the whole module. Its own temp folder (short: Ray's socket paths
    must fit 107 bytes), so that the "current cluster" file Ray writes there cannot make another
    test's ray.init() join this cluster."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory(prefix="r", dir="/tmp") as tmp:
        mp.setenv("RAY_TMPDIR", tmp)
        mp.setenv("RAY_AUTH_MODE", "disabled")  # the cluster is this test's own
        # The workers inherit their node's environment (not the driver's): ~3 s of sampling per
        # job, time to kill the node under one.
        mp.setenv("PAN2_FAKE_STEP_SECONDS", "0.3")
        c = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "_system_config": FAST_NODE_DEATH})
        try:
            yield c
        finally:
            c.shutdown()


def _gpu_node(cluster: Any) -> Any:
    return cluster.add_node(num_cpus=1, num_gpus=1)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_ENABLE_UV_RUN_RUNTIME_ENV="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
               PAN2_RENDER_PIPELINE="pan2render.runner.worker.fake_pipeline:load_fake_pipeline")
    return env


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args, "--no-progress"], env=_env(), start_new_session=True,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 150) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the run's session
        except ProcessLookupError:
            pass
    print(err[-1500:])
    return err


def _kill_node_mid_job(cluster: Any, node: Any, proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 90
    while not one_done_and_one_sampling(out):
        assert proc.poll() is None, f"the run ended first: {proc.stderr.read() if proc.stderr else ''}"
        assert time.monotonic() < deadline, "no job sampling after another finished within 90 s"
        time.sleep(0.05)
    cluster.remove_node(node, allow_graceful=False)


def _fingerprint(path: Path) -> tuple[int, str]:
    return path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


def _batch(tmp_path: Path) -> Path:
    return write_batch(tmp_path / "b.yaml", [{"name": f"j{i}", "prompt": f"clip {i}"} for i in range(3)],
                       defaults={"steps": 10})


def _assert_lost_jobs_uncharged(out: Path) -> None:
    """The job(s) running when the node died went back to pending as the cluster's failure, and no
    job was charged an attempt (each keeps the whole budget of --retries 2) or failed."""
    led = Ledger.open_readonly(out)
    try:
        requeued = [e.detail for e in led.events() if e.label == "running->pending"]
        jobs = led.jobs()
    finally:
        led.close()
    print("requeued:", requeued)
    assert requeued and all("cluster lost" in d for d in requeued)
    assert all(j.retries_left == 2 and j.state is not JobState.FAILED for j in jobs)


def test_node_lost_then_back_within_the_wait_finishes(cluster: Any, tmp_path: Path) -> None:
    node = _gpu_node(cluster)
    out = tmp_path / "out"
    run = _cli("run", str(_batch(tmp_path)), "--out", str(out), "--address", cluster.address,
               "--cluster-wait", "120")
    try:
        _kill_node_mid_job(cluster, node, run, out)
        time.sleep(2.0)  # the batch notices the loss and waits
        assert run.poll() is None, "the run ended instead of waiting for GPUs"
        node = _gpu_node(cluster)
    finally:
        err = _finish(run)
    assert run.returncode == 0, err
    assert "Traceback" not in err and "again; continuing" in err
    assert all(j.state is JobState.DONE for j in jobs_by_name(out).values())
    _assert_lost_jobs_uncharged(out)
    cluster.remove_node(node)


def test_node_lost_for_good_stops_then_resume_finishes(cluster: Any, tmp_path: Path) -> None:
    node = _gpu_node(cluster)
    out = tmp_path / "out"
    run = _cli("run", str(_batch(tmp_path)), "--out", str(out), "--address", cluster.address,
               "--cluster-wait", "5")
    try:
        _kill_node_mid_job(cluster, node, run, out)
    finally:
        err = _finish(run)
    assert run.returncode == EXIT_ENVIRONMENT, err
    assert "Traceback" not in err
    assert f"the Ray cluster at {cluster.address} lost its GPUs" in err
    assert "did not come back within 5 s" in err and f"pan2-render resume {out}" in err
    _assert_lost_jobs_uncharged(out)
    after = jobs_by_name(out)
    assert not any(j.state is JobState.RUNNING for j in after.values())
    done = {n: (j.attempts, _fingerprint(out / j.id / "video.mp4"))
            for n, j in after.items() if j.state is JobState.DONE}
    assert done and len(done) < len(after)

    node = _gpu_node(cluster)  # the cluster is restored: resume finishes, redoing nothing done
    resume = _cli("resume", str(out), "--address", cluster.address)
    err = _finish(resume)
    assert resume.returncode == 0, err
    final = jobs_by_name(out)
    assert all(j.state is JobState.DONE for j in final.values())
    for name, (attempts, fp) in done.items():
        assert final[name].attempts == attempts and _fingerprint(out / final[name].id / "video.mp4") == fp
    cluster.remove_node(node)
