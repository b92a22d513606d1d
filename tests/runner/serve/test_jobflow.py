"""The stage flow is declared once (runner/serve/jobflow.py): a flow with one more stage, declared here in
the test alone, runs, resumes and is repaired by the unchanged scheduler, ledger and repair."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
from runner_helpers import RecordingExecutor, spec

from pan2render.jobs.ledger import LEDGER_NAME, JobEvent, JobState, Ledger, StageEvent, StageState
from pan2render.jobs.spec import JobSpec
from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.messages import (
    CollectCall,
    DecodeCall,
    EncodePromptsCall,
    LoadCall,
    SampleCall,
    WorkerCall,
    WorkerConfig,
)
from pan2render.runner.serve.attempt import JobRun
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver
from pan2render.runner.serve.jobflow import JobFlow, Step
from pan2render.runner.serve.repair import repair
from pan2render.runner.serve.steps import PAN2_FLOW
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY
from pan2render.runner.worker.render_worker import RenderWorker

THUMB = "thumbnail"


@dataclass(frozen=True)
class ThumbCall(WorkerCall):
    stage: ClassVar[str] = THUMB
    shown: ClassVar[str] = "thumbnail"
    timeout_key: ClassVar[str] = "thumbnail"
    default_timeout_s: ClassVar[float] = 60.0
    job_id: str
    video: bytes


@dataclass(frozen=True)
class ThumbReply:
    text: bytes


def _thumb_text(video: bytes) -> bytes:
    return f"thumbnail of {len(video)} bytes\n".encode()


class ThumbWorker(RenderWorker):
    """The worker's half of the new stage: a handler for its call."""

    fail_once: ClassVar[set[str]] = set()  # job ids whose first thumbnail call raises

    def _thumb(self, call: ThumbCall) -> ThumbReply:
        if call.job_id in self.fail_once:
            self.fail_once.discard(call.job_id)
            raise RuntimeError("thumbnailer crashed (test)")
        return ThumbReply(text=_thumb_text(call.video))

    handlers = {**RenderWorker.handlers, ThumbCall: _thumb}


def _relpath(job_id: str) -> str:
    return f"{job_id}/thumb.txt"


class ThumbStep(Step):
    """The flow's half: the call it makes, the artifact it writes, how that is checked."""

    stage = THUMB
    calls = (ThumbCall,)

    def call(self, flow: Any, run: JobRun) -> WorkerCall:
        video = (flow.out_dir / artifacts.video_relpath(run.job.id)).read_bytes()
        return ThumbCall(job_id=run.job.id, video=video)

    def record(self, flow: Any, run: JobRun, value: ThumbReply, seconds: float) -> None:
        rel = _relpath(run.job.id)
        artifacts.write_artifact(flow.out_dir, rel, value.text)
        flow.ledger.set_stage(run.job.id, THUMB, StageEvent.FINISH, artifact=rel,
                              sha256=artifacts.sha256_bytes(value.text), size=len(value.text), seconds=seconds)

    def proof(self, out_dir: Path, spec: JobSpec) -> dict[str, Any] | None:
        path, video = out_dir / _relpath(spec.job_id), out_dir / artifacts.video_relpath(spec.job_id)
        if not path.is_file() or not video.is_file() or path.read_bytes() != _thumb_text(video.read_bytes()):
            return None
        data = path.read_bytes()
        return {"artifact": _relpath(spec.job_id), "sha256": artifacts.sha256_bytes(data), "size": len(data)}


FLOW = JobFlow(steps=(*PAN2_FLOW.steps, ThumbStep()))


def _run(out: Path, jobs: list[JobSpec], *, retries: int = 0) -> tuple[Any, RecordingExecutor, Ledger]:
    out.mkdir(exist_ok=True)
    ledger = Ledger.open(out)
    ledger.record_batch({"path": None, "model": "tiny", "preset": "tiny-preview"}, jobs, retries=retries,
                        stages=FLOW.stages)
    ex = RecordingExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY), worker_class=ThumbWorker)
    driver = Driver(out_dir=out, ledger=ledger, executor=ex, flow=FLOW,
                    config=ServingConfig(retries=retries, progress=False, poll_s=0.01))
    return driver.run([j.job_id for j in jobs]), ex, ledger


