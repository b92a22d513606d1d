"""A lost node or a lost GCS, without Ray: the in-process executor plays the cluster, the GCS watch
probes a real socket. (Real Ray clusters losing a node or their GCS: test_ray_lost_node.py and
test_ray_lost_gcs.py.)

- A group whose node left the cluster fails as the cluster's fault even when other GPUs remain:
  its job goes back to pending uncharged.
- A GCS that refuses connections is noticed by probing its port (Ray's own calls would block), and
  once it has refused them for long enough the run ends: running jobs back to pending, uncharged,
  one paragraph naming the cluster and `resume`, exit 3; `resume` then finishes.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import jobs_by_name, write_batch

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.runner.cli import main as cli
from pan2render.runner.cluster import choose
from pan2render.runner.cluster.executor import Call, Group, GroupDied
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.cluster.ray_cluster import GcsLost, GcsWatch
from pan2render.runner.cluster.ray_executor import RayExecutor
from pan2render.runner.protocol.failures import FailureKind
from pan2render.runner.protocol.messages import SampleCall, WorkerCall, WorkerConfig
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

pytestmark = pytest.mark.timeout(60)
EXIT_ENVIRONMENT = 3


def _batch(tmp_path: Path) -> Path:
    return write_batch(tmp_path / "b.yaml", [{"name": f"j{i}", "prompt": f"clip {i}"} for i in range(3)],
                       defaults={"steps": 2, "frames": 5, "width": 32, "height": 32})


def _requeues(out: Path) -> list[str]:
    led = Ledger.open_readonly(out)
    try:
        return [e.detail for e in led.events() if e.label == "running->pending"]
    finally:
        led.close()


class _Cluster(LocalExecutor):
    """Job ``victim``'s first sample call finds its group's node gone (``lose``: "node", GPUs elsewhere
    remain) or the cluster's GCS gone (``lose``: "gcs": check_cluster raises from then on)."""

    def __init__(self, *, victim: str | None, lose: str, **kw: Any):
        super().__init__(**kw)
        self.victim, self.lose, self.gcs_lost = victim, lose, False

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        if isinstance(message, SampleCall) and message.spec.name == self.victim:
            self.victim = None
            if self.lose == "node":
                return Call(group=group, message=message, started=0.0, timeout_s=timeout_s,
                            handle=GroupDied("ActorDiedError: the actor died because its node has died",
                                             kind=FailureKind.CLUSTER_LOST))
            self.gcs_lost = True  # the call itself hangs: its worker went with the cluster
            return Call(group=group, message=message, started=0.0, timeout_s=1e9, handle=None)
        return super().call(group, message, timeout_s=timeout_s)

    def wait(self, calls: Any, *, timeout_s: float) -> list[Call]:
        return [c for c in super().wait(calls, timeout_s=timeout_s) if c.handle is not None]

    def check_cluster(self) -> None:
        if self.gcs_lost:
            raise GcsLost(f"{self.cluster} is gone: its GCS has refused connections for 30 s")


@pytest.fixture
def executors(monkeypatch: pytest.MonkeyPatch) -> list[_Cluster | LocalExecutor]:
    """`run`/`resume` take the next executor from this list (one per command)."""
    queue: list[_Cluster | LocalExecutor] = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(choose, "make_executor", lambda **_: queue.pop(0))
    return queue


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main([*args, "--no-progress"])
    err = capsys.readouterr().err
    print(f"$ pan2-render {' '.join(args)} -> {code}\n{err}", file=sys.__stdout__, flush=True)
    assert "Traceback" not in err
    return code, err


def _config() -> WorkerConfig:
    return WorkerConfig(pipeline_factory=FAKE_FACTORY)


def test_a_node_lost_while_other_gpus_remain_is_not_charged_to_its_job(
        tmp_path: Path, executors: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    executors.append(_Cluster(victim="j1", lose="node", gpus=1, config=_config()))
    out = tmp_path / "out"
    code, _ = _main(capsys, "run", str(_batch(tmp_path)), "--out", str(out))
    assert code == 0
    jobs = jobs_by_name(out)
    assert all(j.state is JobState.DONE for j in jobs.values())
    assert jobs["j1"].retries_left == 2 and jobs["j1"].attempts == 2  # started twice, charged nothing
    assert any("cluster lost" in d for d in _requeues(out))


def test_a_lost_gcs_ends_the_run_with_its_jobs_pending_then_resume_finishes(
        tmp_path: Path, executors: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    executors += [_Cluster(victim="j2", lose="gcs", gpus=1, config=_config()), LocalExecutor(gpus=1, config=_config())]
    out = tmp_path / "out"
    code, err = _main(capsys, "run", str(_batch(tmp_path)), "--out", str(out))
    assert code == EXIT_ENVIRONMENT
    assert "the in-process cluster is gone" in err and f"pan2-render resume {out}" in err
    jobs = jobs_by_name(out)
    # j2 was sampling (and an earlier job may still have been encoding): back to pending with its
    # budget; nothing is left "running", nothing charged.
    assert jobs["j2"].state is JobState.PENDING
    assert all(j.state in (JobState.DONE, JobState.PENDING) and j.retries_left == 2 for j in jobs.values())
    assert any("the cluster was lost" in d for d in _requeues(out))
    done = {n: j.attempts for n, j in jobs.items() if j.state is JobState.DONE}

    code, _ = _main(capsys, "resume", str(out))
    assert code == 0
    after = jobs_by_name(out)
    assert all(j.state is JobState.DONE for j in after.values())
    assert all(after[n].attempts == attempts for n, attempts in done.items())  # none redone


# ------------------------------------------------------------------------------- the GCS watch
def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _ray_executor(watch: GcsWatch, lost_after_s: float) -> RayExecutor:
    """A RayExecutor without a cluster: only its GCS checks are exercised."""
    ex = object.__new__(RayExecutor)
    ex._gcs, ex._gcs_lost_after_s, ex.cluster = watch, lost_after_s, f"the Ray cluster at {watch.address}"
    return ex


def test_a_gcs_that_refuses_connections_is_never_asked_and_ends_the_run() -> None:
    gcs = _listener()
    address = "127.0.0.1:%d" % gcs.getsockname()[1]
    watch = GcsWatch(address, period_s=0.05)
    ex = _ray_executor(watch, lost_after_s=0.2)
    try:
        assert watch.probe() and watch.down_for() == 0
        ex.check_cluster()  # up: nothing to say
        gcs.close()
        asked: list[str] = []
        # A Ray query with the GCS gone would block until Ray ends the process: it is not made.
        with pytest.raises(GcsLost, match="refuses connections"):
            ex._ask_gcs(lambda: asked.append("asked"))
        assert not asked
        while watch.down_for() < 0.2:
            watch.probe()
        with pytest.raises(GcsLost) as lost:
            ex.check_cluster()
        assert f"the Ray cluster at {address} is gone" in str(lost.value)
    finally:
        watch.stop()
        gcs.close()
