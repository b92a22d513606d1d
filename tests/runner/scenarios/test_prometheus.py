"""A real Prometheus server (Debian's ``prometheus``, which .ci/run installs) scrapes a farm in a process
of its own, every second, while the farm renders a tiny batch with one failing job; PromQL through
Prometheus's own HTTP API then finds the ledger's counts (videos done and failed, by class), the
queue depth and the GPU groups' states. The farm is killed (SIGKILL) and started again on the same
port: the totals Prometheus sees are still the ledger's, with no reset, while the one counter kept in
memory (the API's requests) shows the reset its HELP and the README announce."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from runner_helpers import until

from pan2render.client import FarmClient, find_farm
from pan2render.jobs.ledger import JobState, Ledger
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]
PROMETHEUS = shutil.which("prometheus") or next((p for p in ("/usr/bin/prometheus",) if os.path.exists(p)), None)
BROKEN = {"fail": {"job": "broken", "stage": "sampling", "raise": "JobInputError"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])



@pytest.fixture
def farm_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The farm's environment: in-process workers and the fake pipeline (no Ray), the fault hook."""
    e = {**os.environ, "PAN2_RENDER_FARM": str(tmp_path / "farm"), "PAN2_RENDER_CACHE": str(tmp_path / "cache"),
         "PAN2_RENDER_PIPELINE": FAKE_FACTORY, "PAN2_RENDER_EXECUTOR": "local",
         "PAN2_RENDER_FAULTS": json.dumps(BROKEN)}
    try:
        yield e
    finally:
        subprocess.run([*CLI, "farm", "stop"], env=e, capture_output=True, timeout=120, check=False)
        if (pid := farm_pid(e)) is not None:  # (a stop that did not end it)
            _kill(pid)


def farm_pid(env: dict[str, str]) -> int | None:
    try:
        return int(json.loads((Path(env["PAN2_RENDER_FARM"]) / "farm.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    until(lambda: not Path(f"/proc/{pid}").exists(), f"pid {pid} to end", timeout_s=30)


def start_farm(env: dict[str, str], tmp_path: Path, port: int) -> FarmClient:
    done = subprocess.run([*CLI, "farm", "start", "--port", str(port), "--inputs-root", str(tmp_path),
                           "--outputs-root", str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    client = find_farm(Path(env["PAN2_RENDER_FARM"]))
    assert client is not None
    return client


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A Prometheus server of the test's own (its storage in tmp, a free port), scraping
    127.0.0.1:<farm port> every second; yields (its URL, the farm's port). Stopped by its pid."""
    if PROMETHEUS is None:
        pytest.skip("Prometheus's server is not installed (Debian's `prometheus` package; .ci/run installs it)")
    farm_port, port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "pan2render", "scrape_interval": "1s", "scrape_timeout": "1s",
                            "static_configs": [{"targets": [f"127.0.0.1:{farm_port}"]}]}]}))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        until(lambda: _answers(f"{url}/-/ready") or proc.poll() is not None, "Prometheus to be ready")
        assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
        yield url, farm_port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def query(prometheus_url: str, promql: str) -> dict[tuple[tuple[str, str], ...], float]:
    """An instant query through Prometheus's HTTP API: each series' labels (without __name__, job,
    instance) -> its value."""
    url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return {tuple(sorted((k, v) for k, v in r["metric"].items() if k not in ("__name__", "job", "instance"))):
            float(r["value"][1]) for r in body["data"]["result"]}


def one(prometheus_url: str, promql: str) -> float | None:
    found = query(prometheus_url, promql)
    return next(iter(found.values())) if len(found) == 1 else None


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of docs/grafana-farm.json, its variables set to "any"."""
    doc = json.loads((Path(__file__).resolve().parents[3] / "docs" / "grafana-farm.json").read_text())
    return [(p["title"], t["expr"].replace("$job", ".+").replace("$instance", ".+"))
            for p in doc["panels"] for t in p["targets"]]


def ledger_counts(out: Path) -> dict[JobState, int]:
    led = Ledger.open_readonly(out)
    try:
        states = [j.state for j in led.jobs()]
    finally:
        led.close()
    return {s: states.count(s) for s in JobState}


def test_prometheus_finds_the_ledgers_counts_before_and_after_a_kill(
        tmp_path: Path, farm_env: dict[str, str], prometheus: tuple[str, int]) -> None:
    prom, port = prometheus
    farm = start_farm(farm_env, tmp_path, port)
    text = yaml.safe_dump({"model": "tiny", "preset": "tiny-preview", "defaults": {"steps": 2},
                           "jobs": [{"name": "fine", "prompt": "a fox"}, {"name": "broken", "prompt": "an owl"}]})
    b = farm.submit_text(text, out=tmp_path / "out", base=tmp_path)
    until(lambda: farm.batch(b["id"])["exit_code"] is not None, "the batch to end")
    queued = farm.batch(b["id"])["counts"]
    counts = ledger_counts(tmp_path / "out")
    assert (counts[JobState.DONE], counts[JobState.FAILED]) == (queued["done"], queued["failed"]) == (1, 1)

    # What Prometheus scraped (every second; the farm reads its ledgers every few seconds).
    until(lambda: one(prom, "pan2render_videos_done_total") == counts[JobState.DONE], "the done video in Prometheus")
    until(lambda: one(prom, "sum(pan2render_videos_failed_total)") == counts[JobState.FAILED], "the failed one")
    assert one(prom, 'pan2render_videos_failed_total{failure_class="input"}') == 1
    assert one(prom, 'pan2render_jobs{state="done"}') == counts[JobState.DONE]
    assert one(prom, "sum(pan2render_queue_depth)") == 0  # nothing waits: the batch ended
    groups = {dict(k)["state"]: v for k, v in query(prom, "pan2render_gpu_groups").items()}
    assert groups == {"loading": 0, "busy": 0, "idle": 1, "held_out": 0}  # the group stays warm, idle
    assert one(prom, 'up{job="pan2render"}') == 1
    for title, promql in dashboard_queries():  # the dashboard's every query is PromQL Prometheus runs, on series there
        until(lambda q=promql: query(prom, q), f"{title}: {promql} to find a series (rates need two scrapes)")
    before_kill = one(prom, "pan2render_start_time_seconds")
    # The scrapes the farm counted (each after its answer): past 1, a count started again is seen to drop.
    until(lambda: (one(prom, 'pan2render_api_requests_total{route="/metrics",status="200"}') or 0) >= 3,
          "Prometheus to see the farm count its scrapes")

    _kill(farm_pid(farm_env))  # SIGKILL: nothing of the farm runs its clean-up
    farm = start_farm(farm_env, tmp_path, port)
    started = json.loads((tmp_path / "farm" / "farm.json").read_text())["started_at"]
    assert started != before_kill
    until(lambda: one(prom, "pan2render_start_time_seconds") == started, "a scrape of the farm started again")
    # The totals are the ledger's still, and Prometheus saw no reset of them across the kill ...
    assert one(prom, "pan2render_videos_done_total") == counts[JobState.DONE]
    assert one(prom, "sum(pan2render_videos_failed_total)") == counts[JobState.FAILED]
    assert one(prom, "resets(pan2render_videos_done_total[5m])") == 0
    assert one(prom, 'resets(pan2render_videos_failed_total{failure_class="input"}[5m])') == 0
    # ... while the count kept in memory restarted from zero, as documented, and resets() sees it.
    until(lambda: (one(prom, 'resets(pan2render_api_requests_total{route="/metrics",status="200"}[5m])') or 0) >= 1,
          "the API's request count's reset")
    assert ledger_counts(tmp_path / "out") == counts
