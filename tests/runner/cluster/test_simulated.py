"""The simulated executor (cluster/simulated.py) and the farm's scheduler on it, on a virtual clock
(deterministic: no wall time is measured or asserted): its calls take the cost model's times in
each group's lane order, a node that leaves takes its groups with it; and 2,000 jobs on 64
virtual GPUs, with injected call failures, worker deaths and a node lost mid-run, each end done or
failed as serve/retry.py's rules say, none twice, with the GPUs busy."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from runner_helpers import spec

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import Batch, JobSpec
from pan2render.runner.cluster.executor import GroupDied
from pan2render.runner.cluster.sim_model import CostModel, FaultPlan, NodeLoss
from pan2render.runner.cluster.simulated import SimulatedExecutor
from pan2render.runner.farm.config import FarmConfig
from pan2render.runner.farm.service import Farm
from pan2render.runner.protocol.failures import FailureKind
from pan2render.runner.protocol.messages import (
    CollectCall,
    DecodeCall,
    EncodePromptsCall,
    LoadCall,
    SampleCall,
    StopSamplingCall,
)
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.session import BatchRequest

RETRIES = 2


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    """A folder on tmpfs where there is one: thousands of jobs' SQLite commits then cost CPU, not
    the disk's fsyncs (what this measures is the scheduler's decisions)."""
    if not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="pan2-sim-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def dmd(name: str, *, seed: int = 0) -> JobSpec:
    """A 3-step DMD job (5.5 s of GPU work in the cost model), at the tiny model's size."""
    return JobSpec(**{**spec(name, seed=seed).to_dict(), "sampler": "dmd", "guidance": 1.0,
                      "timesteps": (1000, 757, 522), "steps": None})


# ---------------------------------------------------------------------- the executor alone
def test_calls_end_after_their_cost_one_after_the_other_on_the_gpu_lane() -> None:
    costs = CostModel(spread=0.0)
    ex = SimulatedExecutor(nodes=[2], costs=costs)
    group = ex.create_group(1, timeout_s=1)
    job = dmd("a")
    load = ex.call(group, LoadCall(model="tiny"), timeout_s=60)
    sample = ex.call(group, SampleCall(model="tiny", job_id=job.job_id, spec=job, prompt_embeds=b"",
                                       negative_embeds=b""), timeout_s=60)
    assert ex.wait([load, sample], timeout_s=1) == [load]
    assert ex.clock.now() == pytest.approx(costs.load_s)
    group.loads["tiny"] = ex.result(load).value
    assert ex.wait([sample], timeout_s=1) == [sample]  # queued behind the load: 3 unguided steps after it
    assert ex.clock.now() == pytest.approx(costs.load_s + 3 * costs.step_s)
    decode = ex.call(group, DecodeCall(model="tiny", job_id=job.job_id, spec=None, latents=b""), timeout_s=60)
    assert ex.wait([decode], timeout_s=1) == [decode]
    collect = ex.call(group, CollectCall(job_id=job.job_id), timeout_s=60)
    assert ex.wait([collect], timeout_s=1) == [collect]  # the encode, which began as the decode ended
    assert ex.clock.now() == pytest.approx(costs.load_s + 3 * costs.step_s + costs.decode_s + costs.encode_s)
    assert len(ex.result(collect).value.mp4) > 0
    # Every GPU-lane second of the one busy GPU (the other never ran a call: no steady state).
    assert ex.record.busy_fraction(0.0, costs.load_s + 3 * costs.step_s + costs.decode_s) == pytest.approx(0.5)
    assert ex.record.busy_fraction() is None


def test_a_node_that_leaves_takes_its_groups_calls_as_cluster_lost_and_comes_back_free() -> None:
    ex = SimulatedExecutor(nodes=[2, 2], costs=CostModel(spread=0.0),
                           faults=FaultPlan(node_losses=(NodeLoss(at_s=5.0, node=0, back_after_s=10.0),)))
    a, b = ex.create_group(2, timeout_s=1), ex.create_group(2, timeout_s=1)
    on_a, on_b = (ex.call(g, LoadCall(model="tiny"), timeout_s=60) for g in (a, b))
    assert ex.wait([on_a, on_b], timeout_s=1) == [on_a]  # at 5 s, before either load ends
    with pytest.raises(GroupDied) as died:
        ex.result(on_a)
    assert died.value.kind is FailureKind.CLUSTER_LOST
    assert (ex.total_gpus(), ex.max_group_size()) == (2, 2)
    ex.destroy_group(a)
    assert ex.wait([on_b], timeout_s=1) == [on_b] and ex.result(on_b).ok
    stop = ex.call(b, StopSamplingCall(job_id="x"), timeout_s=60)
    ex.wait([stop], timeout_s=1)
    ex.clock.wait_until(15.0, timeout_s=1)  # the node is back, its GPUs free
    ex.wait([ex.call(b, EncodePromptsCall(model="tiny", texts=("a",)), timeout_s=60)], timeout_s=1)
    assert ex.total_gpus() == 4 and ex.create_group(2, timeout_s=1).handle.node == 0
    assert [(f.what, f.stage) for f in ex.record.faults] == [("lost", "conditioning")]