def test_a_stage_declared_in_a_test_flow_runs_resumes_and_is_repaired(tmp_path: Path) -> None:
    a, b = spec("a"), spec("b", seed=1)
    ThumbWorker.fail_once = {b.job_id}
    summary, ex, led = _run(tmp_path, [a, b])
    print("first run:", summary, ex.calls)
    # Runs: the new stage's call comes after the collect, and its artifact is recorded.
    assert summary.done == [a.job_id] and summary.failed == [b.job_id]
    kinds = [c for c, _ in ex.calls]
    assert kinds.count(ThumbCall) == 2 and kinds.index(ThumbCall) > ex.calls.index((CollectCall, "a"))
    assert led.stages(a.job_id)[THUMB].state is StageState.DONE
    assert (tmp_path / _relpath(a.job_id)).read_bytes() == _thumb_text((tmp_path / a.job_id / "video.mp4").read_bytes())
    # b failed in the new stage (its video is done and durable): the failure is charged there.
    jb = led.job(b.job_id)
    assert jb.state is JobState.FAILED and jb.error_stage == THUMB and "thumbnailer crashed" in (jb.error or "")
    led.close()

    # Resumes: only what is not durable is redone, the video is not rendered again.
    summary, ex, led = _run(tmp_path, [a, b])
    print("resume:", summary, ex.calls)
    assert summary.done == [a.job_id, b.job_id]
    assert [c for c, _ in ex.calls] == [LoadCall, ThumbCall]
    led.close()

    # Repaired: a lost ledger is rebuilt from the disk by the same declaration, the new stage
    # included; a damaged thumbnail is found and leaves the job to finish.
    (tmp_path / LEDGER_NAME).unlink()
    (tmp_path / _relpath(b.job_id)).write_bytes(b"not this video's thumbnail\n")
    result = repair(tmp_path, batch=None, retries=1, say=print, flow=FLOW)
    print(result.describe())
    rebuilt = Ledger.open_readonly(tmp_path)
    assert rebuilt.stage_names == FLOW.stages
    assert rebuilt.job(a.job_id).state is JobState.DONE and rebuilt.job(b.job_id).state is JobState.PENDING
    st = rebuilt.stages(b.job_id)
    assert st[THUMB].state is StageState.PENDING and all(st[s].state is StageState.DONE for s in PAN2_FLOW.stages)
    rebuilt.close()
    summary, ex, _ = _run(tmp_path, [a, b])
    assert summary.done == [a.job_id, b.job_id] and [c for c, _ in ex.calls] == [LoadCall, ThumbCall]


def test_a_ledger_runs_only_with_the_flow_it_was_recorded_with(tmp_path: Path) -> None:
    led = Ledger.open(tmp_path)
    led.record_batch({"path": None}, [spec("a")], retries=0)
    ex = RecordingExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    with pytest.raises(ValueError, match="records the stages"):
        Driver(out_dir=tmp_path, ledger=led, executor=ex, flow=FLOW, config=ServingConfig(progress=False))


def test_the_flow_restarts_after_the_latest_stage_that_checks_out(tmp_path: Path) -> None:
    """The next call is decided from the last stage backwards: done latents skip conditioning even
    when its cache file is gone; damaged latents are reset and sampled again."""
    j = spec("x")
    summary, ex, led = _run(tmp_path, [j])
    assert summary.done == [j.job_id]
    led.reset_stages(j.job_id, "decode", reason="test: as if the video had been lost")
    for emb in (tmp_path / "_cache" / "embeddings").iterdir():
        emb.unlink()
    led.transition(j.job_id, JobEvent.INVALIDATE,
                   reason="test")
    led.close()
    summary, ex, led = _run(tmp_path, [j])
    print(ex.calls)
    assert [c for c, _ in ex.calls] == [LoadCall, DecodeCall, CollectCall, ThumbCall]
    led.reset_stages(j.job_id, "decode", reason="test")
    led.transition(j.job_id, JobEvent.INVALIDATE,
                   reason="test")
    lat = tmp_path / artifacts.latents_relpath(j.job_id)
    lat.write_bytes(lat.read_bytes()[:-8] + b"\x00" * 8)
    led.close()
    summary, ex, led = _run(tmp_path, [j])
    print(ex.calls)
    assert [c for c, _ in ex.calls] == [LoadCall, EncodePromptsCall, SampleCall, DecodeCall, CollectCall, ThumbCall]
    assert summary.done == [j.job_id]


def test_a_flow_refuses_two_steps_for_one_stage_or_one_call() -> None:
    with pytest.raises(ValueError, match="distinct"):
        JobFlow(steps=(*PAN2_FLOW.steps, PAN2_FLOW.steps[0]))
    class AlsoCollects(ThumbStep):
        stage = "also"
        calls = (CollectCall,)

    with pytest.raises(ValueError, match="one step only"):
        JobFlow(steps=(*PAN2_FLOW.steps, AlsoCollects()))
