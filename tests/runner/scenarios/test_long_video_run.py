"""Long videos through `pan2-render run` on the tiny model: a story of 3 segments of 17 frames is one
mp4 of 3 x 17 - 2 frames, each join shown once; SIGKILLed in its second segment (Ray, a logical
GPU) and resumed, it redoes nothing of the first and its video equals an uninterrupted run's bit for
bit. Interpolation (RIFE's IFNet, random weights) doubles the rate: 2n - 1 frames, and with 3
segments (3 x 17 - 2 - 1) x 2 + 1."""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import pytest
from runner_helpers import write_batch

from pan2render.jobs.ledger import EventKind, JobState, Ledger
from pan2render.runner.cli import main as cli

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]
REPO = Path(__file__).resolve().parents[3]
# 17 frames a segment (the tiny preset's), small and few steps: quick on 2 cores.
JOB = {"height": 32, "width": 32, "steps": 4, "preview_every": 0}
STORY = {"name": "story", "prompts": ["a lighthouse at dawn", "a storm rolls in", "the storm clears at dusk"]}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAN2_RENDER_PIPELINE", "PAN2_RENDER_FAULTS", "PAN2_RENDER_EXECUTOR")}
    return {**env, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0", **extra}


def _run(args: list[str], env: dict[str, str]) -> None:
    done = subprocess.run([*CLI, *args, "--cpu-gpus", "1", "--no-progress"], env=env, capture_output=True, text=True,
                          timeout=600)
    print(f"$ pan2-render {' '.join(args)} -> {done.returncode}\n{done.stderr[-2000:]}")
    assert done.returncode == 0


def _frames(video: Path) -> tuple[np.ndarray, float]:
    """Every frame of an mp4, decoded (uint8 [F, H, W, 3]), and its rate."""
    with av.open(str(video)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, float(stream.average_rate)


def _png(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return next(container.decode(video=0)).to_ndarray(format="rgb24")


def _job_dir(out: Path) -> Path:
    (folder,) = [p for p in out.iterdir() if p.name.startswith("story-")]
    return folder


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def test_a_story_of_three_segments_survives_a_sigkill_in_its_second(tmp_path: Path) -> None:
    batch = write_batch(tmp_path / "b.yaml", [STORY], defaults=JOB)
    whole = tmp_path / "whole"
    _run(["run", str(batch), "--out", str(whole)], _env())
    frames, fps = _frames(_job_dir(whole) / "video.mp4")
    print(f"uninterrupted: {frames.shape[0]} frames at {fps:g} fps")
    assert frames.shape[0] == 3 * 17 - 2 and fps == 8.0
    # Each join is shown once: video frame 16 is segment 1's last frame (and 32 segment 2's), the
    # frame after it is the next segment's second, not its first (a copy of the same frame).
    for k, at in ((1, 16), (2, 32)):
        last = _png(_job_dir(whole) / "segments" / str(k) / "last.png")
        near = {i: round(_diff(frames[i], last), 2) for i in (at - 1, at, at + 1)}
        print(f"segment {k}'s last frame against video frames {near} (mean abs difference)")
        assert near[at] < near[at - 1] and near[at] < near[at + 1]

    out = tmp_path / "killed"
    slow = json.dumps({"slow_steps": {"job": "story", "seconds": 1.0}})  # a segment long enough to land in
    run = subprocess.Popen([*CLI, "run", str(batch), "--out", str(out), "--cpu-gpus", "1", "--no-progress"],
                           env=_env(PAN2_RENDER_FAULTS=slow), start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list(out.glob("story-*/segments/1/segment.json")):
            assert run.poll() is None and time.monotonic() < deadline, "segment 1 never finished"
            time.sleep(0.05)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the driver and every Ray process it started
        run.wait(timeout=30)
    folder = _job_dir(out)
    assert not (folder / "segments" / "2" / "segment.json").exists()  # killed during segment 2
    first = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (folder / "segments" / "1").iterdir()}
    led = Ledger.open_readonly(out)
    (job,) = led.jobs()
    assert job.state is JobState.RUNNING and job.attempts == 1
    led.close()

    _run(["resume", str(out)], _env())
    led = Ledger.open_readonly(out)
    (job,) = led.jobs()
    sampled = [e.detail for e in led.events(job.id) if e.kind is EventKind.SEGMENT and " sampled " in e.detail]
    led.close()
    print("after resume:", job.state.value, "attempts", job.attempts, sampled)
    assert job.state is JobState.DONE and job.attempts == 2
    assert first == {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (folder / "segments" / "1").iterdir()}
    assert [d.split(" sampled")[0] for d in sampled] == ["segment 1/3", "segment 2/3", "segment 3/3"]
    records = [json.loads((folder / "segments" / str(k) / "segment.json").read_text()) for k in (1, 2, 3)]
    assert [r["attempt"] for r in records] == [1, 2, 2]
    resumed, _ = _frames(folder / "video.mp4")
    assert np.array_equal(resumed, frames)  # the decoded video, bit for bit
    assert (folder / "video.mp4").read_bytes() == (_job_dir(whole) / "video.mp4").read_bytes()


def test_interpolation_doubles_the_rate_alone_and_after_three_segments(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")  # one in-process worker: no Ray to start
    monkeypatch.delenv("PAN2_RENDER_PIPELINE", raising=False)  # the tiny model itself
    monkeypatch.delenv("PAN2_RENDER_FAULTS", raising=False)
    runpy.run_path(str(REPO / "scripts" / "make_random_ifnet.py"))["save_random_ifnet"](tmp_path / "rife.safetensors")
    batch = write_batch(tmp_path / "b.yaml", [{"name": "smooth", "prompt": "a lighthouse at dawn"},
                                              {**STORY, "name": "long"}],
                        defaults={**JOB, "interpolate": 2, "interpolation_weights": "rife.safetensors"})
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == 0
    led = Ledger.open_readonly(out)
    jobs = {j.name: j for j in led.jobs()}
    led.close()
    smooth, fps = _frames(out / jobs["smooth"].id / "video.mp4")
    long, long_fps = _frames(out / jobs["long"].id / "video.mp4")
    print(f"interpolated: {smooth.shape[0]} frames at {fps:g} fps; 3 segments: {long.shape[0]} at {long_fps:g}")
    assert (smooth.shape[0], fps) == (2 * 17 - 1, 16.0)
    assert (long.shape[0], long_fps) == ((3 * 17 - 2 - 1) * 2 + 1, 16.0)
    # A resumed batch whose interpolations are done runs none again.
    before = {n: (out / j.id / "video.mp4").stat().st_mtime_ns for n, j in jobs.items()}
    assert cli.main(["resume", str(out), "--no-progress"]) == 0
    assert before == {n: (out / j.id / "video.mp4").stat().st_mtime_ns for n, j in jobs.items()}
