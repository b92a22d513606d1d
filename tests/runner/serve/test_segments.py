"""A chained job's segments through the scheduler, in process (the fake pipeline): each segment a
sampling and a decode, each leaving its files; one video without the repeated join frames; resume
redoes only what is missing or damaged, and what depended on it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from runner_helpers import render, spec

from pan2render.jobs.ledger import EventKind, Stage, StageState
from pan2render.jobs.spec import JobSpec
from pan2render.long_video import segment_seed
from pan2render.media.video import probe_mp4
from pan2render.runner.protocol.messages import SampleCall, SegmentFrameCall
from pan2render.runner.serve.segments import done_segments


def _story(name: str = "story", **kw: object) -> JobSpec:
    base = spec(name, steps=3, seed=5)  # 9 frames of 32x48 a segment
    return dataclasses.replace(base, segments=3, prompts=("a fox wakes", "the fox runs", "the fox sleeps"),
                               prompt="a fox wakes", **kw)


def _segment_files(out: Path, job: JobSpec, k: int) -> dict[str, tuple[int, int]]:
    """Each file of segment k: (inode, mtime_ns), which a redo would change."""
    folder = out / job.job_id / "segments" / str(k)
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def _sampled(ex: object, message_type: type = SampleCall) -> list[tuple[int, int]]:
    """(segment index, seed) of each call of that type that went out."""
    return [(m.segment.index, m.segment.seed) for m in ex.messages if isinstance(m, message_type)]  # type: ignore[attr-defined]


def test_a_story_renders_each_segment_then_one_video_without_the_repeated_frames(tmp_path: Path) -> None:
    job = _story()
    summary, ex, led = render(tmp_path / "out", [job])
    assert summary.done == [job.job_id]
    seeds = [segment_seed(5, k) for k in (1, 2, 3)]
    assert seeds[0] == 5 and len(set(seeds)) == 3
    assert _sampled(ex) == _sampled(ex, SegmentFrameCall) == list(zip((1, 2, 3), seeds))
    samples = [m for m in ex.messages if isinstance(m, SampleCall)]
    # Each segment is conditioned on its own prompt; the second and third on the previous one's last frame.
    assert len({m.prompt_embeds for m in samples}) == 3 and samples[0].image is None
    out = tmp_path / "out"
    for k in (2, 3):
        last = (out / job.job_id / "segments" / str(k - 1) / "last.png").read_bytes()
        assert samples[k - 1].image == last
    info = probe_mp4(out / job.job_id / "video.mp4")
    assert info.frames == 3 * 9 - 2, info
    params = json.loads((out / job.job_id / "params.json").read_text())["long_video"]
    assert params["frames"] == 25 and params["fps"] == 8.0
    segs = params["segments"]
    assert [s["prompt"] for s in segs] == list(job.prompts) and [s["seed"] for s in segs] == seeds
    assert [s["conditioning"] for s in segs] == ["none", "segment 1", "segment 2"]
    assert segs[1]["conditioning_sha256"] == segs[0]["last_frame"]["sha256"]
    assert all(len(s["colour"]["mean"]) == len(s["colour"]["std"]) == 3 for s in segs)
    assert [s["matched_to"] for s in segs] == [None, 1, 1] and {s["frames"] for s in segs} == {9}
    st = led.stages(job.job_id)
    assert st[Stage.SAMPLING].state is StageState.DONE
    assert st[Stage.SAMPLING].artifact == f"{job.job_id}/segments/3/latents.safetensors"
    assert len(json.loads(led.document(job.job_id, "segments"))["done"]) == 3


def test_a_job_of_one_segment_renders_as_before(tmp_path: Path) -> None:
    job = spec("plain", steps=3)
    _, ex, _ = render(tmp_path / "out", [job])
    assert all(m.segment is None for m in ex.messages if isinstance(m, SampleCall))
    assert not (tmp_path / "out" / job.job_id / "segments").exists()
    assert (tmp_path / "out" / job.job_id / "latents.safetensors").is_file()
    assert probe_mp4(tmp_path / "out" / job.job_id / "video.mp4").frames == 9


def test_a_worker_dying_in_segment_two_redoes_nothing_of_segment_one(tmp_path: Path) -> None:
    whole = _story()
    render(tmp_path / "whole", [whole])
    job = _story()
    marker = tmp_path / "crashed"
    summary, ex, led = render(tmp_path / "out", [job], faults={"crash": {
        "job": "story", "step": 2, "segment": 2, "marker": str(marker)}})
    assert marker.exists() and summary.done == [job.job_id]
    seeds = [segment_seed(5, k) for k in (1, 2, 3)]
    # Segment 1 sampled once; segment 2 twice (the worker died in it); its retry continued from segment 2.
    assert _sampled(ex) == [(1, seeds[0]), (2, seeds[1]), (2, seeds[1]), (3, seeds[2])]
    assert led.job(job.job_id).attempts == 2
    records = [r.attempt for r in done_segments(tmp_path / "out", job)[0]]
    assert records == [1, 2, 2]
    sampled = [e.detail for e in led.events(job.job_id) if e.kind is EventKind.SEGMENT and "sampled" in e.detail]
    assert len([d for d in sampled if d.startswith("segment 1/3")]) == 1
    assert (tmp_path / "out" / job.job_id / "video.mp4").read_bytes() == \
        (tmp_path / "whole" / whole.job_id / "video.mp4").read_bytes()


def test_resume_redoes_a_damaged_segment_and_those_conditioned_on_another_frame(tmp_path: Path) -> None:
    job = _story()
    out = tmp_path / "out"
    render(out, [job])[2].close()
    video = (out / job.job_id / "video.mp4").read_bytes()
    first, third = _segment_files(out, job, 1), _segment_files(out, job, 3)
    (out / job.job_id / "segments" / "2" / "latents.safetensors").write_bytes(b"damaged")
    (out / job.job_id / "video.mp4").unlink()  # what resume checks of a done job: it goes back to decode
    summary, ex, led = render(out, [job])
    assert summary.done == [job.job_id]
    # Decode found a segment no longer checks out: segment 2 is sampled again. It ends on the same
    # last frame, so segment 3, conditioned on it, still stands; segment 1 is untouched.
    assert [k for k, _ in _sampled(ex)] == [2]
    assert _segment_files(out, job, 1) == first and _segment_files(out, job, 3) == third
    resets = [e.detail for e in led.events(job.job_id) if e.kind is EventKind.RESET]
    assert any("segment 2's latents" in d for d in resets), resets
    assert (out / job.job_id / "video.mp4").read_bytes() == video  # the same segments: the same video
    led.close()

    # Segment 1 now ends on another frame (its record says so): 2 and 3 were conditioned on the old one.
    folder = out / job.job_id / "segments" / "1"
    other = (out / job.job_id / "segments" / "3" / "last.png").read_bytes()
    (folder / "last.png").write_bytes(other)
    record = json.loads((folder / "segment.json").read_text())
    record["last_frame"]["sha256"] = hashlib.sha256(other).hexdigest()
    (folder / "segment.json").write_text(json.dumps(record))
    (out / job.job_id / "video.mp4").unlink()
    summary, ex, _ = render(out, [job])
    assert summary.done == [job.job_id] and [k for k, _ in _sampled(ex)] == [2, 3]
    second = [m for m in ex.messages if isinstance(m, SampleCall)][0]
    assert second.image == other
    assert (out / job.job_id / "video.mp4").read_bytes() != video


def test_latents_sampled_before_a_failed_decode_are_not_sampled_again(tmp_path: Path) -> None:
    job = _story()
    out = tmp_path / "out"
    summary, ex, led = render(out, [job], retries=1, faults={"fail": {"job": "story", "stage": "decode"}})
    assert summary.failed == [job.job_id]
    # The first segment's decode failed on both attempts; its latents were sampled once.
    assert _sampled(ex) == [(1, 5)] and _sampled(ex, SegmentFrameCall) == [(1, 5), (1, 5)]
    assert (out / job.job_id / "segments" / "1" / "latents.safetensors").is_file()
    led.close()
    summary, ex, led = render(out, [job])
    assert summary.done == [job.job_id]
    assert [k for k, _ in _sampled(ex)] == [2, 3] and [k for k, _ in _sampled(ex, SegmentFrameCall)] == [1, 2, 3]
    assert os.path.getsize(out / job.job_id / "video.mp4") > 0


def test_a_story_renders_again_from_its_record_under_the_same_id(tmp_path: Path) -> None:
    """`run --from` a chained, interpolated job's params.json: the one-job batch it makes (prompts as a
    YAML list, the weights by path) resolves to the same id."""
    import runpy

    from pan2render.jobs.overrides import Overrides
    from pan2render.runner.cli.run_from import load_from

    weights = tmp_path / "rife.safetensors"
    runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "make_random_ifnet.py"))[
        "save_random_ifnet"](weights)
    job = _story(width=64, interpolate=2, interpolation_weights=str(weights),
                 interpolation_sha256=hashlib.sha256(weights.read_bytes()).hexdigest())
    render(tmp_path / "out", [job])[2].close()
    batch, recorded = load_from(tmp_path / "out" / job.job_id / "params.json", Overrides(), check_model=True,
                                say=print)
    assert recorded.job_id == job.job_id and [j.job_id for j in batch.jobs] == [job.job_id]
    assert batch.jobs[0].prompts == job.prompts


def test_a_story_in_a_group_of_two_gives_one_gpus_frames(tmp_path: Path) -> None:
    """Every rank decodes (a group's decode is split); rank 0 alone matches, joins and answers."""
    import av
    import numpy as np

    def frames(out: Path, job: JobSpec) -> np.ndarray:
        with av.open(str(out / job.job_id / "video.mp4")) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])

    one, two = _story(), _story(gpus=2)
    assert render(tmp_path / "one", [one])[0].done == [one.job_id]
    summary, ex, _ = render(tmp_path / "two", [two], gpus=2)
    assert summary.done == [two.job_id] and _sampled(ex) == _sampled(ex, SegmentFrameCall) != []
    assert np.array_equal(frames(tmp_path / "one", one), frames(tmp_path / "two", two))
