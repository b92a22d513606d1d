"""The farm's /metrics, /healthz and /readyz as a scraper and a supervisor meet them, and the counts
behind them: the exposition parses with prometheus_client's own parser, every family has its HELP and
TYPE, its numbers are the ledger's and the queue's (a retry's and a failure's class, a preemption, a
step-checkpoint resume), they hold across a farm started again, no prompt text is in them; who may
read the three routes without a user's token; when the farm says it is not ready; and `run
--metrics-port`. tests/runner/scenarios/test_prometheus.py has a real Prometheus scrape a farm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from runner_helpers import farm_config, serving_farm, spec, submit_file, until, write_batch

from pan2render.jobs.ledger import EventKind, JobEvent, Ledger, Stage, StageEvent
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import Batch, JobSpec
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.farm import metrics as farm_metrics
from pan2render.runner.farm.metrics import FarmCollector, read_metrics_token, readiness
from pan2render.runner.farm.service import Farm
from pan2render.runner.protocol.messages import WorkerConfig
from pan2render.runner.serve import metrics as serve_metrics
from pan2render.runner.serve.attempt import PREEMPTED_AT
from pan2render.runner.serve.config import SettingError
from pan2render.runner.serve.metrics import Family, FolderTally
from pan2render.runner.serve.session import BatchRequest
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

SECRET = "a secret fox in the snow"
BROKEN = {"fail": {"job": "broken", "stage": "sampling", "raise": "JobInputError"}}
DECLARED = [f for m in (serve_metrics, farm_metrics) for f in vars(m).values() if isinstance(f, Family)]


def get(url: str, *, token: str | None = None, host: str | None = None) -> tuple[int, str]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    if host is not None:
        headers["Host"] = host
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(found: dict[str, Metric], sample: str, **labels: str) -> float:
    """The value of the sample named ``sample`` with exactly these labels (0 when absent)."""
    return next((s.value for f in found.values() for s in f.samples if s.name == sample and s.labels == labels), 0.0)



def batch_state(url: str, token: str, batch_id: str) -> dict[str, Any]:
    return json.loads(get(f"{url}/api/batches/{batch_id}", token=token)[1])


def ended(url: str, token: str, batch_id: str) -> dict[str, Any]:
    return until(lambda: (b := batch_state(url, token, batch_id))["exit_code"] is not None and b, "the batch to end")


# ---------------------------------------------------------------------------------------- what /metrics says
def test_the_exposition_parses_and_its_counts_are_the_ledgers(tmp_path: Path) -> None:
    with serving_farm(tmp_path, faults=BROKEN) as (farm, url, token):
        b1 = submit_file(farm, tmp_path / "out", {"defaults": {"steps": 2}, "jobs": [
            {"name": "fine", "prompt": SECRET}, {"name": "broken", "prompt": SECRET, "seed": 1}]})
        queued = ended(url, token, b1)
        code, text = get(f"{url}/metrics")  # a loopback farm: no token needed
    assert code == 200
    found = families(text)
    for f in found.values():  # HELP and TYPE for every family, as Prometheus reads them
        assert f.documentation and f.type in ("gauge", "counter", "histogram"), f
        exposed = f.name + ("_total" if f.type == "counter" else "")
        assert f"# HELP {exposed} " in text and f"# TYPE {exposed} {f.type}\n" in text, exposed
    assert set(found) == {"pan2render_" + f.name for f in DECLARED}  # every family declared is shown
    counts = queued["counts"]  # what `queue` and `status` say
    assert (counts["done"], counts["failed"]) == (1, 1)
    assert value(found, "pan2render_jobs", state="done") == counts["done"]
    assert value(found, "pan2render_jobs", state="failed") == counts["failed"]
    assert value(found, "pan2render_videos_done_total") == 1
    assert value(found, "pan2render_videos_failed_total", failure_class="input") == 1
    assert sum(s.value for s in found["pan2render_videos_failed"].samples) == 1
    assert value(found, "pan2render_batches", state="failed", owner="ann") == 1
    assert value(found, "pan2render_queue_depth", batch_state="active", owner="ann") == 0
    assert value(found, "pan2render_stage_seconds_count", stage="sampling") == 1  # the done job's alone
    assert value(found, "pan2render_sampling_step_seconds_count", model="tiny", size="64x64x17") == 1
    assert value(found, "pan2render_group_load_seconds_count") == 1
    assert value(found, "pan2render_queue_wait_seconds_count") == 2  # each job started once
    assert value(found, "pan2render_video_seconds_total") > 0
    assert value(found, "pan2render_gpu_groups", state="idle") == 1 and value(found, "pan2render_gpus") == 1
    assert value(found, "pan2render_api_requests_total", route="/api/batches/{id}", status="200") >= 1
    assert SECRET not in text and "secret" not in text  # no prompt text, ever


def test_the_readme_names_every_family_with_its_type() -> None:
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    for f in DECLARED:
        name = f"pan2render_{f.name}" + ("_total" if f.kind == "counter" else "")
        assert f"| `{name}` | {f.kind} |" in readme, name


def test_a_retry_is_counted_with_its_class(tmp_path: Path) -> None:
    flaky = {"fail": {"job": "flaky", "stage": "decode", "raise": "RuntimeError"}}
    with serving_farm(tmp_path, faults=flaky) as (farm, url, token):
        b1 = submit_file(farm, tmp_path / "out", {"defaults": {"steps": 2}, "jobs": [{"name": "flaky", "prompt": "x"}]})
        ended(url, token, b1)
        found = families(get(f"{url}/metrics")[1])
    # Retried once (unknown: charged), then the same error twice in a row fails it.
    assert value(found, "pan2render_retries_total", failure_class="unknown") == 1
    assert value(found, "pan2render_videos_failed_total", failure_class="unknown") == 1
    assert value(found, "pan2render_videos_done_total") == 0


def test_a_preemption_and_a_resume_are_counted_from_the_ledger(tmp_path: Path) -> None:
    """Written as the scheduler and the flow write them (the reason's start, the event kind)."""
    led = Ledger.open(tmp_path)
    job = spec("pre", steps=4)
    led.add_jobs([job], retries=2)
    led.transition(job.job_id, JobEvent.START, reason="on group g1")
    led.transition(job.job_id, JobEvent.INTERRUPT, reason=f"{PREEMPTED_AT} 2 by a higher-priority batch; ...")
    led.transition(job.job_id, JobEvent.START, reason="on group g1")
    led.log(job.job_id, EventKind.CHECKPOINT_RESUMED, "continuing its sampling from the step checkpoint at step 2/4")
    led.set_stage(job.job_id, Stage.SAMPLING, StageEvent.START)
    led.set_stage(job.job_id, Stage.SAMPLING, StageEvent.FINISH, seconds=2.0)
    led.close()
    tally = FolderTally(tmp_path, [job.job_id, "not-in-the-ledger"])
    tally.refresh()
    c = tally.counts(time.time())
    assert (c.preemptions, c.resumes, sum(c.retries.values()), c.done) == (1, 1, 0, 0)
    assert c.waits.counts[0] == 2  # two starts, each after a wait under a second
    assert c.stages["sampling"].total == 2.0 and not c.steps  # a resumed sampling's seconds cover half its steps
    assert tally.states[job.job_id].value == "running"
    led = Ledger.open(tmp_path)
    led.transition(job.job_id, JobEvent.FINISH, reason="video.mp4 written and checked")
    led.close()
    tally.refresh()  # the new events alone are read
    assert tally.counts(time.time()).done == 1 and tally.counts(time.time()).preemptions == 1


def _farm(tmp_path: Path, executor: LocalExecutor | None = None, **config: Any) -> Farm:
    root = tmp_path / "farm"
    root.mkdir(parents=True, exist_ok=True)
    ex = executor or LocalExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY, faults=BROKEN))
    return Farm(farm_config(root, **config), ex, log=lambda text: None)


