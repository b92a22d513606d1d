"""The driver <-> worker protocol: every call type is handled by the worker, names its stage and
deadline once, and crosses a process boundary (Ray pickles it) unchanged."""

from __future__ import annotations

import pickle

import pytest

from pan2render.jobs.ledger import Stage
from pan2render.runner.protocol.failures import Failure, FailureKind
from pan2render.runner.protocol.messages import (
    JOB_CALLS,
    SETUP_CALLS,
    CollectCall,
    CollectReply,
    FetchCheckpointCall,
    FetchPreviewCall,
    InitGroupCall,
    Lane,
    LoadCall,
    LoadReply,
    Reply,
    SampleCall,
    StopSamplingCall,
    Warmup,
    WorkerConfig,
    default_call_timeouts,
)
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY
from pan2render.runner.worker.render_worker import RenderWorker


def test_the_worker_handles_every_call_type_and_nothing_else() -> None:
    assert set(RenderWorker.handlers) == set(JOB_CALLS) | set(SETUP_CALLS)


def test_each_job_call_names_its_stage_label_lane_and_deadline() -> None:
    for call in JOB_CALLS:
        assert isinstance(call.stage, Stage) and call.shown and call.timeout_key and call.default_timeout_s > 0, call
        assert call.lane in (Lane.GPU, Lane.IO), call
    assert len({c.timeout_key for c in JOB_CALLS}) == len(JOB_CALLS)
    # Beside the GPU lane: the encode's collect, a sampling's stop, step checkpoint fetch and preview fetch.
    assert [c for c in JOB_CALLS if c.lane is Lane.IO] == [CollectCall, StopSamplingCall, FetchCheckpointCall,
                                                           FetchPreviewCall]
    assert all(c.lane is Lane.SETUP and c.stage is None for c in SETUP_CALLS)
    assert ServingConfig().call_timeouts_s == default_call_timeouts()


def test_a_config_missing_a_calls_deadline_is_refused() -> None:
    timeouts = default_call_timeouts()
    del timeouts[SampleCall.timeout_key]
    with pytest.raises(ValueError, match="sample"):
        ServingConfig(call_timeouts_s=timeouts)


def test_an_unknown_call_comes_back_as_a_failure_not_an_exception() -> None:
    w = RenderWorker(rank=0, world_size=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))

    class Stray(LoadCall):
        pass

    reply = w.execute(Stray(model="tiny"))
    assert reply.failure is not None and "no handler for Stray" in reply.failure.error


@pytest.mark.parametrize("message", [
    LoadCall(model="tiny", warmup=Warmup(height=32, width=48, frames=9, guidance=2.5)),
    SampleCall(model="tiny", job_id="a-12345678", spec=None, prompt_embeds=b"\x00" * 64,
               negative_embeds=b"\x01" * 64, image=None),
    InitGroupCall(init_method="file:///tmp/group-x/store", backend="gloo"),
    Reply(rank=0, value=CollectReply(mp4=b"mp4", encode_s=1.0, check_s=0.5), seconds=1.5),
    Reply(rank=1, failure=Failure(stage=Stage.SAMPLING, kind=FailureKind.INPUT, error="JobInputError: x",
                                  traceback="tb", rank=1)),
    LoadReply(model_id="m", text_encoder_id="t", backend="none", world_size=1, device="cpu", attention="sdpa",
              load_s=1.0, warmup_s=0.0),
])
def test_messages_cross_a_process_boundary_unchanged(message: object) -> None:
    assert pickle.loads(pickle.dumps(message)) == message
