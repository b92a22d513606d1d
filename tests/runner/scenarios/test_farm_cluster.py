"""A farm on a Ray cluster of two GPU nodes (both on this machine, one logical GPU each, a head
without GPUs: ``ray.cluster_utils.Cluster``): it keeps a warm group on each node and serves one
batch across them, and when one node is lost its job goes back to the queue uncharged and the
batch finishes on the other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import stop_farm, write_batch

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                   "health_check_timeout_ms": 500, "health_check_failure_threshold": 2}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Any, dict[str, str]]]:
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory(prefix="r", dir="/tmp") as tmp:
        mp.setenv("RAY_TMPDIR", tmp)
        mp.setenv("RAY_AUTH_MODE", "disabled")  # the cluster is this test's own
        mp.setenv("PAN2_FAKE_STEP_SECONDS", "0.3")  # the nodes' workers inherit it: ~3 s a job
        c = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "_system_config": FAST_NODE_DEATH})
        root = tmp_path / "farm"
        env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0",
               "PAN2_RENDER_FARM": str(root), "PAN2_RENDER_PIPELINE": FAKE_FACTORY}
        try:
            yield c, env
        finally:
            stop_farm(env, root)
            c.shutdown()


def _queue(env: dict[str, str]) -> list[dict[str, Any]]:
    done = subprocess.run([*CLI, "queue", "--all", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _worker_nodes(address: str) -> set[str]:
    """The nodes holding the farm's GPU groups (its live placement groups), asked of the cluster's
    GCS from a process of the test's own."""
    code = ("import ray, json; from ray.util import placement_group_table; "
            "ray.init(address=%r, logging_level='ERROR'); "
            "print(json.dumps(sorted({n for pg in placement_group_table().values() if pg['state'] == 'CREATED' "
            "for n in pg['bundles_to_node_id'].values()})))" % address)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-2000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_farm_serves_one_batch_on_two_nodes_and_a_lost_node_costs_no_attempt(
        tmp_path: Path, cluster: tuple[Any, dict[str, str]]) -> None:
    c, env = cluster
    nodes = [c.add_node(num_cpus=1, num_gpus=1) for _ in range(2)]
    c.wait_for_nodes()
    start = subprocess.run([*CLI, "farm", "start", "--address", c.address, "--inputs-root", str(tmp_path),
                            "--outputs-root", str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    print(start.stdout, start.stderr[-2000:])
    assert start.returncode == 0
    batch = write_batch(tmp_path / "b.yaml", [{"name": f"j{i}", "prompt": f"clip {i}"} for i in range(6)],
                        defaults={"steps": 10})
    out = tmp_path / "out"
    assert subprocess.run([*CLI, "submit", str(batch), "--out", str(out)], env=env, timeout=120).returncode == 0

    deadline = time.monotonic() + 120
    while len(_queue(env)[0]["running"]) < 2:  # one job on each node's group at once
        assert time.monotonic() < deadline, "the batch never ran on two groups at once"
        time.sleep(0.3)
    on = _worker_nodes(c.address)
    print("workers on nodes:", on)
    assert len(on) == 2  # a warm group on each GPU node

    c.remove_node(nodes[1], allow_graceful=False)  # one node lost under a running job
    deadline = time.monotonic() + 180
    while _queue(env)[0]["exit_code"] is None:
        assert time.monotonic() < deadline, "the batch did not finish on the node left"
        time.sleep(0.5)
    led = Ledger.open_readonly(out)
    try:
        jobs = led.jobs()
        requeued = [e.detail for e in led.events() if e.label == "running->pending"]
    finally:
        led.close()
    print({j.name: (j.state.value, j.attempts, j.retries_left) for j in jobs}, requeued)
    assert all(j.state is JobState.DONE for j in jobs)
    assert requeued and all("not charged" in r for r in requeued)  # the cluster's failure, not the jobs'
    assert all(j.retries_left == 2 for j in jobs)  # no attempt charged for the loss
