"""Jobs that run after other jobs: a job entry's ``after: [name, ...]``.

What a name stands for: a job entry of the same batch, by its ``name`` (given, or derived from its
prompt), and so every job that entry makes: with a sweep, each of its sweep combinations. A job
that runs ``after: [fox]`` starts once every job named ``fox`` is done (its video written and
checked); a job that is itself swept waits, in each of its combinations, for all of them, not for
the one of the same values. One sweep combination cannot be named (``fox-seed1`` is refused with
the entry's name to write instead): a batch's sweep applies to every entry, so "the matching one"
would be a guess. Names of other batches are refused too: dependencies do not cross batches.

Here: the batch's check of its entries' ``after`` (:func:`check_after`: unknown names with a
did-you-mean, a job waiting for itself, jobs waiting for each other in a cycle, each with its
file:line), and what a folder's jobs wait for (:func:`unfinished`, :func:`waiting_for`), which the
scheduler (``runner/serve/waits.py``) and the views (``status``, the report, the farm's monitor)
share. Counted per name, not per pair of jobs: a swept entry of 1,000 jobs after another of 1,000
is 1,000 + 1,000 counts, not a million edges.

``after`` is scheduling, not content: it is not in the job id, so adding or editing it keeps
every job's id (and a done job done).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from pan2render.jobs.coerce import did_you_mean
from pan2render.jobs.context import LoadContext, RawJob
from pan2render.jobs.ledger import JobRecord, JobState, superseded
from pan2render.jobs.spec import SourceLocation


def check_after(raw_jobs: list[RawJob], sweep: Mapping[str, list[Any]], ctx: LoadContext) -> None:
    """Every entry's ``after`` names other entries of the batch, and no entries wait for each
    other in a cycle; each problem noted with the ``after`` line it is about. Runs once the
    entries are named (``expansion.name_jobs``)."""
    entries = {raw.fields["name"]: raw for raw in raw_jobs if "name" in raw.fields}
    graph: dict[str, tuple[str, ...]] = {}
    for raw in raw_jobs:
        own = raw.fields.get("name")
        good = []
        for target in raw.fields.get("after", ()):
            if target == own:
                _note(ctx, raw, f"{target!r} is this job itself; allowed: other jobs of the batch (a job cannot "
                                f"wait for its own video)")
            elif target not in entries:
                _note(ctx, raw, _unknown(target, entries, sweep))
            else:
                good.append(target)
        if own is not None and good:
            graph[own] = tuple(good)
    for cycle in cycles(graph, order=list(entries)):
        first = entries[cycle[0]]
        steps = ", which runs after ".join(f"{name!r} ({_where(entries[name])})" for name in cycle)
        _note(ctx, first, f"these jobs wait for each other in a cycle, so none of them could ever start: "
                          f"{steps}, which runs after {cycle[0]!r}; allowed: jobs that do not wait for each "
                          f"other in a circle: drop one of these `after` names")


def _where(raw: RawJob) -> SourceLocation:
    return SourceLocation(raw.location.file, raw.lines.get("after", raw.location.line))


def _note(ctx: LoadContext, raw: RawJob, message: str) -> None:
    where = _where(raw)
    ctx.problem(where.line, f"{raw.label}.after", message, where.file)


def _unknown(target: str, entries: Mapping[str, RawJob], sweep: Mapping[str, list[Any]]) -> str:
    """Why ``target`` names no job of the batch: one combination of a swept entry (say which entry
    to name), else a did-you-mean among the entries' names."""
    allowed = "the name of another job of this batch (its `name`, or the one derived from its prompt)"
    swept = [name for name in entries if sweep and target.startswith(name + "-")]
    if swept:
        name = max(swept, key=len)
        n = 1
        for values in sweep.values():
            n *= len(values)
        return (f"{target!r} looks like one sweep combination of job {name!r}, whose sweep ({', '.join(sweep)}) makes "
                f"{n} jobs; `after` names a job as the batch writes it and waits for every job its sweep makes: "
                f"write {name!r}; allowed: {allowed}")
    return f"no job named {target!r} in this batch{did_you_mean(target, list(entries))}; allowed: {allowed}"


def cycles(graph: Mapping[str, Iterable[str]], *, order: list[str]) -> list[list[str]]:
    """The cycles of ``graph`` (name -> the names it runs after): one per edge that closes a
    cycle in a depth-first walk in ``order``, each from its member first in ``order`` (so a
    message reads as the batch is written): ``[a, b, c]`` for a after b after c after a. Iterative:
    a chain of thousands of entries is no deeper for it."""
    rank = {name: i for i, name in enumerate(order)}
    found: list[list[str]] = []
    state: dict[str, bool] = {}  # name -> still on the walk's path (False: finished)
    for root in order:
        if root in state:
            continue
        path, at = [root], {root: 0}
        stack = [iter(graph.get(root, ()))]
        state[root] = True
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                state[path[-1]] = False
                del at[path.pop()]
            elif state.get(nxt):  # on the path: the walk came back to it
                cycle = path[at[nxt]:]
                first = min(range(len(cycle)), key=lambda i: rank.get(cycle[i], len(rank)))
                found.append(cycle[first:] + cycle[:first])
            elif nxt not in state:
                state[nxt] = True
                at[nxt] = len(path)
                path.append(nxt)
                stack.append(iter(graph.get(nxt, ())))
    return found


def unfinished(jobs: Iterable[JobRecord]) -> Counter[str]:
    """Name -> how many of its jobs are not done, counting the newest version of each (an older
    version an edited batch superseded is no one's dependency)."""
    jobs = list(jobs)
    old = superseded(jobs)
    return Counter(j.name for j in jobs if j.id not in old and j.state is not JobState.DONE)


def waiting_for(jobs: Iterable[JobRecord]) -> dict[str, list[str]]:
    """Each pending job that cannot start yet -> the names in its ``after`` with jobs not done."""
    jobs = list(jobs)
    left = unfinished(jobs)
    waits = {}
    for job in jobs:
        if job.state is JobState.PENDING and (names := [n for n in job.spec.after if left[n]]):
            waits[job.id] = names
    return waits