# ---------------------------------------------------------------------- the farm on 64 GPUs
def _charged(detail: str) -> tuple[str, str, str] | None:
    """(stage, class, message) of a failure a transition's reason records as charged (retried or
    failed: "sampling failed [unknown], ...: message"); None for an uncharged one."""
    m = re.match(r"(\S+) failed \[([a-z-]+)\][, ]", detail)
    if m is None:
        return None
    message = detail.split("retries left after this one: ", 1)[-1] if "retries left" in detail \
        else detail.split("): ", 1)[-1]
    return m.group(1), m.group(2), message


def _expected(failures: list[tuple[str, str, str]]) -> list[str]:
    """What serve/retry.py's table says of a job's charged failures, in order, restated: an input
    failure fails it; the same error (its first line, numbers blanked) twice in a row in the same
    stage fails it; a spent budget fails it; else it is retried, one retry spent."""
    out, last, left = [], None, RETRIES
    for stage, kind, message in failures:
        signature = f"{stage}:{re.sub(r'0x[0-9a-f]+|[0-9]+', '#', message.strip().splitlines()[0])}"
        repeated, last = signature == last, signature
        if kind == "input" or repeated or left <= 0:
            out.append("failed")
        else:
            out.append("pending")
            left -= 1
    return out


def test_2000_jobs_on_64_gpus_end_as_the_retry_rules_say_none_twice_the_gpus_busy(folder: Path) -> None:
    faults = FaultPlan(call_failure_rate=0.01, worker_death_rate=0.002,
                       node_losses=(NodeLoss(at_s=60.0, node=3),))  # 8 of the 64 GPUs, a third of the way
    ex = SimulatedExecutor(nodes=[8] * 8, faults=faults, seed=7)
    (folder / "farm").mkdir()
    farm = Farm(FarmConfig(root=folder / "farm", poll_s=0.01, serving=ServingConfig(retries=RETRIES)), ex,
                log=lambda text: None)
    outs = [folder / f"batch{b}" for b in range(4)]
    for b, out in enumerate(outs):
        jobs = [dmd(f"b{b}j{i:03d}", seed=i) for i in range(500)]
        farm.actions.submit(BatchRequest(out_dir=out, batch=Batch(path=f"b{b}.yaml", model="tiny",
                                                                  preset="tiny-preview", jobs=jobs),
                                         overrides=Overrides()), owner=f"user{b % 2}")
    for _ in range(200_000):  # (a bound, far above the passes needed)
        if not (farm.served or farm.scheduler.busy):
            break
        farm.step()
    rows = farm.queue.batches()
    farm.close()

    assert {r.state.value for r in rows} <= {"done", "failed"}, [(r.id, r.state, r.reason) for r in rows]
    summary = ex.record.summary()
    print(summary)
    assert summary["faults"]["lost"] >= 1 and summary["faults"]["failure"] >= 10 and summary["faults"]["death"] >= 1
    assert ex.record.twice == []  # no job ever had calls in flight on two groups
    states, requeued, charged_by_sim = {}, 0, {}
    for f in ex.record.faults:
        if f.job_id is not None and f.what != "lost":
            charged_by_sim[f.job_id] = charged_by_sim.get(f.job_id, 0) + 1
    for out in outs:
        ledger = Ledger.open_readonly(out)
        try:
            for job in ledger.jobs():
                ends = [e for e in ledger.events(job.id) if e.transition and e.transition[0] is JobState.RUNNING]
                assert [e.label for e in ends].count("running->done") <= 1, f"{job.name} finished twice"
                failures = [(c, e.transition[1].value) for e in ends if (c := _charged(e.detail))]
                requeues = [e for e in ends if e.label == "running->pending" and _charged(e.detail) is None]
                assert all("[cluster-lost]" in e.detail or "cluster lost" in e.detail for e in requeues), requeues
                requeued += len(requeues)
                assert [to for _, to in failures] == _expected([c for c, _ in failures]), (job.name, failures)
                assert len(failures) >= charged_by_sim.get(job.id, 0), (  # every fault the job met, recorded
                    [f for f in ex.record.faults if f.job_id == job.id], [e.detail[:160] for e in ends])
                assert job.state is (JobState.FAILED if failures and failures[-1][1] == "failed" else JobState.DONE)
                assert job.attempts == len(ends)
                states[job.id] = job.state
        finally:
            ledger.close()
    assert len(states) == 2000 and requeued >= 1
    assert sum(s is JobState.FAILED for s in states.values()) < 40  # a few: the same fault twice in a row
    assert summary["busy_steady"] >= 0.95
