"""The farm's commands as a user types them, against a farm in this process: `cancel BATCH JOB` of
a job that has already ended (done, failed or cancelled) says so, naming the job and its state,
changes nothing and exits 6, whether its batch is still served or has ended; a job still running is
cancelled (exit 0). `queue` names a batch's state as the monitor does (running, queued, paused;
never the queue's "active") and, bare, lists every batch not ended, a paused one too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import ThreadedExecutor, serving_farm, submit_file, until

from pan2render.jobs.ledger import Ledger
from pan2render.runner.cli import main as cli
from pan2render.runner.cli.common import EXIT_ALREADY_ENDED, EXIT_OK
from pan2render.runner.farm.folder import INFO_NAME, write_private
from pan2render.runner.farm.service import Farm

FAULTS = {"fail": {"job": "b", "stage": "sampling"},
          "slow_steps": {"job": "e", "seconds": 0.05}}  # e samples until it is cancelled


def _describe(farm: Farm, batch_id: str) -> dict[str, Any]:
    return farm.ask(lambda: farm.describe(batch_id)).result(timeout=30)


def _states(out: Path) -> dict[str, str]:
    led = Ledger.open_readonly(out)
    try:
        return {j.name: j.state.value for j in led.jobs()}
    finally:
        led.close()


def test_cancel_of_a_job_that_already_ended_says_so_and_changes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with serving_farm(tmp_path, faults=FAULTS, retries=0, executor=ThreadedExecutor) as (farm, url, token):
        root = tmp_path / "farm"
        write_private(root / INFO_NAME, json.dumps({"url": url, "pid": 0}).encode())  # as `farm start` writes it

        def cancel(batch: str, job: str) -> tuple[int, str]:
            code = cli.main(["cancel", batch, job, "--root", str(root)])
            return code, capsys.readouterr().err

        ended = submit_file(farm, tmp_path / "ended", {"jobs": [{"name": n, "prompt": n} for n in "abc"]}, paused=True)
        assert cancel(ended, "c")[0] == EXIT_OK
        farm.ask(lambda: farm.actions.pause(ended, paused=False)).result(timeout=30)
        until(lambda: _describe(farm, ended)["state"] == "failed", "the batch to end")
        before = _states(tmp_path / "ended")
        assert before == {"a": "done", "b": "failed", "c": "cancelled"}
        for job, state in before.items():
            code, err = cancel(ended, job)
            print(err)
            assert code == EXIT_ALREADY_ENDED
            assert f"job {job} ({job}-" in err and f"of batch {ended} is already {state}: nothing to cancel" in err
            assert "error" not in err
        assert _states(tmp_path / "ended") == before and _describe(farm, ended)["state"] == "failed"

        served = submit_file(farm, tmp_path / "served", {"jobs": [{"name": "d", "prompt": "d", "steps": 2},
                                                                  {"name": "e", "prompt": "e", "steps": 400}]})
        until(lambda: _states(tmp_path / "served") == {"d": "done", "e": "running"}, "d done, e running")
        code, err = cancel(served, "d")
        assert code == EXIT_ALREADY_ENDED and "job d (d-" in err and "is already done" in err
        assert cancel(served, "e")[0] == EXIT_OK  # still running: cancelled
        until(lambda: _describe(farm, served)["state"] == "cancelled", "the second batch to end")
        assert _states(tmp_path / "served") == {"d": "done", "e": "cancelled"}


def test_queue_names_states_as_the_monitor_does_and_lists_paused_batches_bare(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU: a batch sampling is running, the one behind it queued (both "active" in the farm's
    queue), a paused one paused; an ended one only with `--all`."""
    monkeypatch.setenv("PAN2_FAKE_STEP_SECONDS", "0.05")
    with serving_farm(tmp_path, executor=ThreadedExecutor) as (farm, url, token):
        root = tmp_path / "farm"
        write_private(root / INFO_NAME, json.dumps({"url": url, "pid": 0}).encode())  # as `farm start` writes it

        def states(*flags: str) -> dict[str, str]:
            """batch id -> the state column of `queue`'s table."""
            assert cli.main(["queue", "--root", str(root), *flags]) == EXIT_OK
            out = capsys.readouterr().out
            print(out)
            rows = [cells for cells in map(str.split, out.splitlines()) if cells and cells[0][1:].isdigit()]
            return {cells[0]: cells[3] for cells in rows}

        ended = submit_file(farm, tmp_path / "ended", {"jobs": [{"name": "quick", "prompt": "q", "steps": 2}]})
        until(lambda: _describe(farm, ended)["state"] == "done", "the first batch to end")
        running = submit_file(farm, tmp_path / "running", {"jobs": [{"name": "long", "prompt": "l", "steps": 400}]})
        waiting = submit_file(farm, tmp_path / "waiting", {"jobs": [{"name": "next", "prompt": "n", "steps": 2}]})
        paused = submit_file(farm, tmp_path / "paused", {"jobs": [{"name": "held", "prompt": "h"}]}, paused=True)
        until(lambda: _describe(farm, running)["running"], "the long job running")
        assert states() == {running: "running", waiting: "queued", paused: "paused"}
        assert states("--all") == {ended: "done", running: "running", waiting: "queued", paused: "paused"}
        farm.ask(lambda: farm.actions.cancel(running)).result(timeout=30)  # (its sampling stops at its next step)
        until(lambda: _describe(farm, running)["state"] == "cancelled", "the long batch to end")
