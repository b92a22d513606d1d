"""The farm and `after` (2 logical GPUs, the in-process executor, the fake pipeline): a failed
dependency fails the jobs after it with its reason and no work, a cancelled one cancels them, and
`retry` brings them back and runs them in order; the farm's API validates `after` as `run` does,
and says what a waiting job waits for (the batch's count, each job's names in the monitor's view).
The order is read from the ledger's events."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runner_helpers import RecordingExecutor, farm_config, serving_farm, spec, submit_file

from pan2render.client import FarmClient, FarmError
from pan2render.jobs.ledger import JobState, Ledger, StageState
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import Batch, JobSpec
from pan2render.media.video import png_bytes
from pan2render.runner.farm.service import Farm
from pan2render.runner.protocol.messages import SampleCall, WorkerConfig
from pan2render.runner.serve.metrics import FolderTally
from pan2render.runner.serve.session import BatchRequest
from pan2render.runner.views.report import batch_view
from pan2render.runner.views.status import status_document
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def _farm(tmp_path: Path, *, gpus: int = 2) -> tuple[Farm, RecordingExecutor]:
    root = tmp_path / "farm"
    root.mkdir(exist_ok=True)
    ex = RecordingExecutor(gpus=gpus, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    return Farm(farm_config(root), ex, log=lambda text: None), ex


def _submit(farm: Farm, out: Path, jobs: list[JobSpec]) -> str:
    """Queued and paused at once (the farm's loop runs only when the test steps it)."""
    request = BatchRequest(out_dir=out, batch=Batch(path="b.yaml", model="tiny", preset="tiny-preview", jobs=jobs),
                           overrides=Overrides())
    batch_id = farm.actions.submit(request, owner="ann")["id"]
    farm.actions.pause(batch_id, paused=True)
    return batch_id


def _serve_until_idle(farm: Farm, *, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while farm.served or farm.scheduler.busy:
        farm.step()
        assert time.monotonic() < deadline, "the farm did not finish its batches"


def _after(name: str, *names: str, **kw: Any) -> JobSpec:
    return dataclasses.replace(spec(name, **kw), after=names)


def _order(out: Path) -> list[tuple[str, str]]:
    """(job name, "start" or the state it ended in), in the ledger's order of events."""
    led = Ledger.open_readonly(out)
    try:
        names = {j.id: j.name for j in led.jobs()}
        return [(names[e.job_id], "start" if e.started else e.transition[1].value) for e in led.events()
                if e.transition is not None and (e.started or e.transition[1] in
                                                 (JobState.DONE, JobState.FAILED, JobState.CANCELLED))]
    finally:
        led.close()


def test_a_failed_dependency_fails_the_jobs_after_it_and_retry_runs_them_in_order(tmp_path: Path) -> None:
    image = tmp_path / "first.png"
    image.write_bytes(png_bytes(np.full((32, 48, 3), 90, np.uint8)))
    out = tmp_path / "out"
    farm, ex = _farm(tmp_path)
    b = _submit(farm, out, [spec("a", image=image), _after("b", "a"), spec("c")])
    image.rename(tmp_path / "moved.png")  # a's input is gone: it fails at once, deterministically
    farm.actions.pause(b, paused=False)
    _serve_until_idle(farm)
    d = farm.describe(b)
    led = Ledger.open_readonly(out)
    jobs = {j.name: j for j in led.jobs()}
    print(d["state"], {n: (j.state.value, j.error) for n, j in jobs.items()})
    assert d["state"] == "failed" and d["counts"]["failed"] == 2 and d["counts"]["done"] == 1
    assert jobs["b"].error == f"dependency a failed: sampling: {jobs['a'].error}"
    assert jobs["b"].attempts == 0 and all(r.state is StageState.PENDING for r in led.stages(jobs["b"].id).values())
    assert "b" not in [name for _, name in ex.calls]
    # Shown as failed at no stage (it never ran), with that reason, in status and the monitor's view.
    rows = {r["name"]: r for r in status_document(out, led)[0]["jobs"]}
    tile = next(t for t in batch_view(out).tiles.values() if t.name == "b")
    assert (rows["b"]["state"], rows["b"]["stage"], rows["b"]["error"]) == ("failed", None, jobs["b"].error)
    assert (tile.state, tile.stage, tile.error) == ("failed", None, jobs["b"].error)
    # Its ledger reason names its failure class, as the farm's metrics count it: dependency.
    ended = [e.detail for e in led.events(jobs["b"].id) if e.label == "pending->failed"]
    assert ended == [f"not started [dependency]: {jobs['b'].error}"]
    tally = FolderTally(out, [j.id for j in jobs.values()])
    tally.refresh()
    assert tally.counts(time.time()).failed == {"input": 1, "dependency": 1}
    led.close()

    (tmp_path / "moved.png").rename(image)
    farm.actions.retry(b)
    _serve_until_idle(farm)
    d = farm.describe(b)
    order = _order(out)
    print(order)
    assert d["state"] == "done" and d["counts"]["done"] == 3
    again = order[order.index(("b", "failed")) + 1:]  # the retry's events
    assert again.index(("b", "start")) > again.index(("a", "done")) and ("c", "start") not in again
    assert [name for kind, name in ex.calls if kind is SampleCall][-2:] == ["a", "b"]
    farm.close()


def test_a_cancelled_dependency_cancels_the_jobs_after_it_and_retry_runs_them(tmp_path: Path) -> None:
    out = tmp_path / "out"
    farm, _ = _farm(tmp_path)
    b = _submit(farm, out, [spec("a"), _after("b", "a"), _after("d", "b"), spec("c")])
    farm.actions.cancel(b, job="a")
    farm.actions.pause(b, paused=False)
    _serve_until_idle(farm)
    led = Ledger.open_readonly(out)
    jobs = {j.name: j for j in led.jobs()}
    reasons = {n: [e.detail for e in led.events(j.id) if e.label == "pending->cancelled"] for n, j in jobs.items()}
    led.close()
    print(reasons)
    assert {n: j.state for n, j in jobs.items()} == {"a": JobState.CANCELLED, "b": JobState.CANCELLED,
                                                     "d": JobState.CANCELLED, "c": JobState.DONE}
    assert reasons["b"] == ["dependency a was cancelled: cancelled by a client"]
    assert reasons["d"] == ["dependency b was cancelled: dependency a was cancelled: cancelled by a client"]
    farm.actions.retry(b)
    _serve_until_idle(farm)
    order = _order(out)
    assert farm.describe(b)["counts"]["done"] == 4
    assert order.index(("d", "start")) > order.index(("b", "done")) > order.index(("b", "start")) > \
        order.index(("a", "done"))
    farm.close()


def test_the_farms_api_refuses_a_bad_after_and_says_what_a_queued_job_waits_for(tmp_path: Path) -> None:
    with serving_farm(tmp_path, gpus=2) as (farm, url, token):
        client = FarmClient(url, token)
        with pytest.raises(FarmError) as refused:
            client.submit_dict({"model": "tiny", "preset": "tiny-preview",
                                "jobs": [{"name": "a", "prompt": "a"}, {"name": "b", "prompt": "b", "after": ["aa"]}]},
                               out=tmp_path / "bad", base=tmp_path)
        print(refused.value.problems)
        assert refused.value.status == 422 and not (tmp_path / "bad").exists()
        (problem,) = refused.value.problems
        assert problem.endswith("batch.yaml:1: jobs[1].after: no job named 'aa' in this batch (did you mean 'a'?); "
                                "allowed: the name of another job of this batch (its `name`, or the one derived "
                                "from its prompt)")

        out = tmp_path / "out"
        b = submit_file(farm, out, {"jobs": [{"name": "a", "prompt": "a"}, {"name": "b", "prompt": "b", "after": "a"}]},
                        paused=True)
        described = client.batch(b)
        req = urllib.request.Request(f"{url}/api/batches/{b}/view", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            view = json.loads(resp.read())
        tiles = {t["name"]: t for t in view["jobs"]}
        print(described["queued"], described["waiting"], {n: t["after"] for n, t in tiles.items()})
        assert (described["queued"], described["waiting"]) == (2, 1)
        assert tiles["b"]["after"] == ["a"] and tiles["a"]["after"] is None
        client.unpause(b)
        deadline = time.monotonic() + 60
        while client.batch(b)["state"] != "done":
            assert time.monotonic() < deadline, "the batch did not finish"
            time.sleep(0.05)
        order = _order(out)
        assert order.index(("b", "start")) > order.index(("a", "done"))
