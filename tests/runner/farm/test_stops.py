"""Stopping samplings on the farm: a batch cancelled stops its running samplings at a step boundary
(not only its queued jobs), and a preempting batch stops one lower-priority sampling for its job,
never an equal-priority batch's and never a second one for the same job. The samplings run on
their groups' threads while the farm's loop goes on (a fake step of 0.05 s), as on Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
from runner_helpers import RecordingExecutor, ThreadedExecutor, farm_config, spec, step_until

from pan2render.jobs.ledger import Ledger
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import Batch, JobSpec
from pan2render.runner.farm.service import Farm
from pan2render.runner.protocol.messages import StopSamplingCall, WorkerConfig
from pan2render.runner.serve.session import BatchRequest
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

LONG = 200  # steps of a sampling that is still running when the farm stops it (10 s at 0.05 s a step)


class _Executor(RecordingExecutor, ThreadedExecutor):
    """Each group's GPU lane on a thread, every call recorded."""


@pytest.fixture(autouse=True)
def _slow_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAN2_FAKE_STEP_SECONDS", "0.05")


def _farm(tmp_path: Path, *, gpus: int) -> tuple[Farm, _Executor]:
    root = tmp_path / "farm"
    root.mkdir(exist_ok=True)
    ex = _Executor(gpus=gpus, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    return Farm(farm_config(root), ex, log=print), ex


def _submit(farm: Farm, out: Path, jobs: list[JobSpec], *, priority: int = 0, preempt: bool = False) -> str:
    request = BatchRequest(out_dir=out, batch=Batch(path="b.yaml", model="tiny", preset="tiny-preview", jobs=jobs),
                           overrides=Overrides())
    return farm.actions.submit(request, owner="ann", priority=priority, preempt=preempt)["id"]


def _sampling(farm: Farm, batch_id: str) -> list[str]:
    """The names of the batch's jobs whose sampling is in flight."""
    served = farm.served.get(batch_id)
    return [] if served is None else [r.job.name for r in farm.scheduler.running(served.batch) if r.sampling]


def _ended(farm: Farm) -> bool:
    return not farm.served and not farm.scheduler.busy


def _stops(ex: _Executor) -> list[str | None]:
    return [name for kind, name in ex.side_calls if kind is StopSamplingCall]


def _events(out: Path, name: str) -> list[str]:
    led = Ledger.open_readonly(out)
    try:
        job = next(j for j in led.jobs() if j.name == name)
        return [f"{e.label}: {e.detail}" for e in led.events(job.id)]
    finally:
        led.close()


def test_cancelling_a_batch_stops_its_running_sampling_at_a_step(tmp_path: Path) -> None:
    farm, ex = _farm(tmp_path, gpus=1)
    out = tmp_path / "out"
    b = _submit(farm, out, [spec("long", steps=LONG), spec("queued")])
    step_until(farm, lambda: _sampling(farm, b) == ["long"], "the long job sampling")
    farm.actions.cancel(b)
    step_until(farm, lambda: _ended(farm), "the batch ended")
    d = farm.describe(b)
    events = _events(out, "long")
    print(d["state"], d["counts"], _stops(ex), events[-3:])
    assert (d["state"], d["counts"]["cancelled"], d["counts"]["done"]) == ("cancelled", 2, 0)
    assert _stops(ex) == ["long"] and not list(out.glob("*/video.mp4"))
    stopped = [e for e in events if "sampling stopped at step" in e]
    assert stopped and int(stopped[0].rsplit("step ", 1)[1]) < LONG
    farm.close()


def test_an_equal_priority_batch_is_not_preempted(tmp_path: Path) -> None:
    farm, ex = _farm(tmp_path, gpus=1)
    low = _submit(farm, tmp_path / "low", [spec("low", steps=40)])
    step_until(farm, lambda: _sampling(farm, low) == ["low"], "the first batch sampling")
    same = _submit(farm, tmp_path / "same", [spec("same", steps=2)], preempt=True)
    step_until(farm, lambda: _ended(farm), "both batches ended")
    print(_stops(ex), [name for kind, name in ex.calls if kind.__name__ == "SampleCall"])
    assert _stops(ex) == [] and farm.describe(low)["counts"]["done"] == 1
    assert farm.describe(same)["counts"]["done"] == 1
    farm.close()


def test_a_waiting_job_preempts_one_lower_priority_sampling_not_two(tmp_path: Path) -> None:
    """Two GPUs, both sampling a low batch's jobs: the preempting job waits for the one it stopped,
    and the other low job, still sampling meanwhile, is left alone."""
    farm, ex = _farm(tmp_path, gpus=2)
    low = _submit(farm, tmp_path / "low", [spec("l1", steps=60), spec("l2", seed=1, steps=60)])
    step_until(farm, lambda: sorted(_sampling(farm, low)) == ["l1", "l2"], "both low jobs sampling")
    high = _submit(farm, tmp_path / "high", [spec("h1", steps=2)], priority=5, preempt=True)
    step_until(farm, lambda: _ended(farm), "both batches ended")
    stops = _stops(ex)
    print(stops, farm.describe(low)["counts"], farm.describe(high)["counts"])
    assert len(stops) == 1 and stops[0] in ("l1", "l2")
    assert any("preempted at step" in e for e in _events(tmp_path / "low", stops[0]))
    assert farm.describe(low)["counts"]["done"] == 2 and farm.describe(high)["counts"]["done"] == 1
    farm.close()
