"""The attempts on groups now (:class:`Running`), each with its batch: what the scheduler asks of
them (a batch's, a group's, the one a reply belongs to) and which held group can take one more job."""

from __future__ import annotations

from collections.abc import Iterator

from pan2render.runner.cluster.executor import Call, Group
from pan2render.runner.protocol.messages import MAX_ENCODES_IN_FLIGHT
from pan2render.runner.serve.attempt import JobRun, Phase
from pan2render.runner.serve.serving import ServedBatch

Key = tuple[int, str]  # (the batch's serving seq, the job's id): a job of two batches of a farm is two keys


class Running:
    def __init__(self) -> None:
        self._runs: dict[Key, tuple[ServedBatch, JobRun]] = {}

    def add(self, batch: ServedBatch, run: JobRun) -> None:
        self._runs[(batch.seq, run.job.id)] = (batch, run)

    def end(self, batch: ServedBatch, run: JobRun) -> None:
        """``run`` no longer runs on its group."""
        del self._runs[(batch.seq, run.job.id)]
        run.move(Phase.ENDED)

    def __contains__(self, key: Key) -> bool:
        return key in self._runs

    def __bool__(self) -> bool:
        return bool(self._runs)

    def __iter__(self) -> Iterator[tuple[ServedBatch, JobRun]]:
        return iter(list(self._runs.values()))

    def keyed(self) -> list[tuple[Key, JobRun]]:
        return [(key, run) for key, (_, run) in self._runs.items()]

    def runs(self) -> list[JobRun]:
        return [run for _, run in self._runs.values()]

    def of(self, batch: ServedBatch) -> list[JobRun]:
        return [run for b, run in self._runs.values() if b is batch]

    def on(self, group: Group) -> list[tuple[ServedBatch, JobRun]]:
        return [(b, run) for b, run in self._runs.values() if run.group is group]

    def batch_of(self, run: JobRun) -> ServedBatch:
        return next(b for b, r in self._runs.values() if r is run)

    def find(self, call: Call) -> tuple[ServedBatch, JobRun] | None:
        """The attempt ``call`` (its call or its side call) belongs to; None when it left."""
        return next(((b, r) for b, r in self._runs.values()
                     if call is r.call or any(call is side for side in r.sides)), None)

    def calls(self) -> list[Call]:
        return [c for _, r in self._runs.values() for c in (r.call, *r.sides) if c is not None]

    def held_group(self, size: int, *, behind_decode: bool, avoid: frozenset[str] = frozenset()) -> Group | None:
        """A group of ``size`` with attempts that can take one more: its GPU lane is free (or, with
        ``behind_decode``, runs only a decode) and its encodes, counting that decode's, stay within
        MAX_ENCODES_IN_FLIGHT."""
        held = {id(r.group): r.group for r in self.runs() if r.group.size == size and r.group.id not in avoid}
        for group in held.values():
            jobs = [r for _, r in self.on(group)]
            on_gpu = [r for r in jobs if not r.encoding]
            free = not on_gpu or (behind_decode and len(on_gpu) == 1 and on_gpu[0].decoding)
            if free and len(jobs) < MAX_ENCODES_IN_FLIGHT:
                return group
        return None
