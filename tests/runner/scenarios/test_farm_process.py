"""The farm as users run it: `farm start` in the background on a Ray cluster of its own (logical
GPUs), `submit`, `queue`, `cancel` of a job mid-sampling, a SIGKILL of the farm then `farm start`
again (every batch finished, nothing done redone), a higher-priority batch preempting a sampling
(which then continues from its step checkpoint), and `run` handing its batch to the farm with
the exit code and job lines of a standalone `run`.

The farm lives in a folder of the test's own, its Ray in a temp folder of its own with a HOME of its
own (Ray's token): nothing else on the machine sees it, and the test ends only what it started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import stop_farm, write_batch

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def farm_env(tmp_path: Path):
    ray_tmp = tempfile.mkdtemp(prefix="p2f", dir="/tmp")  # short: Ray's socket paths are limited
    home = tmp_path / "home"
    home.mkdir()
    root = tmp_path / "farm"
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "PAN2_RENDER_FARM": str(root),
           "PAN2_RENDER_PIPELINE": FAKE_FACTORY, "PAN2_FAKE_STEP_SECONDS": "0.25",
           "PAN2_RENDER_FAULTS": json.dumps({"fail": {"job": "broken", "stage": "sampling", "raise": "JobInputError"}})}
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE"):
        env.pop(name, None)
    try:
        yield env
    finally:
        stop_farm(env, ray_tmp, root)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _cli(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)
    print(f"$ pan2-render {' '.join(args)} -> {done.returncode}\n{done.stdout}{done.stderr[-3000:]}")
    return done


def _queue(env: dict[str, str]) -> list[dict[str, Any]]:
    done = _cli(env, "queue", "--all", "--json")
    assert done.returncode == 0
    return json.loads(done.stdout)


def _wait(env: dict[str, str], what: Any, *, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batches = _queue(env)
        if what(batches):
            return batches
        time.sleep(0.5)
    raise AssertionError("the farm did not get there in time")


def _jobs(out: Path) -> dict[str, Any]:
    led = Ledger.open_readonly(out)
    try:
        return {j.name: j for j in led.jobs()}
    finally:
        led.close()


def _roots(tmp_path: Path) -> list[str]:
    """The farm reads the repository's batches and the test's, and writes into the test's folder."""
    return ["--inputs-root", str(REPO), "--inputs-root", str(tmp_path), "--outputs-root", str(tmp_path)]


def _farm_pid(env: dict[str, str]) -> int:
    return int(json.loads((Path(env["PAN2_RENDER_FARM"]) / "farm.json").read_text())["pid"])


def test_a_farm_serves_batches_survives_a_kill_and_takes_runs(tmp_path: Path, farm_env: dict[str, str]) -> None:
    env = farm_env
    assert _cli(env, "farm", "start", "--cpu-gpus", "2", *_roots(tmp_path)).returncode == 0
    assert "already runs" in _cli(env, "farm", "start", "--cpu-gpus", "2", *_roots(tmp_path)).stdout
    assert "the local Ray cluster this farm started" in _cli(env, "farm", "status").stdout  # not "this run"

    # The README's sweep, on the tiny model: submit validates here, queues, and returns before any
    # job has rendered.
    sweep = _cli(env, "submit", str(REPO / "jobs" / "sweep.yaml"), "--out", str(tmp_path / "sweep"), "--set",
                 "model=tiny", "--set", "preset=tiny-preview", "--sweep", "guidance=2.5,3.5", "--sweep",
                 "flow_shift=5.0")
    assert sweep.returncode == 0 and "queued batch b1: 6 job(s)" in sweep.stdout
    first = _queue(env)[0]
    assert first["id"] == "b1" and first["counts"]["done"] < 6 and first["owner"] == "admin"  # the farm's token
    bad = _cli(env, "submit", str(REPO / "jobs" / "sweep.yaml"), "--out", str(tmp_path / "bad"), "--set", "steps=0")
    assert bad.returncode == 2 and "steps" in bad.stderr and len(_queue(env)) == 1  # refused by the farm, not queued

    # A kill of the farm once some jobs are done, then a start again: every job ends done, and what
    # was done before the kill is not redone.
    _wait(env, lambda bs: bs[0]["counts"].get("done", 0) >= 2)
    os.kill(_farm_pid(env), signal.SIGKILL)
    time.sleep(1.0)
    assert _cli(env, "queue").returncode == 3  # no farm answers
    out = tmp_path / "sweep"
    if any(j.state is JobState.RUNNING for j in _jobs(out).values()):  # (killed between two jobs: none)
        killed = _cli(env, "status", str(out)).stdout  # its way to go on is the farm's, not `resume`
        assert "interrupted (the farm serving the batch stopped" in killed and "`pan2-render farm start`" in killed
    done_before = {name: (out / j.id / "video.mp4").stat().st_mtime_ns
                   for name, j in _jobs(out).items() if j.state is JobState.DONE}
    assert _cli(env, "farm", "start", "--cpu-gpus", "2", *_roots(tmp_path)).returncode == 0
    batches = _wait(env, lambda bs: bs[0]["state"] == "done")
    jobs = _jobs(out)
    assert batches[0]["counts"]["done"] == 6 and all(j.state is JobState.DONE for j in jobs.values())
    assert {n: (out / jobs[n].id / "video.mp4").stat().st_mtime_ns for n in done_before} == done_before
    assert all(j.attempts == 1 for n, j in jobs.items() if n in done_before)
    assert "continuing batch b1" in (out / "run.log").read_text()

    # `run` with the farm up: handed to it and followed, with a standalone run's exit code and job
    # lines (a job that fails by its input fails either way).
    batch = write_batch(tmp_path / "b.yaml", [{"name": "fine", "prompt": "a fox"}, {"name": "broken", "prompt": "x"}],
                        defaults={"steps": 2})
    via_farm = _cli(env, "run", str(batch), "--out", str(tmp_path / "via-farm"))
    alone = _cli(env, "run", str(batch), "--out", str(tmp_path / "alone"), "--no-farm", "--cpu-gpus", "1")
    assert "run: a farm runs at" in via_farm.stderr and "farm runs" not in alone.stderr
    assert via_farm.returncode == alone.returncode == 1

    def job_lines(text: str) -> list[str]:
        return sorted(re.sub(r"\s+\(.*", "", ln) for ln in text.splitlines() if re.match(r"(done|FAILED) ", ln))

    assert job_lines(via_farm.stderr) == job_lines(alone.stderr) != []

    # A job cancelled while it samples stops at a step boundary, with nothing recorded for it
    # but where it stopped; the others finish.
    slow = write_batch(tmp_path / "slow.yaml", [{"name": n, "prompt": n} for n in ("one", "two")],
                       defaults={"steps": 30})
    assert _cli(env, "submit", str(slow), "--out", str(tmp_path / "slow")).returncode == 0
    slow_id = _queue(env)[-1]["id"]
    _wait(env, lambda bs: len(bs[-1]["running"]) == 2)
    time.sleep(1.0)
    assert _cli(env, "cancel", slow_id, "one").returncode == 0
    _wait(env, lambda bs: bs[-1]["exit_code"] is not None)
    jobs = _jobs(tmp_path / "slow")
    assert jobs["one"].state is JobState.CANCELLED and jobs["two"].state is JobState.DONE
    assert not (tmp_path / "slow" / jobs["one"].id / "latents.safetensors").exists()
    assert re.search(r"sampling stopped at step \d+", _cli(env, "show", str(tmp_path / "slow"), "one").stdout)

    _preemption(tmp_path, env)

    assert _cli(env, "farm", "stop").returncode == 0
    assert "no farm runs" in _cli(env, "farm", "status").stdout


