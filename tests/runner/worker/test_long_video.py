"""The frames a worker keeps between a decode and its interpolation: a sampling that starts lets go
of frames an ended attempt left there (a video's frames at 720p are gigabytes of device memory),
and while no sampling comes between, the interpolation finds them. A chained job's segments, kept
from their decode for the last frame to the video's decode: joined without a second decode, to the
frames a decode anew gives."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import runpy
import weakref
from pathlib import Path

import torch

from pan2render.jobs.spec import JobSpec
from pan2render.runner.protocol.messages import (
    DecodeCall,
    InterpolateCall,
    SampleCall,
    Segment,
    SegmentFrameCall,
    SegmentLatents,
    WorkerConfig,
)
from pan2render.runner.worker import packing
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY, FakePipeline
from pan2render.runner.worker.long_video import Interpolation, SegmentFrames, segment_frame, video_frames_on_device
from pan2render.runner.worker.render_worker import RenderWorker

_MAKE = runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "make_random_ifnet.py"))


def _spec(name: str) -> JobSpec:
    return JobSpec(name=name, model="tiny", prompt=f"a clip of {name}", negative_prompt="", image=None,
                   image_sha256=None, seed=0, steps=2, guidance=1.0, height=32, width=48, frames=9, fps=8.0,
                   flow_shift=5.0, sampler="unipc", gpus=1, crf=18, preset="tiny-preview")


def _smooth(tmp: Path) -> tuple[JobSpec, bytes]:
    weights = tmp / "ifnet.safetensors"
    _MAKE["save_random_ifnet"](weights)
    data = weights.read_bytes()
    return dataclasses.replace(_spec("smooth"), interpolate=2, interpolation_weights=str(weights),
                               interpolation_sha256=hashlib.sha256(data).hexdigest()), data


def _decode_then(tmp: Path, *, sample_between: bool) -> str | int:
    """A decode of an interpolating job, optionally another job's sampling next (the first job's
    attempt ended after its decode), then its InterpolateCall: its frame count, or its error."""
    w = RenderWorker(rank=0, world_size=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    smooth, weights = _smooth(tmp)
    pipe = FakePipeline("tiny")
    lat = pipe.sample(prompt_embeds=pipe.encode_prompt("p"), height=32, width=48, frames=9, steps=2,
                      guidance=1.0, seed=0)  # float32 [48, 3, 2, 3]
    latents = packing.pack_latents(lat, spec_hash=smooth.spec_hash, seed=0, steps=2, model_id=pipe.model_id)
    seq = iter(range(10))
    decoded = w.execute(DecodeCall(model="tiny", job_id=smooth.job_id, spec=smooth, latents=latents), next(seq))
    assert decoded.ok, decoded.failure
    if sample_between:
        other = _spec("other")
        emb = packing.pack_embedding(pipe.encode_prompt(other.prompt), key="k", text_encoder_id=pipe.text_encoder_id)
        sampled = w.execute(SampleCall(model="tiny", job_id=other.job_id, spec=other, prompt_embeds=emb,
                                       negative_embeds=emb), next(seq))
        assert sampled.ok, sampled.failure
    reply = w.execute(InterpolateCall(model="tiny", job_id=smooth.job_id, spec=None, weights=weights,
                                      weights_sha256=smooth.interpolation_sha256 or ""), next(seq))
    return reply.value.frames if reply.ok else reply.failure.error


def test_the_interpolation_finds_the_frames_its_decode_kept(tmp_path: Path) -> None:
    assert _decode_then(tmp_path, sample_between=False) == 2 * 9 - 1


def test_a_sampling_lets_go_of_the_frames_an_ended_attempt_kept(tmp_path: Path) -> None:
    error = _decode_then(tmp_path, sample_between=True)
    print("interpolation after another job's sampling:", error)
    assert isinstance(error, str) and "no decoded frames of job smooth-" in error


def test_forget_returns_the_kept_frames_memory() -> None:
    held = Interpolation()
    frames = torch.zeros(9, 32, 48, 3, dtype=torch.uint8)
    gone = weakref.ref(frames)
    held.keep("smooth-1", frames)
    del frames
    gc.collect()
    assert gone() is not None  # kept: the only reference is the worker's
    held.forget()
    gc.collect()
    assert gone() is None


class _CountedDecodes(FakePipeline):
    def __init__(self) -> None:
        super().__init__("tiny")
        self.decodes = 0

    def decode(self, latents: torch.Tensor, *, on_device: bool = False) -> torch.Tensor:
        self.decodes += 1
        return super().decode(latents, on_device=on_device)


def _chain(pipe: FakePipeline, seeds: tuple[int, ...]) -> tuple[JobSpec, list[bytes]]:
    chain = dataclasses.replace(_spec("chain"), segments=len(seeds))
    lat = [pipe.sample(prompt_embeds=pipe.encode_prompt("p"), height=32, width=48, frames=9, steps=2,
                       guidance=1.0, seed=s) for s in seeds]
    return chain, [packing.pack_latents(x, spec_hash=chain.spec_hash, seed=s, steps=2, model_id=pipe.model_id)
                   for x, s in zip(lat, seeds)]


def _segments_decoded(pipe: _CountedDecodes, chain: JobSpec, latents: list[bytes],
                      kept: SegmentFrames) -> tuple[SegmentLatents, ...]:
    """Each segment's SegmentFrameCall as the sampling stage runs them, on one worker."""
    out: list[SegmentLatents] = []
    for k, lat in enumerate(latents, 1):
        call = SegmentFrameCall(model="tiny", job_id=chain.job_id, spec=chain,
                                segment=Segment(index=k, count=len(latents), seed=k), latents=lat,
                                reference=out[0].stats if out else None)
        reply = segment_frame(pipe, call, chain, rank=0, device="cpu", kept=kept)
        assert reply is not None
        out.append(SegmentLatents(latents=lat, stats=reply.stats))
    return tuple(out)


