"""RayExecutor.wait with a stand-in for ray: a group call returns as soon as one rank has failed,
whether its actor died or its call came back with an error, so the other ranks are not waited out."""

from __future__ import annotations

from pan2render.jobs.ledger import Stage
from pan2render.runner.cluster.executor import Call
from pan2render.runner.cluster.ray_executor import RayExecutor
from pan2render.runner.protocol.failures import Failure, FailureKind
from pan2render.runner.protocol.messages import Reply, SampleCall


class _FakeRay:
    """Refs are strings; ``finished`` maps the ready ones to their Reply or to an exception."""

    def __init__(self, finished: dict[str, object]):
        self.finished = finished

    def wait(self, refs, *, num_returns, timeout):
        ready = [r for r in refs if r in self.finished][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref, *, timeout):
        value = self.finished[ref]
        if isinstance(value, Exception):
            raise value
        return value


def _executor(finished: dict[str, object]) -> RayExecutor:
    ex = object.__new__(RayExecutor)  # no cluster: only wait() and its helper are exercised
    ex._ray = _FakeRay(finished)
    return ex


def _call(*refs: str) -> Call:
    message = SampleCall(model="tiny", job_id="j", spec=None, prompt_embeds=b"", negative_embeds=b"")
    return Call(group=None, message=message, started=0.0, timeout_s=60.0, handle=list(refs))


def test_a_rank_that_replied_with_an_error_ends_the_wait() -> None:
    call = _call("rank0", "rank1")  # rank 0 still waits in a collective; rank 1 failed
    oom = Failure(stage=Stage.SAMPLING, kind=FailureKind.OUT_OF_MEMORY, error="OutOfMemoryError: CUDA out of memory",
                  rank=1)
    ex = _executor({"rank1": Reply(rank=1, failure=oom)})
    assert ex.wait([call], timeout_s=0.0) == [call]


def test_a_rank_whose_actor_died_ends_the_wait() -> None:
    call = _call("rank0", "rank1")
    assert _executor({"rank1": RuntimeError("actor died")}).wait([call], timeout_s=0.0) == [call]


def test_a_rank_that_succeeded_waits_for_the_others() -> None:
    call = _call("rank0", "rank1")
    assert _executor({"rank1": Reply(rank=1)}).wait([call], timeout_s=0.0) == []
    both = {"rank0": Reply(rank=0), "rank1": Reply(rank=1)}
    assert _executor(both).wait([call], timeout_s=0.0) == [call]
