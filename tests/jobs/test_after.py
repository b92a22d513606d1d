"""`after:` in a batch: what a name stands for (a swept entry: every job its sweep makes), the
refusals (an unknown name, a job waiting for itself, a cycle, one sweep combination named, a name
given twice), each with file:line and the field, and that `after` changes no job id."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pan2render.jobs import BatchValidationError, Problem, load_batch
from pan2render.jobs.after import cycles, waiting_for
from pan2render.jobs.ledger import JobEvent, Ledger


def _write(folder: Path, text: str) -> Path:
    path = folder / "batch.yaml"
    path.write_text("model: tiny\npreset: tiny-preview\n" + textwrap.dedent(text).lstrip("\n"))
    return path


def _problems(path: Path) -> list[Problem]:
    with pytest.raises(BatchValidationError) as info:
        load_batch(path)
    print(f"\n{info.value}")  # what the user sees
    return info.value.problems


def test_an_unknown_name_is_refused_with_its_line_and_the_close_name(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        jobs:
          - {name: fox, prompt: a fox}
          - name: harbour
            prompt: a harbour
            after: [fxo]
        """)
    (problem,) = _problems(path)
    assert str(problem.location) == f"{path}:7" and problem.field == "jobs[1].after"
    assert "no job named 'fxo' in this batch (did you mean 'fox'?)" in problem.message
    assert "allowed: the name of another job of this batch" in problem.message


def test_a_job_after_itself_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        jobs:
          - name: fox
            prompt: a fox
            after: fox
        """)
    (problem,) = _problems(path)
    assert str(problem.location) == f"{path}:6" and problem.field == "jobs[0].after"
    assert "'fox' is this job itself" in problem.message and "allowed: other jobs of the batch" in problem.message


def test_a_cycle_of_three_is_refused_naming_each_job_where_it_waits_in_order(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        jobs:
          - {name: free, prompt: nothing to wait for}
          - name: a
            prompt: first
            after: [c]
          - name: b
            prompt: second
            after: [a, free]
          - name: c
            prompt: third
            after: [b]
        """)
    (problem,) = _problems(path)
    # Reported once, at the `after` of the cycle's job first in the file, in the order they wait.
    assert str(problem.location) == f"{path}:7" and problem.field == "jobs[1].after"
    assert (f"'a' ({path}:7), which runs after 'c' ({path}:13), which runs after 'b' ({path}:10), which runs "
            f"after 'a'") in problem.message
    assert "cycle" in problem.message and "drop one of these `after` names" in problem.message


def test_a_name_given_twice_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        jobs:
          - {name: fox, prompt: a fox}
          - {name: owl, prompt: an owl, after: [fox, fox]}
        """)
    (problem,) = _problems(path)
    assert str(problem.location) == f"{path}:5" and problem.field == "jobs[1].after"
    assert "names 'fox' more than once" in problem.message


def test_after_is_a_job_field_only(tmp_path: Path) -> None:
    """Every job of the batch waiting for one name would include that job itself: `after` is not a
    default (nor a --set, nor a sweep axis)."""
    path = _write(tmp_path, """
        defaults:
          after: [fox]
        jobs:
          - {name: fox, prompt: a fox}
        """)
    (problem,) = _problems(path)
    assert problem.field == "defaults.after" and "unknown key 'after'" in problem.message


def test_a_swept_name_stands_for_every_job_of_its_sweep_and_one_combination_is_refused(tmp_path: Path) -> None:
    """The sweep applies to every entry: `after: [fox]` waits for each of fox's jobs, in every
    combination of the waiting entry too; naming one combination (as status shows it) is refused
    with the entry's name to write."""
    path = _write(tmp_path, """
        jobs:
          - {name: fox, prompt: a fox}
          - {name: owl, prompt: an owl, after: [fox]}
        sweep:
          seed: [1, 2]
        """)
    batch = load_batch(path)
    owls = [j for j in batch.jobs if j.name == "owl"]
    assert len(owls) == 2 and all(j.after == ("fox",) for j in owls)
    # In a ledger with one fox done and one not, both owls still wait (for fox, as a whole).
    (tmp_path / "out").mkdir()
    led = Ledger.open(tmp_path / "out")
    led.add_jobs(batch.jobs, retries=0)
    fox1 = next(j for j in batch.jobs if j.name == "fox" and j.seed == 1)
    led.transition(fox1.job_id, JobEvent.START, reason="test")
    led.transition(fox1.job_id, JobEvent.FINISH, reason="test")
    waits = waiting_for(led.jobs())
    assert sorted(waits) == sorted(j.job_id for j in owls) and set(map(tuple, waits.values())) == {("fox",)}

    bad = _write(tmp_path, """
        jobs:
          - {name: fox, prompt: a fox}
          - {name: owl, prompt: an owl, after: [fox-seed1]}
        sweep:
          seed: [1, 2]
        """)
    (problem,) = _problems(bad)
    assert problem.field == "jobs[1].after"
    assert ("'fox-seed1' looks like one sweep combination of job 'fox', whose sweep (seed) makes 2 jobs"
            in problem.message)
    assert "write 'fox'" in problem.message


def test_after_changes_no_job_id(tmp_path: Path) -> None:
    """Scheduling, not content: the same jobs with and without `after` have the same ids (a done job
    stays done when an `after` is added to its batch)."""
    plain = load_batch(_write(tmp_path, """
        jobs:
          - {name: fox, prompt: a fox}
          - {name: owl, prompt: an owl}
        sweep:
          seed: [1, 2]
        """))
    ordered = load_batch(_write(tmp_path, """
        jobs:
          - {name: fox, prompt: a fox}
          - {name: owl, prompt: an owl, after: fox}
        sweep:
          seed: [1, 2]
        """))
    assert [j.job_id for j in plain.jobs] == [j.job_id for j in ordered.jobs]
    assert [j.after for j in ordered.jobs] == [(), (), ("fox",), ("fox",)]


def test_an_unnamed_job_is_named_by_its_derived_name(tmp_path: Path) -> None:
    batch = load_batch(_write(tmp_path, """
        jobs:
          - A red fox trots through fresh snow at dawn.
          - {prompt: an owl, after: [a-red-fox-trots-through-fresh]}
        """))
    assert batch.jobs[1].after == ("a-red-fox-trots-through-fresh",)


def test_cycles_are_found_without_recursion_in_a_long_chain() -> None:
    n = 5000  # deeper than Python's recursion limit
    graph = {f"j{i}": [f"j{i + 1}"] for i in range(n)} | {f"j{n}": ["j0"]}
    (cycle,) = cycles(graph, order=[f"j{i}" for i in range(n + 1)])
    assert cycle[0] == "j0" and len(cycle) == n + 1
    assert cycles({"a": ["b"], "b": []}, order=["a", "b"]) == []