def _scrape(farm: Farm) -> dict[str, Metric]:
    collector = FarmCollector(farm)
    try:
        return families(collector.exposition().decode())
    finally:
        collector.close()


def _request(out: Path, jobs: list[JobSpec]) -> BatchRequest:
    return BatchRequest(out_dir=out, batch=Batch(path="b.yaml", model="tiny", preset="tiny-preview", jobs=jobs),
                        overrides=Overrides())


def test_the_counts_hold_when_the_farm_starts_again(tmp_path: Path) -> None:
    farm = _farm(tmp_path)
    farm.actions.submit(_request(tmp_path / "out", [spec("ok"), spec("broken")]), owner="ann", priority=0)
    while farm.served or farm.scheduler.busy:
        farm.step()
    before = _scrape(farm)
    farm.close()
    again = _farm(tmp_path)  # (the process-level kill: tests/runner/scenarios/test_prometheus.py)
    again.resume_unfinished()
    after = _scrape(again)
    again.close()
    for name, labels in (("pan2render_videos_done_total", {}), ("pan2render_jobs", {"state": "done"}),
                         ("pan2render_videos_failed_total", {"failure_class": "input"}),
                         ("pan2render_stage_seconds_count", {"stage": "sampling"})):
        assert value(before, name, **labels) == value(after, name, **labels) == 1, name