def test_a_video_of_segments_decoded_here_decodes_none_of_them_again() -> None:
    pipe = _CountedDecodes()
    chain, latents = _chain(pipe, (1, 2, 3))
    kept = SegmentFrames()
    segments = _segments_decoded(pipe, chain, latents, kept)
    assert pipe.decodes == 3
    video = DecodeCall(model="tiny", job_id=chain.job_id, spec=chain, latents=b"", segments=segments)
    joined = video_frames_on_device(pipe, video, chain, rank=0, device="cpu", kept=kept)
    assert pipe.decodes == 3  # the kept frames joined, no decode
    # The same video decoded where its segments were not (another worker, after a crash).
    anew = video_frames_on_device(pipe, video, chain, rank=0, device="cpu", kept=SegmentFrames())
    assert pipe.decodes == 6
    assert joined is not None and anew is not None and joined.shape == (3 * 9 - 2, 32, 48, 3)
    assert torch.equal(joined, anew)


def test_a_segment_sampled_again_is_decoded_again() -> None:
    pipe = _CountedDecodes()
    chain, latents = _chain(pipe, (1, 2, 3))
    kept = SegmentFrames()
    segments = _segments_decoded(pipe, chain, latents, kept)
    # Another attempt sampled segment 3 again with other latents; the kept frames are the old ones.
    _, again = _chain(pipe, (1, 2, 7))
    redone = (*segments[:2], SegmentLatents(latents=again[2], stats=segments[2].stats))
    video = DecodeCall(model="tiny", job_id=chain.job_id, spec=chain, latents=b"", segments=redone)
    before = pipe.decodes
    joined = video_frames_on_device(pipe, video, chain, rank=0, device="cpu", kept=kept)
    assert pipe.decodes == before + 1
    expected = video_frames_on_device(pipe, video, chain, rank=0, device="cpu", kept=SegmentFrames())
    assert torch.equal(joined, expected)


def test_another_jobs_sampling_lets_go_of_kept_segments_and_the_same_jobs_does_not() -> None:
    kept = SegmentFrames()
    kept.keep("chain-1", 1, "d1", torch.zeros(9, 32, 48, 3, dtype=torch.uint8))
    kept.forget_unless("chain-1")  # its own next segment's sampling
    assert kept.take("chain-1", 1, "d1")[0]
    kept.keep("chain-1", 2, "d2", torch.zeros(8, 32, 48, 3, dtype=torch.uint8))
    kept.forget_unless("other-1")
    assert kept.take("chain-1", 2, "d2") == (False, None)
