"""Step checkpoints through `pan2-render run` on the tiny model (Ray, logical GPUs): a sampling whose
worker is killed, or whose driver is SIGKILLed, continues from its newest step checkpoint and ends
with latents bit-equal to an uninterrupted run's, for UniPC, Euler and DMD, on one process and in a
group of 2. The checkpoint's file is written whole or not at all, and gone once the sampling ends."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.ledger import JobState, Ledger

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]
# Small enough to be quick on 2 cores, with steps enough to stop in the middle of.
JOB = {"height": 32, "width": 64, "frames": 5, "steps": 10, "checkpoint_every": 0.001}
SAMPLERS = {"unipc": {"sampler": "unipc"}, "euler": {"sampler": "euler"},
            "dmd": {"sampler": "dmd", "guidance": 1.0, "steps": 6, "timesteps": [1000, 900, 757, 600, 522, 300]}}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PAN2_RENDER_PIPELINE", "PAN2_RENDER_FAULTS")}
    return {**env, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0", **extra}


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*CLI, *args, "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    print(f"$ pan2-render {' '.join(args)} -> {done.returncode}\n{done.stderr[-2500:]}")
    return done


def _latents(out: Path) -> dict[str, bytes]:
    led = Ledger.open_readonly(out)
    try:
        jobs = led.jobs()
        assert all(j.state is JobState.DONE for j in jobs), {j.name: j.state for j in jobs}
        return {j.name: (out / j.id / "latents.safetensors").read_bytes() for j in jobs}
    finally:
        led.close()


def _tensor_bytes(data: bytes) -> bytes:
    """The latents tensor's bytes of a latents file (its metadata holds no run's own values, but
    compare the data alone: that is what must be bit-equal)."""
    from safetensors.numpy import load

    return load(data)["latents"].tobytes()


def _resumed_at(out: Path) -> list[int]:
    return [int(m) for m in re.findall(r"from the step checkpoint at step (\d+)/", (out / "run.log").read_text())]


@pytest.mark.parametrize(("sampler", "gpus"), [("unipc", 1), ("euler", 1), ("dmd", 1), ("unipc", 2)])
def test_a_sampling_whose_worker_dies_continues_from_its_step_checkpoint_bit_equal(
        tmp_path: Path, sampler: str, gpus: int) -> None:
    defaults = {**JOB, **SAMPLERS[sampler], "gpus": gpus}
    batch = write_batch(tmp_path / "b.yaml", [{"name": "long", "prompt": "a lighthouse at dusk"}], defaults=defaults)
    whole = _run(["run", str(batch), "--out", str(tmp_path / "whole"), "--cpu-gpus", str(gpus)], _env())
    assert whole.returncode == 0
    marker = tmp_path / "crashed"
    crash_at = defaults["steps"] - 1
    out = tmp_path / "interrupted"
    # The worker dies once the driver holds a step checkpoint (on a loaded machine the whole
    # sampling can end before the first one is fetched).
    faults = {"crash": {"job": "long", "step": crash_at, "marker": str(marker),
                        "after": str(out / "*" / "sampling.ckpt.safetensors")}}
    cut = _run(["run", str(batch), "--out", str(out), "--cpu-gpus", str(gpus)],
               _env(PAN2_RENDER_FAULTS=json.dumps(faults)))
    assert cut.returncode == 0 and marker.exists()  # the worker died at step crash_at, the retry finished
    resumed = _resumed_at(out)
    print("resumed at:", resumed)
    assert resumed and 1 <= resumed[0] < crash_at  # from a checkpoint the driver had, not from step 0
    assert _tensor_bytes(_latents(out)["long"]) == _tensor_bytes(_latents(tmp_path / "whole")["long"])
    assert not list(out.glob("*/sampling.ckpt.safetensors*"))  # the sampling ended: its checkpoint is gone
    assert not list(out.glob("*/.sampling.ckpt.safetensors.tmp-*"))  # never a half-written one left


def test_a_sigkilled_driver_resumes_the_sampling_from_its_step_checkpoint_bit_equal(tmp_path: Path) -> None:
    defaults = {**JOB, "steps": 60}  # a sampling long enough to be killed in the middle of
    batch = write_batch(tmp_path / "b.yaml", [{"name": "long", "prompt": "a lighthouse at dusk"}], defaults=defaults)
    assert _run(["run", str(batch), "--out", str(tmp_path / "whole"), "--cpu-gpus", "1"], _env()).returncode == 0
    out = tmp_path / "killed"
    run = subprocess.Popen([*CLI, "run", str(batch), "--out", str(out), "--cpu-gpus", "1", "--no-progress"],
                           env=_env(), start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        ckpt = None
        while ckpt is None:
            assert run.poll() is None and time.monotonic() < deadline, "no step checkpoint before the end"
            found = [p for p in out.glob("*/sampling.ckpt.safetensors")]
            ckpt = found[0] if found else None
            time.sleep(0.02)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the driver and every Ray process it started
        run.wait(timeout=30)
    led = Ledger.open_readonly(out)
    assert [j.state for j in led.jobs()] == [JobState.RUNNING]  # killed mid-sampling, as meant
    led.close()
    done = _run(["resume", str(out), "--cpu-gpus", "1"], _env())
    assert done.returncode == 0
    resumed = _resumed_at(out)
    assert resumed and resumed[0] >= 1
    assert _tensor_bytes(_latents(out)["long"]) == _tensor_bytes(_latents(tmp_path / "whole")["long"])