# ---------------------------------------------------------------------------------------- who may read them
def test_a_loopback_farm_answers_without_a_token_but_not_through_another_name(tmp_path: Path) -> None:
    with serving_farm(tmp_path) as (farm, url, token):
        for path in ("/metrics", "/healthz", "/readyz"):
            code, _ = until(lambda p=path: (r := get(url + p))[0] == 200 and r, f"{path} to answer 200")
        assert get(f"{url}/api/status")[0] == 401  # the rest still needs a token
        port = url.rsplit(":", 1)[1]
        assert get(f"{url}/metrics", host=f"evil.example:{port}")[0] == 401  # a page through a rebound name
        assert get(f"{url}/metrics", host=f"evil.example:{port}", token=token)[0] == 200
        assert json.loads(get(f"{url}/healthz")[1])["alive"] is True


def _token_file(path: Path, token: str, mode: int = 0o600) -> Path:
    path.write_text(token + "\n")
    path.chmod(mode)
    return path


def test_elsewhere_the_metrics_token_opens_the_three_routes_and_nothing_else(tmp_path: Path) -> None:
    metrics_token = "m" * 40
    users = {"ann": ""}
    with serving_farm(tmp_path, host="0.0.0.0", users=users,
                      metrics_token_file=_token_file(tmp_path / "metrics.token", metrics_token)) as (farm, url, admin):
        url = url.replace("0.0.0.0", "127.0.0.1")
        for path in ("/metrics", "/healthz", "/readyz"):
            assert get(url + path)[0] == 401  # no token: refused, not a loopback farm
            assert get(url + path, token="wrong")[0] == 401
            assert get(url + path, token=metrics_token)[0] in (200, 503)
            assert get(url + path, token=users["ann"])[0] in (200, 503)  # a user's token opens them too
        for path in ("/api/status", "/api/batches", "/v1/videos"):
            assert get(url + path, token=metrics_token)[0] == 401  # and nothing else


def test_a_metrics_token_file_others_may_read_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _token_file(tmp_path / "ok", "t0ken")
    assert read_metrics_token(good) == "t0ken"
    for path, why in ((_token_file(tmp_path / "open", "t0ken", 0o644), "chmod 600"),
                      (_token_file(tmp_path / "empty", ""), "one token"),
                      (_token_file(tmp_path / "spaces", "two words"), "one token"),
                      (tmp_path / "missing", "cannot be opened")):
        with pytest.raises(SettingError, match=why):
            read_metrics_token(path)
    (tmp_path / "link").symlink_to(good)
    with pytest.raises(SettingError, match="a link is refused"):
        read_metrics_token(tmp_path / "link")
    from pan2render.runner.cli import main as cli

    assert cli.main(["farm", "start", "--root", str(tmp_path / "root"), "--metrics-token-file",
                     str(tmp_path / "open")]) == 2  # said by `farm start`, before any farm process
    assert "may be read by others (mode 644)" in capsys.readouterr().err and not (tmp_path / "root").exists()
    farm = _farm(tmp_path, metrics_token_file=tmp_path / "open")
    try:
        with pytest.raises(SettingError, match="chmod 600"):  # the farm's API does not start with it
            farm_metrics.MetricsApi(farm)
    finally:
        farm.close()


# ---------------------------------------------------------------------------------------- ready or not
class _Unreachable(LocalExecutor):
    def unreachable(self) -> str | None:
        return "the test's cluster: its GCS refuses connections"


def _published(farm: Farm) -> Iterator[list[str]]:
    """readiness(farm) after each of the farm's passes (it publishes every half second)."""
    while True:
        farm.step()
        yield readiness(farm)


