"""Every action the farm answers holds through a SIGKILL of the farm right after its answer: a
pause, a priority, a retry, a submit, a cancel of a queued batch, a video created, and (on Ray,
where a sampling runs beside the farm's loop) a cancel of a running job and of a running batch:
the cancelled jobs end cancelled when the farm starts again, nothing of them renders, the batch's
ledger says so, and `resume` of its folder renders nothing either unless asked."""

from __future__ import annotations

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
from typing import Any

import pytest
import yaml
from runner_helpers import stop_farm, until

from pan2render.client import FarmClient, find_farm
from pan2render.jobs.ledger import JobState, Ledger
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    ray_tmp = tempfile.mkdtemp(prefix="p2a", dir="/tmp")  # short: Ray's socket paths are limited
    (tmp_path / "home").mkdir()
    e = {**os.environ, "RAY_TMPDIR": ray_tmp, "HOME": str(tmp_path / "home"), "RAY_USAGE_STATS_ENABLED": "0",
         "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "PAN2_RENDER_FARM": str(tmp_path / "farm"),
         "PAN2_RENDER_CACHE": str(tmp_path / "cache"), "PAN2_RENDER_PIPELINE": FAKE_FACTORY,
         "PAN2_RENDER_EXECUTOR": "local"}
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE"):
        e.pop(name, None)
    try:
        yield e
    finally:
        stop_farm(e, ray_tmp, tmp_path)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def start(env: dict[str, str], tmp_path: Path, gpus: int = 1) -> FarmClient:
    done = subprocess.run([*CLI, "farm", "start", "--cpu-gpus", str(gpus), "--inputs-root", str(tmp_path),
                           "--outputs-root", str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    print(done.stdout, done.stderr[-2000:])
    assert done.returncode == 0
    client = find_farm(Path(env["PAN2_RENDER_FARM"]))
    assert client is not None
    return client


def kill(env: dict[str, str]) -> None:
    root = Path(env["PAN2_RENDER_FARM"])
    pid = int(json.loads((root / "farm.json").read_text())["pid"])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def batch(tmp_path: Path, name: str, jobs: list[str], **defaults: Any) -> str:
    return yaml.safe_dump({"model": "tiny", "preset": "tiny-preview", "defaults": {"steps": 2, **defaults},
                           "jobs": [{"name": j, "prompt": j} for j in jobs]})



def states(out: Path) -> dict[str, JobState]:
    led = Ledger.open_readonly(out)
    try:
        return {j.name: j.state for j in led.jobs()}
    finally:
        led.close()


def test_each_answered_action_holds_through_a_kill(tmp_path: Path, env: dict[str, str]) -> None:
    farm = start(env, tmp_path)
    # A paused batch holds its jobs back: the actions on it run on an idle farm.
    b = farm.submit_text(batch(tmp_path, "b", ["one", "two"]), out=tmp_path / "b", base=tmp_path)
    farm.pause(b["id"])
    farm.set_priority(b["id"], 7)  # answered ...
    kill(env)  # ... and killed at once
    farm = start(env, tmp_path)
    again = farm.batch(b["id"])
    assert (again["state"], again["priority"]) == ("paused", 7)
    assert farm.unpause(b["id"])["state"] == "active"
    kill(env)
    farm = start(env, tmp_path)
    until(lambda: farm.batch(b["id"])["state"] == "done", "the unpaused batch to render", timeout_s=120)

    c = farm.submit_text(batch(tmp_path, "c", ["x"]), out=tmp_path / "c", base=tmp_path)  # a submit answered
    kill(env)
    farm = start(env, tmp_path)
    until(lambda: farm.batch(c["id"])["state"] == "done", "the submitted batch to render", timeout_s=120)

    d = farm.submit_text(batch(tmp_path, "d", ["p", "q"]), out=tmp_path / "d", base=tmp_path)
    farm.pause(d["id"])
    assert farm.cancel(d["id"])["state"] in ("cancelling", "cancelled")
    kill(env)
    farm = start(env, tmp_path)
    until(lambda: farm.batch(d["id"])["state"] == "cancelled", "the cancelled batch to end", timeout_s=120)
    assert set(states(tmp_path / "d").values()) == {JobState.CANCELLED}
    resume = subprocess.run([*CLI, "resume", str(tmp_path / "d"), "--cpu-gpus", "1"], env=env, capture_output=True,
                            text=True, timeout=240)
    assert resume.returncode == 0 and set(states(tmp_path / "d").values()) == {JobState.CANCELLED}  # nothing renders
    assert not list((tmp_path / "d").glob("*/video.mp4"))

    assert farm.retry(d["id"])["state"] == "active"  # retried, answered, killed
    kill(env)
    farm = start(env, tmp_path)
    until(lambda: farm.batch(d["id"])["state"] == "done", "the retried batch to render", timeout_s=120)
    assert len(list((tmp_path / "d").glob("*/video.mp4"))) == 2


def test_a_video_created_survives_a_kill_and_renders_once(tmp_path: Path, env: dict[str, str]) -> None:
    farm = start(env, tmp_path)
    video = farm.post("/v1/videos", {"prompt": "a fox", "model": "tiny", "size": "64x64"})
    kill(env)
    farm = start(env, tmp_path)
    assert farm.video(video["id"])["id"] == video["id"]
    done = until(lambda: (v := farm.video(video["id"]))["status"] in ("completed", "failed") and v, "the video",
                 timeout_s=120)
    assert done["status"] == "completed" and done["progress"] == 100
    folder = next((tmp_path / "farm" / "videos" / "admin").glob(f"{video['id']}"))
    assert len(list(folder.glob("*/video.mp4"))) == 1
    led = Ledger.open_readonly(folder)
    try:
        (job,) = led.jobs()
        starts = [e for e in led.events() if e.started]
    finally:
        led.close()
    assert job.state is JobState.DONE and len(starts) <= 2  # started at most again after the kill, done once
    assert farm.download(video["id"], tmp_path / "fox.mp4").stat().st_size > 0


def test_a_cancel_of_running_jobs_holds_through_a_kill(tmp_path: Path, env: dict[str, str]) -> None:
    """On Ray, where the farm's loop answers while its groups sample."""
    env = {k: v for k, v in env.items() if k != "PAN2_RENDER_EXECUTOR"} | {"PAN2_FAKE_STEP_SECONDS": "0.3"}
    farm = start(env, tmp_path, gpus=2)
    b = farm.submit_text(batch(tmp_path, "b", ["one", "two"], steps=40), out=tmp_path / "b", base=tmp_path)
    c = farm.submit_text(batch(tmp_path, "c", ["three"], steps=40), out=tmp_path / "c", base=tmp_path)
    until(lambda: len(farm.batch(b["id"])["running"]) == 2, "both of b's jobs to sample", timeout_s=120)
    farm.cancel(b["id"], job="one")  # answered ...
    kill(env)  # ... killed before its sampling's next step boundary could be recorded
    assert states(tmp_path / "b")["one"] is JobState.RUNNING  # what the ledger holds at the kill
    farm = start(env, tmp_path, gpus=2)
    until(lambda: farm.batch(c["id"])["running"], "batch c to run", timeout_s=120)
    assert states(tmp_path / "b")["one"] is JobState.CANCELLED
    farm.cancel(c["id"])  # a running batch, cancelled, answered, killed
    kill(env)
    farm = start(env, tmp_path, gpus=2)
    until(lambda: farm.batch(c["id"])["state"] == "cancelled", "batch c to end cancelled", timeout_s=120)
    until(lambda: farm.batch(b["id"])["exit_code"] is not None, "batch b to end", timeout_s=120)
    assert states(tmp_path / "b") == {"one": JobState.CANCELLED, "two": JobState.DONE}
    assert states(tmp_path / "c") == {"three": JobState.CANCELLED}
    for out, name in ((tmp_path / "b", "one"), (tmp_path / "c", "three")):
        led = Ledger.open_readonly(out)
        try:
            job = next(j for j in led.jobs() if j.name == name)
        finally:
            led.close()
        assert not (out / job.id / "video.mp4").exists() and not (out / job.id / "latents.safetensors").exists()
