"""Frame interpolation as a stage of the flow, in process (the fake pipeline, RIFE's IFNet with
random weights): after decode, on the worker's GPU lane; the video at twice the rate with 2n - 1
frames; a job whose video is written does not interpolate again; the scheduler keeps the next job
from queueing between a decode and its interpolation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import runpy
from pathlib import Path

from runner_helpers import RecordingExecutor, ThreadedExecutor, render, spec

from pan2render.jobs.ledger import Stage, StageState
from pan2render.jobs.spec import JobSpec
from pan2render.media.video import probe_mp4
from pan2render.runner.protocol.messages import DecodeCall, InterpolateCall, SampleCall, SegmentFrameCall

_MAKE = runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "make_random_ifnet.py"))


def _smooth(tmp: Path, name: str = "smooth", **kw: object) -> JobSpec:
    weights = tmp / "ifnet.safetensors"
    if not weights.exists():
        _MAKE["save_random_ifnet"](weights)
    return dataclasses.replace(spec(name, steps=3), interpolate=2, interpolation_weights=str(weights),
                               interpolation_sha256=hashlib.sha256(weights.read_bytes()).hexdigest(), **kw)


def _calls(ex: object) -> list[str]:
    return [type(m).__name__ for m in ex.messages  # type: ignore[attr-defined]
            if isinstance(m, (SampleCall, SegmentFrameCall, DecodeCall, InterpolateCall))]


def test_interpolate_2_doubles_the_rate_and_gives_2n_minus_1_frames(tmp_path: Path) -> None:
    job = _smooth(tmp_path)
    out = tmp_path / "out"
    summary, ex, led = render(out, [job])
    assert summary.done == [job.job_id]
    assert _calls(ex) == ["SampleCall", "DecodeCall", "InterpolateCall"]
    info = probe_mp4(out / job.job_id / "video.mp4")
    assert (info.frames, info.fps) == (2 * 9 - 1, 16.0), info
    st = led.stages(job.job_id)
    assert st[Stage.INTERPOLATE].state is StageState.DONE and st[Stage.INTERPOLATE].seconds > 0
    params = json.loads((out / job.job_id / "params.json").read_text())
    assert params["long_video"] == {"frames": 17, "fps": 16.0, "segments": [], "interpolate": 2}
    assert params["spec"]["interpolation_sha256"] == job.interpolation_sha256


def test_a_done_jobs_interpolation_is_not_redone_and_a_lost_video_redoes_no_sampling(tmp_path: Path) -> None:
    job = _smooth(tmp_path)
    out = tmp_path / "out"
    render(out, [job])[2].close()
    video = out / job.job_id / "video.mp4"
    before = (video.stat().st_ino, video.stat().st_mtime_ns, video.read_bytes())
    _, ex, led = render(out, [job])  # resumed: the video checks out
    assert _calls(ex) == [] and (video.stat().st_ino, video.stat().st_mtime_ns, video.read_bytes()) == before
    led.close()
    video.unlink()
    _, ex, _ = render(out, [job])  # its video lost: decoded and interpolated again from its latents
    assert _calls(ex) == ["DecodeCall", "InterpolateCall"]
    assert video.read_bytes() == before[2]


def test_three_segments_interpolated(tmp_path: Path) -> None:
    job = _smooth(tmp_path, segments=3)
    out = tmp_path / "out"
    summary, ex, _ = render(out, [job])
    assert summary.done == [job.job_id]
    assert _calls(ex) == ["SampleCall", "SegmentFrameCall"] * 3 + ["DecodeCall", "InterpolateCall"]
    info = probe_mp4(out / job.job_id / "video.mp4")
    assert (info.frames, info.fps) == ((3 * 9 - 2 - 1) * 2 + 1, 16.0), info


class _ThreadedRecording(RecordingExecutor, ThreadedExecutor):
    """Calls recorded, the GPU lane on a thread of its own: the scheduler places the next job while
    a decode runs, as beside a Ray actor."""


def test_the_next_job_waits_for_the_interpolation_not_only_the_decode(tmp_path: Path) -> None:
    """On one group, the second job's first GPU call goes out after the first job's interpolation
    (queued behind the decode, it would run before it: the GPU lane runs calls in order)."""
    first, second = _smooth(tmp_path, "first"), _smooth(tmp_path, "second")
    _, ex, _ = render(tmp_path / "out", [first, second], executor=_ThreadedRecording,
                      faults={"slow": {"job": "first", "stage": "decode", "seconds": 1.0}})
    order = [(type(m).__name__, m.job_id.rsplit("-", 1)[0]) for m in ex.messages
             if isinstance(m, (SampleCall, DecodeCall, InterpolateCall))]
    assert order == [("SampleCall", "first"), ("DecodeCall", "first"), ("InterpolateCall", "first"),
                     ("SampleCall", "second"), ("DecodeCall", "second"), ("InterpolateCall", "second")]
