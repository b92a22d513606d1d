"""The attempts on groups now (:class:`Running`), each with its batch: what the scheduler asks of
them (a batch's, a group's, the one a reply belongs to) and which held group can take one more job.

Every question costs what its answer holds, not the cluster's size: the attempts are kept by
batch and by group, a reply finds its attempt through its call's group, and a held group that can
take a job is looked for only among the groups whose attempts moved since it was last asked (an
attempt moves only when it is added, when a reply of its is found, or when it ends)."""

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
        self._by_batch: dict[int, dict[str, JobRun]] = {}  # batch seq -> job id -> its attempt
        self._by_group: dict[str, dict[Key, tuple[ServedBatch, JobRun]]] = {}  # group id -> its attempts
        # Groups whose attempts moved since held_group last looked at them, by size (insertion-ordered),
        # and those it found running only a decode (a job may queue behind it), until they move again.
        self._moved: dict[int, dict[str, Group]] = {}
        self._behind: dict[int, dict[str, Group]] = {}

    def add(self, batch: ServedBatch, run: JobRun) -> None:
        key = (batch.seq, run.job.id)
        self._runs[key] = (batch, run)
        self._by_batch.setdefault(batch.seq, {})[run.job.id] = run
        self._by_group.setdefault(run.group.id, {})[key] = (batch, run)
        self._moves(run.group)

    def end(self, batch: ServedBatch, run: JobRun) -> None:
        """``run`` no longer runs on its group."""
        key = (batch.seq, run.job.id)
        del self._runs[key]
        of_batch = self._by_batch[batch.seq]
        del of_batch[run.job.id]
        if not of_batch:
            del self._by_batch[batch.seq]
        on_group = self._by_group[run.group.id]
        del on_group[key]
        if not on_group:
            del self._by_group[run.group.id]
        self._moves(run.group)
        run.move(Phase.ENDED)

    def _moves(self, group: Group) -> None:
        self._moved.setdefault(group.size, {})[group.id] = group
        self._behind.get(group.size, {}).pop(group.id, None)

    def __contains__(self, key: Key) -> bool:
        return key in self._runs

    def __bool__(self) -> bool:
        return bool(self._runs)

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[tuple[ServedBatch, JobRun]]:
        return iter(list(self._runs.values()))

    def keyed(self) -> list[tuple[Key, JobRun]]:
        return [(key, run) for key, (_, run) in self._runs.items()]

    def runs(self) -> list[JobRun]:
        return [run for _, run in self._runs.values()]

    def of(self, batch: ServedBatch) -> list[JobRun]:
        return list(self._by_batch.get(batch.seq, {}).values())

    def count(self, batch: ServedBatch) -> int:
        return len(self._by_batch.get(batch.seq, ()))

    def on(self, group: Group) -> list[tuple[ServedBatch, JobRun]]:
        return list(self._by_group.get(group.id, {}).values())

    def batch_of(self, run: JobRun) -> ServedBatch:
        return next(b for b, r in self.on(run.group) if r is run)

    def find(self, call: Call) -> tuple[ServedBatch, JobRun] | None:
        """The attempt ``call`` (its call or one of its side calls) belongs to; None when it left.
        Its group counts as moved: the reply moves the attempt on."""
        found = next(((b, r) for b, r in self._by_group.get(call.group.id, {}).values()
                      if call is r.call or any(call is side for side in r.sides)), None)
        if found is not None:
            self._moves(call.group)
        return found

    def calls(self) -> list[Call]:
        return [c for _, r in self._runs.values() for c in (r.call, *r.sides) if c is not None]

    def held_group(self, size: int, *, behind_decode: bool, avoid: frozenset[str] = frozenset()) -> Group | None:
        """A group of ``size`` with attempts that can take one more: its GPU lane is free (or, with
        ``behind_decode``, runs only a decode) and its encodes, counting that decode's, stay within
        MAX_ENCODES_IN_FLIGHT. Looked for among the groups whose attempts moved since the last look;
        one found running only a decode is kept apart for ``behind_decode`` (a look for a free lane
        no longer walks them all: at 1,000 GPUs most groups are there), one that can take no job
        even behind a decode is forgotten, each until its attempts move again."""
        moved, behind = self._moved.get(size, {}), self._behind.setdefault(size, {})
        for gid, group in list(moved.items()):
            jobs = [r for _, r in self._by_group.get(gid, {}).values()]
            if not jobs:  # it holds no attempt any more: the pool has it
                del moved[gid]
                continue
            if gid in avoid:
                continue
            on_gpu = [r for r in jobs if not r.encoding]
            fits = len(jobs) < MAX_ENCODES_IN_FLIGHT
            if fits and not on_gpu:
                return group
            del moved[gid]
            if fits and len(on_gpu) == 1 and on_gpu[0].decoding:
                behind[gid] = group
        if behind_decode:
            return next((group for gid, group in behind.items() if gid not in avoid), None)
        return None
