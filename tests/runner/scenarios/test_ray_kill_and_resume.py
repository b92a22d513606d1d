"""``pan2-render`` as a user runs it, in subprocesses that start their own local Ray cluster:
SIGKILL the driver mid-batch then ``resume``; a second run on a held folder; runner overhead.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0", **extra})
    return env


def _done_ids(out: Path) -> set[str]:
    try:
        led = Ledger.open_readonly(out)
    except FileNotFoundError:
        return set()
    try:
        return {j.id for j in led.jobs() if j.state is JobState.DONE}
    except sqlite3.OperationalError:  # the writer holds the journal this instant
        return set()
    finally:
        led.close()


def _fingerprint(path: Path) -> tuple[int, int, str]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


def _kill_session(proc: subprocess.Popen) -> None:
    """Clean-up: everything the run started shares its session (start_new_session=True)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_sigkill_driver_then_resume_finishes_without_rerendering(tmp_path: Path) -> None:
    # ~5 s of sampling per job: with the encode off the GPU's path nothing else slows a job down,
    # and the refused second run below needs several seconds to start on a busy 2-core machine;
    # 8 jobs leave ~30 s of work after the first two, so the kill lands mid-batch.
    batch = write_batch(tmp_path / "b.yaml", [{"name": f"j{i}", "prompt": f"clip {i}"} for i in range(8)],
                        defaults={"steps": 16})
    out = tmp_path / "out"
    env = _env(PAN2_RENDER_PIPELINE=FAKE_FACTORY,
               PAN2_FAKE_STEP_SECONDS="0.3")
    run = subprocess.Popen([*CLI, "run", str(batch), "--out", str(out), "--cpu-gpus", "1", "--no-progress"],
                           env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_done_ids(out)) < 2:
            assert run.poll() is None, f"run ended early: {run.stderr.read() if run.stderr else ''}"
            assert time.monotonic() < deadline, "no 2 jobs done within 120 s"
            time.sleep(0.1)
        # A second run on the folder while the first holds it: refused, exit 2, names the holder.
        second = subprocess.run([*CLI, "resume", str(out)], env=env, capture_output=True, text=True,
                                timeout=60)
        print("second run:", second.returncode, second.stderr.strip())
        assert second.returncode == 2 and f"pid {run.pid}" in second.stderr

        done_before = _done_ids(out)
        led = Ledger.open_readonly(out)
        before = {j: (led.job(j).attempts, _fingerprint(out / j / "video.mp4")) for j in done_before}
        led.close()
        os.kill(run.pid, signal.SIGKILL)  # the driver only; Ray's processes die with it
        run.wait(timeout=30)
    finally:
        time.sleep(1.0)
        _kill_session(run)  # stragglers (Ray's agents outlive a SIGKILLed driver)
    led = Ledger.open_readonly(out)
    states = {j.name: j.state.value for j in led.jobs()}
    led.close()
    print(f"killed with {len(done_before)} done: {states}")
    assert len(done_before) < 8

    resume = subprocess.Popen([*CLI, "resume", str(out), "--cpu-gpus", "1", "--no-progress"], env=env,
                              start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        _, err = resume.communicate(timeout=180)
    finally:
        _kill_session(resume)
    print(err[-600:])
    assert resume.returncode == 0, err
    led = Ledger.open_readonly(out)
    jobs = led.jobs()
    print("after resume:", {j.name: (j.state.value, j.attempts) for j in jobs})
    assert all(j.state is JobState.DONE for j in jobs) and len(jobs) == 8
    for jid, (attempts, fp) in before.items():
        assert led.job(jid).attempts == attempts and _fingerprint(out / jid / "video.mp4") == fp
    interrupted = [e.detail for e in led.events() if e.label == "running->pending"]
    print("interrupted:", interrupted)
    assert interrupted and "previous driver stopped" in interrupted[0]


def test_runner_overhead_against_a_plain_pipeline_loop(tmp_path: Path) -> None:
    """10 tiny jobs through `pan2-render run` (1 logical GPU) vs the same 10 through PAN2Pipeline in
    a loop (load once, encode both prompts, sample, decode, write the mp4). No threshold."""
    jobs = [{"name": f"o{i}", "prompt": f"overhead clip {i}", "seed": i} for i in range(10)]
    defaults = {"frames": 9, "steps": 4}
    batch = write_batch(tmp_path / "b.yaml", jobs, defaults=defaults)
    out = tmp_path / "out"
    t0 = time.perf_counter()
    proc = subprocess.run([*CLI, "run", str(batch), "--out", str(out), "--cpu-gpus", "1", "--no-progress"],
                          env=_env(), capture_output=True, text=True, timeout=400, start_new_session=True)
    runner_wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    driver_s = float(re.search(r"10 done, 0 failed in ([\d.]+) s", proc.stderr).group(1))

    from pan2render.jobs.batch import load_batch
    from pan2render.media.video import encode_mp4
    from pan2render.models import PAN2Pipeline, PAN2PipelineConfig

    specs = load_batch(batch).jobs
    torch_threads = os.cpu_count() or 1  # the runner's worker gets cpus // gpus threads, as here
    import torch

    torch.set_num_threads(torch_threads)
    t0 = time.perf_counter()
    pipe = PAN2Pipeline.from_pretrained("tiny", config=PAN2PipelineConfig(device="cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        for s in specs:
            lat = pipe.sample(prompt_embeds=pipe.encode_prompt(s.prompt),
                              negative_prompt_embeds=pipe.encode_prompt(s.negative_prompt), image=None,
                              height=s.height, width=s.width, frames=s.frames, steps=s.steps,
                              guidance=s.guidance, seed=s.seed, flow_shift=s.flow_shift, sampler=s.sampler)
            encode_mp4(pipe.decode(lat), Path(tmp) / f"{s.name}.mp4", fps=s.fps, crf=s.crf)
    loop_s = time.perf_counter() - t0
    print(f"\n10 tiny jobs ({specs[0].width}x{specs[0].height}x{specs[0].frames}, {specs[0].steps} steps):"
          f"\n  plain PAN2Pipeline loop          {loop_s:6.1f} s  ({loop_s / 10:.2f} s/job)"
          f"\n  runner, driver loop (ray up)     {driver_s:6.1f} s  -> overhead "
          f"{(driver_s - loop_s) / 10:+.2f} s/job"
          f"\n  runner, whole command (ray start/stop, imports) {runner_wall:6.1f} s  -> overhead "
          f"{(runner_wall - loop_s) / 10:+.2f} s/job")
    assert len(_done_ids(out)) == 10


def test_address_joins_an_existing_cluster(tmp_path: Path) -> None:
    """A head started elsewhere (here: a subprocess); `run --address` renders on it and leaves it up.
    Token auth off on both sides: the cluster is this test's own."""
    env = _env(RAY_AUTH_MODE="disabled", PAN2_RENDER_PIPELINE=FAKE_FACTORY)
    head_src = ("import ray, sys, time\n"
                "ray.init(num_cpus=1, num_gpus=1, include_dashboard=False, object_store_memory=128 << 20)\n"
                "print(ray.get_runtime_context().gcs_address, flush=True)\n"
                "time.sleep(300)\n")
    head = subprocess.Popen([sys.executable, "-c", head_src], env=env, stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert head.stdout is not None
        address = head.stdout.readline().strip()
        batch = write_batch(tmp_path / "b.yaml", [{"name": "remote", "prompt": "x"}], defaults={"steps": 2})
        run = subprocess.run([*CLI, "run", str(batch), "--out", str(tmp_path / "out"), "--address", address,
                              "--no-progress"], env=env, capture_output=True, text=True, timeout=120)
        print("address", address, "->", run.returncode, run.stderr.strip().splitlines()[-1])
        assert run.returncode == 0 and head.poll() is None  # the cluster outlives the driver
        assert f"joined the Ray cluster at {address}: a Ray cluster you started" in run.stderr
        bad = subprocess.run([*CLI, "run", str(batch), "--out", str(tmp_path / "out2"), "--address",
                              "127.0.0.1:1"], env=env, capture_output=True, text=True, timeout=60)
        print("bad address ->", bad.returncode, bad.stderr.strip().splitlines()[-1][:160])
        assert bad.returncode == 2 and "could not join the Ray cluster at '127.0.0.1:1'" in bad.stderr
    finally:
        _kill_session(head)
