"""The worker's two lanes, in-process: GPU-lane calls run in the driver's order (``seq``) whatever
order they arrive in, and ``collect`` returns an encode while the GPU lane is busy."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any

from pan2render.jobs.ledger import Stage
from pan2render.jobs.spec import JobSpec
from pan2render.media.video import probe_mp4
from pan2render.runner.protocol.failures import FailureKind
from pan2render.runner.protocol.messages import CollectCall, DecodeCall, SampleCall, WorkerCall, WorkerConfig
from pan2render.runner.worker import packing
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY, FakePipeline
from pan2render.runner.worker.render_worker import RenderWorker


@dataclass(frozen=True)
class _Mark(WorkerCall):
    """A GPU-lane call that records its tag."""

    tag: str


@dataclass(frozen=True)
class _Hold(WorkerCall):
    """A GPU-lane call that holds the lane until released."""


class _Worker(RenderWorker):
    """Two extra GPU-lane calls for the test."""

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
        self.order: list[str] = []
        self.release = threading.Event()

    def _mark(self, call: _Mark) -> str:
        self.order.append(call.tag)
        return call.tag

    def _hold(self, call: _Hold) -> None:
        assert self.release.wait(10), "never released"


_Worker.handlers = {**RenderWorker.handlers, _Mark: _Worker._mark, _Hold: _Worker._hold}


def _spec() -> JobSpec:
    return JobSpec(name="v", model="tiny", prompt="p", negative_prompt="", image=None, image_sha256=None, seed=0,
                   steps=2, guidance=1.0, height=32, width=48, frames=9, fps=8.0, flow_shift=5.0,
                   sampler="unipc", gpus=1, crf=18, preset="tiny-preview")


def test_gpu_lane_calls_run_in_seq_order_whatever_the_arrival_order() -> None:
    w = _Worker()
    late = threading.Thread(target=w.execute, args=(_Mark(tag="second"), 1))
    late.start()  # seq 1 arrives first and must wait for seq 0
    time.sleep(0.2)
    assert w.order == []
    assert w.execute(_Mark(tag="first"), 0).value == "first"
    late.join(5)
    print("order:", w.order)
    assert w.order == ["first", "second"]


def test_collect_returns_while_the_gpu_lane_is_held(tmp_path: Any) -> None:
    w = _Worker()
    js = _spec()
    latents = packing.pack_latents(FakePipeline("tiny").sample(
        prompt_embeds=FakePipeline("tiny").encode_prompt("p"), height=32, width=48, frames=9, steps=2,
        guidance=1.0, seed=0), spec_hash=js.spec_hash, seed=0, steps=2, model_id="fake")
    decoded = w.execute(DecodeCall(model="tiny", job_id=js.job_id, spec=js, latents=latents), 0)
    assert decoded.ok, decoded.failure
    holder = threading.Thread(target=w.execute, args=(_Hold(), 1))
    holder.start()  # the GPU lane is busy with the next call now
    try:
        t0 = time.monotonic()
        reply: Any = w.execute(CollectCall(job_id=js.job_id))
        print(f"collect while the GPU lane is held: ok={reply.ok} in {time.monotonic() - t0:.2f} s, "
              f"{len(reply.value.mp4)} bytes, encode {reply.value.encode_s:.3f} s")
        assert reply.ok and holder.is_alive()
        (tmp_path / "v.mp4").write_bytes(reply.value.mp4)
        info = probe_mp4(tmp_path / "v.mp4")
        assert (info.frames, info.width, info.height) == (9, 48, 32)
    finally:
        w.release.set()
        holder.join(5)
    again = w.execute(CollectCall(job_id=js.job_id))  # collected once: the table forgets it
    assert not again.ok and CollectCall.stage is Stage.ENCODE and "no encode of job" in again.failure.error
    assert again.failure.kind is FailureKind.UNKNOWN



def test_a_calibration_gone_since_validation_fails_the_sampling_as_deterministic(monkeypatch: Any) -> None:
    """Validation refuses `cache: magcache` without a calibration; a worker that still meets one
    (its calibration removed since) fails the job's sampling as its input, never `unknown`: a retry
    on another group would fail the same way."""
    from pan2render.lanes import CalibrationMissing

    def uncalibrated(self: FakePipeline, **_: Any) -> None:
        raise CalibrationMissing("run `pan2-render calibrate tiny` once (or set cache: none): ...")

    monkeypatch.setattr(FakePipeline, "sampling_plan", uncalibrated)
    w = _Worker()
    js = dataclasses.replace(_spec(), cache="magcache")
    embeds = packing.pack_embedding(FakePipeline("tiny").encode_prompt("p"), key="p", text_encoder_id="fake-text-v1")
    reply = w.execute(SampleCall(model="tiny", job_id=js.job_id, spec=js, prompt_embeds=embeds,
                                 negative_embeds=embeds), 0)
    print(reply.failure)
    assert not reply.ok and reply.failure.kind is FailureKind.INPUT
    assert reply.failure.error.startswith("CalibrationMissing: run `pan2-render calibrate tiny` once")  # fix first
