"""The CLI and driver on real Ray actors: groups of 2 with gloo, a worker killed mid-sampling, a job
that always fails. One local Ray cluster (2 CPUs, 2 logical GPUs) is shared by the module; each
``pan2-render run`` here joins it instead of starting its own.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.media.video import probe_mp4
from pan2render.runner.cli import main as cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    import ray

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, object_store_memory=256 << 20,
             logging_level="WARNING")
    yield
    ray.shutdown()


def test_group_of_two_renders_on_cpu_with_gloo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    from pan2render.media.video import png_bytes

    # A TI2V job (first-frame image, sent to the workers as bytes) on a group of 2.
    (tmp_path / "first.png").write_bytes(png_bytes(np.full((64, 64, 3), 90, np.uint8)))
    batch = write_batch(tmp_path / "b.yaml", [{"name": "pair", "prompt": "two ranks", "gpus": 2,
                                               "image": "first.png"}],
                        defaults={"frames": 9, "steps": 3})
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == 0
    led = Ledger.open_readonly(out)
    (job,) = led.jobs()
    loads = [e.detail for e in led.events(job.id) if e.label == "group-load"]
    info = probe_mp4(out / job.id / "video.mp4")
    print("load:", loads, "| video:", info)
    assert job.state is JobState.DONE and (info.frames, info.width, info.height) == (9, 64, 64)
    assert "loaded on 2 rank(s)" in loads[0] and "backend gloo" in loads[0]
    # The start-up lines of the run log: the group placed once its 2 processes joined, rank 0's
    # process (the actor imported the worker itself), the load's steps.
    log = (out / "run.log").read_text()
    stamp = r"[+-]\d+\.\d\d s"
    assert re.search(rf"start-up: group g\d+x2 \(2 GPUs\) placed at {stamp}, its processes joined", log), log
    up = re.search(rf"worker process \(rank 0\) up at {stamp} \(started(?: before the group was placed,)? at {stamp}; "
                   r"importing the worker (\d+\.\d\d) s\)", log)
    assert up and float(up.group(1)) > 0, log
    assert re.search(r"loaded tiny at .*: imports \d+\.\d s, DiT \d+\.\d s, VAE", log), log


def test_worker_killed_mid_sampling_is_retried_on_a_new_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_pipeline: None) -> None:
    marker = tmp_path / "crashed.marker"
    monkeypatch.setenv("PAN2_RENDER_FAULTS", json.dumps(
        {"crash": {"job": "victim", "step": 2, "marker": str(marker)}}))
    batch = write_batch(tmp_path / "b.yaml", [{"name": n, "prompt": n} for n in ("first", "victim", "last")],
                        defaults={"steps": 4})
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == 0
    led = Ledger.open_readonly(out)
    jobs = {j.name: j for j in led.jobs()}
    victim = jobs["victim"]
    died = [e.detail for e in led.events(victim.id) if e.label == "group-died"]
    groups = [e.detail.split()[2] for e in led.events(victim.id) if e.label == "pending->running"]
    print("marker:", marker.read_text().strip(), "| died:", died, "| victim ran on groups:", groups)
    assert marker.exists() and all(j.state is JobState.DONE for j in jobs.values())
    assert victim.attempts == 2 and len(died) == 1 and groups[0] != groups[1]
    assert "ActorDiedError" in died[0] or "RayActorError" in died[0]
    assert jobs["first"].attempts == 1 and jobs["last"].attempts == 1


def test_always_failing_job_fails_the_batch_with_exit_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_pipeline: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PAN2_RENDER_FAULTS", json.dumps({"fail": {"job": "doomed", "stage": "sampling"}}))
    batch = write_batch(tmp_path / "b.yaml", [{"name": n, "prompt": n} for n in ("ok1", "doomed", "ok2")],
                        defaults={"steps": 2})
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == 1
    capsys.readouterr()
    assert cli.main(["status", str(out), "--json"]) == 1
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["jobs"]}
    print(json.dumps(rows["doomed"], indent=1))
    assert rows["doomed"]["state"] == "failed" and rows["doomed"]["stage"] == "sampling"
    # The same error twice in a row on one stage stops retrying (the budget would allow a third).
    assert rows["doomed"]["attempts"] == 2 and "injected failure in sampling" in rows["doomed"]["error"]
    assert "twice in a row" in rows["doomed"]["error"]
    assert rows["doomed"]["video"] is None
    for n in ("ok1", "ok2"):
        assert rows[n]["state"] == "done" and os.path.isfile(rows[n]["video"])


def test_a_group_the_cluster_cannot_place_fails_its_job_and_the_rest_render(
        tmp_path: Path, fake_pipeline: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another application holds one of the 2 GPUs: the 2-GPU job's placement group is never
    granted, and says so while it waits (every second here); after --group-start-timeout it is
    charged (no retries here) with a message saying so, and the 1-GPU jobs before and after it
    render."""
    import ray

    from pan2render.runner.cluster import ray_executor

    monkeypatch.setattr(ray_executor, "WAIT_NOTE_EVERY_S", 1.0)

    @ray.remote(num_gpus=1, num_cpus=0)
    class Holder:
        def ping(self) -> int:
            return 1

    holder = Holder.remote()
    ray.get(holder.ping.remote())
    batch = write_batch(tmp_path / "b.yaml", [{"name": "before", "prompt": "a"},
                                              {"name": "pair", "prompt": "b", "gpus": 2},
                                              {"name": "after", "prompt": "c"}], defaults={"steps": 2})
    out = tmp_path / "out"
    try:
        rc = cli.main(["run", str(batch), "--out", str(out), "--no-progress", "--retries", "0",
                       "--group-start-timeout", "3"])
    finally:
        ray.kill(holder)
    jobs = {j.name: j for j in Ledger.open_readonly(out).jobs()}
    print({n: (j.state.value, j.attempts, j.error) for n, j in jobs.items()})
    assert rc == 1
    assert jobs["before"].state is JobState.DONE and jobs["after"].state is JobState.DONE
    pair = jobs["pair"]
    assert pair.state is JobState.FAILED and pair.attempts == 1
    assert "placement group of 2 GPUs on one node was not ready after 3 s" in pair.error
    assert "free now" in pair.error and "--group-start-timeout" in pair.error
    log = (out / "run.log").read_text()
    assert "waiting for 2 GPU(s) on one node: the cluster has " in log and " free of 2 " in log


