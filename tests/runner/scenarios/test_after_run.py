"""`after` through the CLI on real Ray actors (2 CPUs, 2 logical GPUs, the fake pipeline): `run`
keeps the order and fails the jobs after a failed dependency without running them, `status` says
so, and `resume` brings them back and runs them in order. The order is read from the ledger's
events. (The scheduler's own tests, on the in-process executor: tests/runner/serve/test_waits.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.runner.cli import main as cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    import ray

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, object_store_memory=256 << 20,
             logging_level="WARNING")
    yield
    ray.shutdown()


def _order(out: Path) -> list[tuple[str, str]]:
    led = Ledger.open_readonly(out)
    try:
        names = {j.id: j.name for j in led.jobs()}
        return [(names[e.job_id], "start" if e.started else e.transition[1].value) for e in led.events()
                if e.transition is not None and (e.started or e.transition[1] in (JobState.DONE, JobState.FAILED))]
    finally:
        led.close()


def test_run_fails_the_jobs_after_a_failed_one_and_resume_runs_them_in_order(
        tmp_path: Path, fake_pipeline: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "a"},
                                              {"name": "b", "prompt": "b", "after": ["a"]},
                                              {"name": "c", "prompt": "c"}],
                        defaults={"steps": 2, "frames": 9})
    out = tmp_path / "out"
    # a's sampling raises a deterministic error (the input class: failed at once, not retried).
    monkeypatch.setenv("PAN2_RENDER_FAULTS", json.dumps({"fail": {"job": "a", "raise": "JobInputError"}}))
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == 1
    capsys.readouterr()
    assert cli.main(["status", str(out), "--json"]) == 1
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["jobs"]}
    print(json.dumps(rows["b"], indent=1))
    assert rows["a"]["state"] == "failed" and rows["c"]["state"] == "done"
    assert rows["b"]["state"] == "failed" and rows["b"]["attempts"] == 0 and rows["b"]["stage"] is None
    assert rows["b"]["error"] == f"dependency a failed: sampling: {rows['a']['error']}"
    assert "injected failure in sampling of job a" in rows["b"]["error"]

    monkeypatch.delenv("PAN2_RENDER_FAULTS")
    assert cli.main(["resume", str(out), "--no-progress"]) == 0
    order = _order(out)
    print(order)
    again = order[order.index(("b", "failed")) + 1:]
    assert again.index(("b", "start")) > again.index(("a", "done")) and ("c", "start") not in again
