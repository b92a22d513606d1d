"""Validating a batch is work in proportion to its jobs, counted at n and 4n jobs
(tests/op_count.py): a long sweep, many unnamed jobs of one prompt, a problem in every job. The
limit is 20,000 jobs a batch, where work per pair of jobs is 400x that of 1,000."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
from op_count import Counted, assert_linear, counts_at, grows_linearly

from pan2render.jobs.batch import load_batch
from pan2render.jobs.coerce import repeated
from pan2render.jobs.spec import BatchValidationError

HEADER = "model: tiny\npreset: tiny-preview\n"


def _files(tmp_path: Path) -> Callable[[str, str], Path]:
    names = itertools.count()

    def write(text: str, suffix: str = ".yaml") -> Path:
        path = tmp_path / f"f{next(names)}{suffix}"
        path.write_text(text)
        return path

    return write


def test_validating_a_sweep_grows_linearly_in_its_jobs(tmp_path: Path) -> None:
    write = _files(tmp_path)

    def make(n: int) -> Callable[[], object]:
        seeds = ", ".join(str(s) for s in range(n // 2))
        batch = write(HEADER + f"jobs:\n  - {{name: fox, prompt: a fox}}\n  - a paper lantern\n"
                               f"sweep:\n  seed: [{seeds}]\n")
        return lambda: load_batch(batch, check_model=False)

    assert_linear(make, 100, "validating a sweep over seed")


def test_unnamed_jobs_of_one_prompt_are_named_in_linear_work(tmp_path: Path) -> None:
    """A prompts file of one prompt under many seeds: its jobs are named after the prompt, with
    -2, -3, ... in file order, each name found without trying every name before it."""
    write = _files(tmp_path)

    def make(n: int) -> Callable[[], object]:
        prompts = write("".join(f'{{"prompt": "a fox in the snow", "seed": {i}}}\n' for i in range(n)), ".jsonl")
        batch = write(HEADER + f"prompts_file: {prompts.name}\n")
        return lambda: load_batch(batch, check_model=False)

    assert_linear(make, 100, "naming the jobs of one prompt")
    names = [j.name for j in make(4)().jobs]  # type: ignore[attr-defined]
    assert names == ["a-fox-in-the-snow", "a-fox-in-the-snow-2", "a-fox-in-the-snow-3", "a-fox-in-the-snow-4"]


def test_a_problem_in_every_job_is_listed_once_each_in_linear_work(tmp_path: Path) -> None:
    """Sampler dmd with 2 timesteps and a sweep over steps: every job breaks the rule with its own
    value, each listed once, without checking it against every problem listed before."""
    write = _files(tmp_path)

    def make(n: int) -> Callable[[], object]:
        steps = ", ".join(str(s) for s in range(3, n + 3))
        batch = write(HEADER + "defaults:\n  sampler: dmd\n  guidance: 1\n  timesteps: [999, 500]\n"
                               f"jobs:\n  - a fox\nsweep:\n  steps: [{steps}]\n")

        def load() -> None:
            with pytest.raises(BatchValidationError) as e:
                load_batch(batch, check_model=False)
            assert len(e.value.problems) == n

        return load

    assert_linear(make, 100, "listing a problem of every job")


def test_a_long_sweep_axis_is_checked_for_repeats_in_linear_work() -> None:
    assert repeated([3, 1, 2, 1, 3, 3]) == ["1", "3"] and repeated([0, 1, 2]) == []
    assert_linear(lambda n: lambda: repeated([Counted(i) for i in range(n)]), 100, "the sweep's check for repeats")


def test_the_count_sees_a_count_per_value() -> None:
    """Negative control: the check for repeats as it was (a count of each value in its axis)
    fails the same test: with values whose comparisons count, a C loop shows its pairs."""
    def old_repeated(values: list) -> list[str]:
        return sorted({repr(v) for v in values if values.count(v) > 1})

    small, large = counts_at(lambda n: lambda: old_repeated([Counted(i) for i in range(n)]), 100)
    assert not grows_linearly(small, large), (small, large)
