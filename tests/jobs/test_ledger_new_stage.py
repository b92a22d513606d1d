"""A ledger recorded before the interpolate stage existed (four stage rows a job, no `stages` meta)
gets that stage's row for each job when a writer opens it: done where decode is done, else pending;
its done jobs stay done and its unfinished ones run through the whole flow."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runner"))
from runner_helpers import render, spec

from pan2render.jobs.ledger import EventKind, JobState, Ledger, Stage, StageState


def test_an_old_ledger_gets_the_interpolate_stage_and_runs_on(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done, later = spec("done"), spec("later")
    render(out, [done])[2].close()
    led = Ledger.open(out)
    led.add_jobs([later], retries=1)
    led.close()
    # As the version before the stage wrote it: no interpolate rows.
    with sqlite3.connect(out / "ledger.sqlite") as conn:
        conn.execute("DELETE FROM stages WHERE stage = 'interpolate'")
    old = Ledger.open_readonly(out)
    assert Stage.INTERPOLATE not in old.stages(done.job_id)  # a reader reads it as it is
    old.close()

    led = Ledger.open(out)
    assert led.stages(done.job_id)[Stage.INTERPOLATE].state is StageState.DONE
    assert led.stages(later.job_id)[Stage.INTERPOLATE].state is StageState.PENDING
    assert list(led.stages(later.job_id)) == list(Stage)
    added = [e for e in led.events() if e.kind is EventKind.STAGE_ADDED]
    assert len(added) == 1 and "interpolate" in added[0].detail
    led.close()
    Ledger.open(out).close()  # once only
    again = Ledger.open_readonly(out)
    assert len([e for e in again.events() if e.kind is EventKind.STAGE_ADDED]) == 1
    again.close()

    summary, ex, led = render(out, [done, later])
    assert sorted(summary.done) == sorted([done.job_id, later.job_id])
    assert {j.id: j.state for j in led.jobs()} == {done.job_id: JobState.DONE, later.job_id: JobState.DONE}
    # The done one is not run again: the later one's sample, decode and collect only.
    assert [n for _, n in ex.calls if n is not None] == ["later"] * 3