def test_a_hung_worker_is_torn_down_after_the_stall_timeout_and_its_job_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_pipeline: None) -> None:
    """A worker that stops answering mid-sampling without dying (a wedged kernel, a collective
    that never completes) is what no Ray error reports: the watchdog sees its steps stop, tears
    the group down and retries the job, charged. A sampling slower in all than the timeout, but
    whose steps keep coming, is left alone (the negative control)."""
    marker = tmp_path / "hung.marker"
    monkeypatch.setenv("PAN2_RENDER_FAULTS", json.dumps({"hang": {"job": "stuck", "step": 2, "marker": str(marker)}}))
    monkeypatch.setenv("PAN2_FAKE_STEP_SECONDS", "0.6")
    batch = write_batch(tmp_path / "b.yaml", [{"name": n, "prompt": n} for n in ("stuck", "steady")],
                        defaults={"steps": 10})  # 10 x 0.6 s: each sampling lasts longer than the timeout
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress", "--stall-timeout", "4"]) == 0
    led = Ledger.open_readonly(out)
    jobs = {j.name: j for j in led.jobs()}
    died = [e.detail for e in led.events(jobs["stuck"].id) if e.label == "group-died"]
    print("marker:", marker.read_text().strip(), "| died:", died,
          "| attempts:", {n: j.attempts for n, j in jobs.items()})
    assert all(j.state is JobState.DONE for j in jobs.values())
    assert jobs["stuck"].attempts == 2 and len(died) == 1
    assert "is hung" in died[0] and "last step 2/10" in died[0] and "4 s stall timeout" in died[0]
    assert jobs["steady"].attempts == 1 and not [e for e in led.events(jobs["steady"].id) if e.label == "group-died"]


def test_stall_timeout_must_not_be_negative(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "a"}])
    assert cli.main(["run", str(batch), "--out", str(tmp_path / "out"), "--stall-timeout", "-1"]) == 2
    assert "--stall-timeout -1.0: must be >= 0 seconds" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