def _latents(out: Path) -> dict[str, bytes]:
    from safetensors.numpy import load

    return {name: load((out / j.id / "latents.safetensors").read_bytes())["latents"].tobytes()
            for name, j in _jobs(out).items()}


def _preemption(tmp_path: Path, env: dict[str, str]) -> None:
    """Both groups sample a low-priority batch; a batch submitted with --preempt at a higher
    priority stops one of those samplings at a step boundary (checkpointed), runs on its group,
    and the stopped job then continues from its checkpoint to the latents of a sampling never
    stopped (the same batch in another folder)."""
    low = write_batch(tmp_path / "low.yaml", [{"name": n, "prompt": n} for n in ("l1", "l2")],
                      defaults={"steps": 30, "checkpoint_every": 0.001})
    urgent = write_batch(tmp_path / "urgent.yaml", [{"name": "urgent", "prompt": "now"}], defaults={"steps": 2})
    assert _cli(env, "submit", str(low), "--out", str(tmp_path / "low")).returncode == 0
    _wait(env, lambda bs: len(bs[-1]["running"]) == 2)
    time.sleep(1.5)  # a few steps into both samplings
    submitted = time.time()
    assert _cli(env, "submit", str(urgent), "--out", str(tmp_path / "urgent"), "--priority", "5", "--preempt",
                "--wait").returncode == 0
    _wait(env, lambda bs: bs[-2]["exit_code"] is not None)
    assert _cli(env, "submit", str(low), "--out", str(tmp_path / "low-ref"), "--wait").returncode == 0

    led = Ledger.open_readonly(tmp_path / "low")
    try:
        names = {j.id: j.name for j in led.jobs()}
        stops = [(names[e.job_id], e) for e in led.events() if e.job_id and "preempted at step" in e.detail]
        done_at = {names[e.job_id]: e.at for e in led.events() if e.label == "running->done"}
    finally:
        led.close()
    print("preempted:", [(n, e.detail) for n, e in stops])
    assert len(stops) == 1  # one sampling made room, the other went on
    victim, stop = stops[0]
    step = int(re.search(r"preempted at step (\d+)", stop.detail).group(1))
    assert 1 <= step < 30 and submitted < stop.at
    led = Ledger.open_readonly(tmp_path / "urgent")
    try:
        urgent_done = next(e.at for e in led.events() if e.label == "running->done")
    finally:
        led.close()
    assert stop.at < urgent_done < done_at[victim]  # the urgent job ran in the gap the stop made
    assert f"from the step checkpoint at step {step}/30" in (tmp_path / "low" / "run.log").read_text()
    assert _latents(tmp_path / "low") == _latents(tmp_path / "low-ref")
    assert not list((tmp_path / "low").glob("*/sampling.ckpt.safetensors*"))
