"""The checks that decide what counts as done and who is charged, through the driver's public
interface (Driver, LocalExecutor, the typed messages) only: whichever module ends up holding each
check, a job is never recorded done with a video that is not its own, and a lost node is never the
job's fault. Each case here once had a bug planted in it that the rest of the suite missed.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from runner_helpers import RecordingExecutor, render, spec

from pan2render.jobs.ledger import JobState, Ledger, Stage
from pan2render.media.video import probe_mp4
from pan2render.runner.cluster.executor import Call, Group, GroupDied
from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.messages import EncodePromptsCall, SampleCall, WorkerCall, WorkerConfig
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver
from pan2render.runner.worker import packing
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

pytestmark = pytest.mark.timeout(60)


def _done_videos_check_out(out: Path, led: Ledger) -> None:
    for job in led.jobs():
        if job.state is JobState.DONE:
            rec = led.stages(job.id)[Stage.ENCODE]
            problem = artifacts.check_video(out, artifacts.Recorded(rec.artifact, rec.sha256, rec.size),
                                         frames=job.spec.frames, width=job.spec.width, height=job.spec.height)
            assert problem is None, (job.id, problem)


def test_a_decode_of_the_wrong_length_fails_the_job_and_records_no_video(tmp_path: Path) -> None:
    """The worker checks the decoded frames' shape before it encodes them: the mp4's own check
    counts the frames it was given, so a decoder that loses a frame would pass it."""
    summary, _, led = render(tmp_path, [spec("a")], retries=1,
                             factory="pan2render.runner.worker.fake_pipeline:load_short_decode_pipeline")
    job = led.job(spec("a").job_id)
    print(job.state, job.error)
    assert summary.failed == [job.id] and job.error_stage == Stage.DECODE.value
    assert "shape" in (job.error or "") and not (tmp_path / job.id / "video.mp4").exists()
    _done_videos_check_out(tmp_path, led)


def test_two_encodes_at_once_on_one_worker_give_each_job_its_own_video(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to two encodes run at once on a worker; each must write and read back its own file."""
    from pan2render.media import video

    real = video.encode_mp4

    def slow_to_hand_back(*args: Any, **kw: Any) -> float:
        seconds = real(*args, **kw)
        time.sleep(0.4)  # the file sits written while the GPU lane decodes the next job
        return seconds

    monkeypatch.setattr(video, "encode_mp4", slow_to_hand_back)
    a = spec("a")
    b = dataclasses.replace(spec("b", seed=1), width=32, height=48, frames=5)  # another size and length
    summary, ex, led = render(tmp_path, [a, b])
    assert len(summary.done) == 2 and ex.groups_created == 1
    for job in (a, b):
        info = probe_mp4(tmp_path / job.job_id / "video.mp4")
        assert (info.frames, info.width, info.height) == (job.frames, job.width, job.height), job.name


def test_an_embedding_cached_by_another_text_encoder_is_not_used(tmp_path: Path) -> None:
    """The embedding cache is keyed by prompt and text encoder: the same prompt under a model with
    its own encoder is encoded again, and renders what that model alone renders."""
    factory = "pan2render.runner.worker.fake_pipeline:load_own_encoder_pipeline"
    a = spec("a", prompt="the same prompt")
    b = dataclasses.replace(spec("b", prompt="the same prompt"), model="another-checkpoint")
    summary, ex, led = render(tmp_path / "both", [a, b], factory=factory)
    assert len(summary.done) == 2
    assert sum(kind is EncodePromptsCall for kind, _ in ex.calls) == 2
    alone, _, _ = render(tmp_path / "alone", [b], factory=factory)
    latents = artifacts.latents_relpath(b.job_id)
    both = packing.unpack_latents((tmp_path / "both" / latents).read_bytes())
    assert torch.equal(both, packing.unpack_latents((tmp_path / "alone" / latents).read_bytes()))


class LosesOneNode(RecordingExecutor):
    """A cluster of ``gpus`` GPUs that loses ``lost`` of them (a node) when the first sampling call
    goes out (its group dies), and gets them back after ``back_after`` calls to total_gpus()."""

    def __init__(self, *, lost: int, back_after: int, **kw: Any):
        super().__init__(**kw)
        self.lost, self.back_after, self.gone, self.asked = lost, back_after, False, 0

    def total_gpus(self) -> int:
        if self.gone:
            self.asked += 1
            self.gone = self.asked <= self.back_after
        return super().total_gpus() - (self.lost if self.gone else 0)

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        if isinstance(message, SampleCall) and not self.asked and not self.gone:
            self.gone = True
            return Call(group=group, message=message, started=0.0, timeout_s=timeout_s,
                        handle=GroupDied("ActorDiedError: the node running this actor died"))
        return super().call(group, message, timeout_s=timeout_s)


def test_a_node_lost_under_a_group_is_not_charged_when_other_gpus_remain(tmp_path: Path) -> None:
    """A 2-GPU job on a cluster left with 1 GPU: the group cannot be the job's fault, though the
    cluster still has a GPU; the job waits for the node and is not charged."""
    job = spec("wide", gpus=2)
    tmp_path.mkdir(exist_ok=True)
    led = Ledger.open(tmp_path)
    led.add_jobs([job], retries=2)
    ex = LosesOneNode(lost=1, back_after=3, gpus=2, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    summary = Driver(out_dir=tmp_path, ledger=led, executor=ex,
                     config=ServingConfig(retries=2, progress=False, poll_s=0.01, cluster_wait_s=30)).run([job.job_id])
    record = led.job(job.job_id)
    print(record.state, record.attempts, record.retries_left, [(e.label, e.detail) for e in led.events(job.job_id)])
    assert summary.done == [job.job_id] and record.retries_left == 2  # the lost node was not the job's fault
    assert any("lost the GPUs" in e.detail for e in led.events(job.job_id))


def test_a_video_written_wrong_is_never_recorded_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver checks the file it wrote against the bytes it was sent before recording it: a
    write that lands short (a filesystem that lost the end of it) is redone, not recorded."""
    real = artifacts.write_atomic
    short = {"n": 0}

    def write_atomic(path: Path, data: bytes) -> None:
        if path.name == artifacts.VIDEO_NAME and not short["n"]:
            short["n"] += 1
            data = data[: len(data) // 2]
        real(path, data)

    monkeypatch.setattr(artifacts, "write_atomic", write_atomic)
    summary, _, led = render(tmp_path, [spec("a")])
    assert short["n"] == 1 and len(summary.done) == 1
    _done_videos_check_out(tmp_path, led)
