"""What the queued jobs of a served batch wait for: the jobs they run ``after`` (``jobs/after.py``
says what a name stands for). The scheduler starts a job only once :meth:`Waits.waits` says no
more; a job that waits does not hold back the jobs queued behind it.

Kept per name, as counts: how many of each name's jobs are not done yet, told as each is
(:meth:`Waits.done`). When a job fails or is cancelled, the jobs that run after it (and after
those, in turn) cannot run as asked: :meth:`Waits.ended` says which, with the event that ends each
(failed when a dependency failed, cancelled when it was cancelled) and why; none of them ran or
was charged anything. ``retry`` and ``resume`` bring them back with the job they waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from pan2render.jobs.after import cycles, unfinished
from pan2render.jobs.ledger import JobEvent, JobRecord, JobState, superseded


class Waits:
    """The ``after`` of the jobs one batch serves, and what each queued job still waits for."""

    def __init__(self, jobs: Sequence[JobRecord] = ()):
        old = superseded(jobs)
        self._name = {j.id: j.name for j in jobs if j.id not in old}  # the jobs a name stands for
        self._left = unfinished(jobs)
        self._after = {j.id: j.spec.after for j in jobs if j.spec.after}
        self._dependents: dict[str, list[str]] = {}  # name -> the jobs that run after it
        for job_id, names in self._after.items():
            for name in names:
                self._dependents.setdefault(name, []).append(job_id)

    def waiting_for(self, job_id: str) -> list[str]:
        """The names in the job's ``after`` whose jobs are not all done (empty: it may start)."""
        return [n for n in self._after.get(job_id, ()) if self._left[n]]

    def waits(self, job_id: str) -> bool:
        return job_id in self._after and any(self._left[n] for n in self._after[job_id])

    def count(self, *, queued: Callable[[str], bool]) -> int:
        """How many of the jobs that ``queued`` says are queued wait still: only the jobs with an
        ``after`` are looked at."""
        return sum(1 for job_id in self._after if self.waits(job_id) and queued(job_id))

    def done(self, job_id: str) -> None:
        """The job's video is written and checked: one job fewer that its name's dependents wait for."""
        if (name := self._name.get(job_id)) is not None:
            self._left[name] -= 1

    def ended(self, job_id: str, state: JobState, reason: str, *,
              waiting: Callable[[str], bool]) -> Iterator[tuple[str, JobEvent, str]]:
        """``job_id`` ended ``state`` (failed or cancelled) for ``reason``: each job that runs after
        it, and after those in turn, that ``waiting`` says still waits to start, with the event
        that ends it and why ("dependency fox failed: sampling: ..."). Each is yielded before the
        jobs that run after it are looked at, so the caller ends it first."""
        event = JobEvent.CANCEL if state is JobState.CANCELLED else JobEvent.FAIL
        verb = "was cancelled" if state is JobState.CANCELLED else "failed"
        todo = [(job_id, reason)]
        while todo:
            ended, why = todo.pop()
            name = self._name.get(ended)
            for dependent in self._dependents.get(name, ()) if name is not None else ():
                if waiting(dependent):
                    text = f"dependency {name} {verb}: {why}"
                    yield dependent, event, text
                    todo.append((dependent, text))

    def caught(self) -> dict[str, str]:
        """The jobs whose ``after`` is caught in a cycle -> why they can never start. A batch with
        one is refused when it is read; the jobs of several batches recorded into one folder can
        still make one (an edited batch's new version of a job waiting for a job that waits for it)."""
        graph = {self._name[j]: names for j, names in self._after.items() if j in self._name}
        return {j: f"its `after` jobs wait for each other in a cycle ({' -> '.join([*c, c[0]])}): none can start"
                for c in (cycles(graph, order=list(graph)) if graph else []) for j in self._after
                if self._name.get(j) in c}