def test_ready_until_the_cluster_or_the_queue_or_every_gpu_fails(tmp_path: Path) -> None:
    farm = _farm(tmp_path)
    assert readiness(farm) == ["the farm is starting (its loop has not published its first snapshot)"]
    checks = _published(farm)
    assert until(lambda: next(checks) == [], "the farm to be ready")
    farm.write_error = "OSError: [Errno 28] No space left on device"  # as _write sets it
    assert until(lambda: any("queue cannot be written" in r for r in next(checks)), "the refused write to show")
    farm.close()

    farm = _farm(tmp_path / "b", _Unreachable(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY)))
    checks = _published(farm)
    assert until(lambda: "the test's cluster: its GCS refuses connections" in next(checks), "the cluster's reason")
    farm.close()

    broken = LocalExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY,
                                                       faults={"broken_gpu": {"gpu": 0}}))
    farm = _farm(tmp_path / "c", broken, device_fault_limit=1)
    farm.actions.submit(_request(tmp_path / "c" / "out", [spec("j")]), owner="ann", priority=0)
    checks = _published(farm)
    assert until(lambda: any("held out of service" in r for r in next(checks)), "the held-out GPU to show")
    farm.close()


def test_a_ray_clusters_gcs_that_refuses_connections_is_unreachable() -> None:
    """The Ray executor's answer from a probe of its GCS's port (nothing of Ray asked, nothing blocks)."""
    from pan2render.runner.cluster.ray_cluster import GcsWatch
    from pan2render.runner.cluster.ray_executor import RayExecutor

    with socket.socket() as gcs:
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        ex = object.__new__(RayExecutor)  # no cluster: only its GCS's address
        ex.cluster = "the Ray cluster at its GCS"
        ex._gcs = GcsWatch(f"127.0.0.1:{gcs.getsockname()[1]}", period_s=60)
        try:
            assert ex.unreachable() is None
            gcs.close()  # the head node gone
            assert ex.unreachable() == "the Ray cluster at its GCS: its GCS refuses connections"
        finally:
            ex._gcs.stop()


def test_readyz_answers_503_with_its_reasons(tmp_path: Path) -> None:
    with serving_farm(tmp_path) as (farm, url, token):
        until(lambda: get(f"{url}/readyz")[0] == 200, "the farm to be ready")
        farm.write_error = "OSError: disk full"
        code, body = until(lambda: (r := get(f"{url}/readyz"))[0] == 503 and r, "a 503")
        answer = json.loads(body)
        assert answer["ready"] is False and "the queue cannot be written: OSError: disk full" in answer["reason"]
        assert get(f"{url}/healthz")[0] == 200  # alive all the same


# ---------------------------------------------------------------------------------------- `run --metrics-port`
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_run_serves_its_batchs_metrics_while_it_renders(tmp_path: Path) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": "slow", "prompt": SECRET}, {"name": "quick", "prompt": "q"}],
                        defaults={"steps": 2})
    port = _free_port()
    env = {**os.environ, "PAN2_RENDER_EXECUTOR": "local", "PAN2_RENDER_PIPELINE": FAKE_FACTORY,
           "PAN2_RENDER_FARM": str(tmp_path / "no-farm"), "PAN2_RENDER_CACHE": str(tmp_path / "cache"),
           # Longer than the metrics' refresh interval: a scrape made before the job started is cached that long.
           "PAN2_RENDER_FAULTS": json.dumps({"slow": {"job": "slow", "stage": "sampling",
                                                      "seconds": 2 * serve_metrics.REFRESH_S}})}
    proc = subprocess.Popen([sys.executable, "-m", "pan2render.runner.cli", "run", str(batch), "--out",
                             str(tmp_path / "out"), "--no-progress", "--no-farm", "--metrics-port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def running() -> dict[str, Metric] | None:
            try:
                found = families(get(f"http://127.0.0.1:{port}/metrics")[1])
            except OSError:
                return None
            return found if value(found, "pan2render_jobs", state="running") == 1 else None

        found = until(running, "the run's metrics while a job runs", timeout_s=120)
        assert SECRET not in get(f"http://127.0.0.1:{port}/metrics")[1]
        assert value(found, "pan2render_gpu_groups", state="busy") == 1
        assert value(found, "pan2render_jobs", state="pending") == 1
        assert value(found, "pan2render_queue_depth", batch_state="active", owner=_user()) == 1
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert f"metrics: http://127.0.0.1:{port}/metrics" in out
    with pytest.raises(OSError):  # the server ended with the run
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def _user() -> str:
    import getpass

    return getpass.getuser()
