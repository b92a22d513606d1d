"""The views of a whole batch do work in proportion to its jobs, counted at n and 4n jobs
(tests/op_count.py): the plan that `validate` and `run --dry-run` print, the ETA from this
machine's history, and `status` of a folder a run is serving. A 20,000-job batch (the limit) is
400x the work of 1,000 jobs where it grows with their square."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path

from op_count import assert_linear, counts_at, grows_linearly
from runner_helpers import write_batch

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import EventKind, FolderLock, JobEvent, Ledger
from pan2render.jobs.spec import JobSpec
from pan2render.runner.views.estimates import CPU, History, JobSize, Sample, StageTimes, plan
from pan2render.runner.views.report import batch_view
from pan2render.runner.views.status import format_status
from pan2render.tiny_dit import TINY_MODEL


def _jobs(tmp_path: Path, n: int) -> list[JobSpec]:
    """``n`` jobs of the tiny model, one per seed (as a sweep over seed makes them)."""
    base = load_batch(write_batch(tmp_path / "one.yaml", [{"name": "fox", "prompt": "a fox"}])).jobs[0]
    return [dataclasses.replace(base, seed=i, sweep={"seed": i}) for i in range(n)]


def test_the_plan_of_a_batch_grows_linearly_in_its_jobs(tmp_path: Path) -> None:
    """Every job guessed from the reference table (no run here yet), on 2 GPUs."""
    def make(n: int) -> Callable[[], object]:
        jobs = _jobs(tmp_path, n)
        return lambda: plan(jobs, gpus=2, device=CPU, history=History())

    assert_linear(make, 100, "the plan of a batch guessed from the reference table")


def test_a_plan_from_this_machines_history_fits_it_once(tmp_path: Path) -> None:
    """A folder of n done jobs estimates n more: the cost model is fitted to the history once per
    model, not once per job (n fits of n samples each)."""
    def make(n: int) -> Callable[[], object]:
        jobs = _jobs(tmp_path, n)
        size = JobSize.of(jobs[0])
        samples = [Sample(size, StageTimes(0.03, 0.5 + i * 1e-3, 0.05, 0.02)) for i in range(n)]
        history = History(samples={(TINY_MODEL, CPU): samples})
        return lambda: plan(jobs, gpus=2, device=CPU, history=history)

    assert_linear(make, 50, "the plan of a batch from this machine's history")
    jobs = _jobs(tmp_path, 3)
    history = History(samples={(TINY_MODEL, CPU): [Sample(JobSize.of(jobs[0]), StageTimes(0.1, 1.0, 0.2, 0.1))]})
    measured = plan(jobs, gpus=1, device=CPU, history=history)
    assert [e.source for e in measured.estimates] == ["history"] * 3 and measured.spread == (1.0, 1.0)


def test_the_count_catches_work_per_pair_of_jobs(tmp_path: Path) -> None:
    """Negative control: the plan's old sum of the guesses' range, which asked of each estimate
    whether it was in the list of guesses (JobSpec comparisons, pair by pair), fails the check
    the plan passes; its result is the plan's own."""
    def old_range(estimates: list) -> tuple[float, float]:
        guessed = [e for e in estimates if e.source == "reference"]
        low = sum(e.gpu_seconds * (e.spread[0] if e in guessed else 1.0) for e in estimates)
        high = sum(e.gpu_seconds * (e.spread[1] if e in guessed else 1.0) for e in estimates)
        return low, high

    def make(n: int) -> Callable[[], object]:
        estimates = plan(_jobs(tmp_path, n), gpus=2, device=CPU, history=History()).estimates
        return lambda: old_range(estimates)

    small, large = counts_at(make, 100)
    assert not grows_linearly(small, large), (small, large)
    the_plan = plan(_jobs(tmp_path, 10), gpus=2, device=CPU, history=History())
    low, high = old_range(the_plan.estimates)
    assert the_plan.spread == (low / the_plan.gpu_seconds, high / the_plan.gpu_seconds)


def test_status_of_a_served_folder_grows_linearly_in_its_jobs(tmp_path: Path) -> None:
    """A folder a run holds (its lock), its groups loaded on this CPU, 4 jobs running and the rest
    pending: status lists every job and plans the ETA of those left."""
    folders = itertools.count()

    def make(n: int) -> Callable[[], object]:
        out = tmp_path / f"out{next(folders)}"
        out.mkdir()
        ledger = Ledger.open(out)
        try:
            ledger.record_batch({"path": "b.yaml"}, _jobs(tmp_path, n), retries=1)
            ledger.set_meta("runs", [{"command": "run", "started": time.time() - 60, "pid": os.getpid(),
                                      "host": "here", "flags": [], "gpus": 2}])
            ledger.log(None, EventKind.GROUP_LOAD, "group 1: model tiny on device cpu")
            for job in ledger.jobs()[:4]:
                ledger.transition(job.id, JobEvent.START, reason="test")
        finally:
            ledger.close()

        def status() -> str:
            with FolderLock(out):
                ledger = Ledger.open_readonly(out)
                try:
                    text, _ = format_status(out, ledger)
                finally:
                    ledger.close()
            return text

        return status

    assert_linear(make, 50, "status of a served folder")
    text = make(6)()
    assert "ETA ~" in text and "2 pending, 4 running" in text


def test_the_reports_grids_grow_linearly_in_their_rows(tmp_path: Path) -> None:
    """A sweep over seed and steps: one grid, a row per seed, a column per step count (each row
    header spanned the rows after it that share its value, counted row by row)."""
    folders = itertools.count()

    def make(n: int) -> Callable[[], object]:
        out = tmp_path / f"out{next(folders)}"
        out.mkdir()
        jobs = [dataclasses.replace(job, steps=steps, sweep={"seed": job.seed, "steps": steps})
                for job in _jobs(tmp_path, n // 2) for steps in (4, 8)]
        ledger = Ledger.open(out)
        try:
            ledger.record_batch({"path": "b.yaml"}, jobs, retries=1)
        finally:
            ledger.close()
        return lambda: batch_view(out, say=lambda line: None)

    # Counted in the report's own code, without slack: the specs' and the ledger's work per job
    # outweighs the spans' work per pair of rows at sizes a test runs.
    assert_linear(make, 50, "the report's grids", within="views/report.py", slack=1.0)
    grid = make(6)().grids[0]  # type: ignore[attr-defined]
    assert (grid.row_axes, grid.col_axis, grid.col_values) == (["seed"], "steps", ["4", "8"])
    assert [[h.text for h in r.headers] for r in grid.rows] == [["0"], ["1"], ["2"]]
