"""What the scheduler serves: :class:`ServedBatch` (one batch's flow, progress and place in the
queue) and :class:`QueuedJob` (a pending job) in a :class:`JobQueue` (their order). How it serves
them is ``config.py``'s."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from pan2render.jobs.ledger import JobRecord, Ledger
from pan2render.jobs.store import CommitError
from pan2render.long_video import job_texts
from pan2render.runner.protocol.failures import BatchStopped, FailureKind, classify_exception
from pan2render.runner.serve.jobflow import BatchFlow
from pan2render.runner.serve.progress import RunProgress
from pan2render.runner.serve.waits import Waits


class Standing(Protocol):
    """What a client may change of a batch while it is served, held in one place and read by the
    scheduler: the farm's queue row (which persists it), or for `run` a fixed one."""

    @property
    def priority(self) -> int: ...  # higher first

    @property
    def paused(self) -> bool: ...  # no new job of it starts

    @property
    def preempts(self) -> bool:
        """Its queued jobs may stop a lower-priority batch's sampling at a step boundary to take its
        group (the stopped job continues from its step checkpoint later)."""


@dataclass(frozen=True)
class FixedStanding:
    """A batch served by `run`: nothing changes it while it runs."""

    priority: int = 0
    paused: bool = False
    preempts: bool = False


_served = itertools.count()


@dataclass(eq=False)
class ServedBatch:
    """One batch the scheduler serves: its flow (folder + ledger), its progress, its standing (its
    priority, whether it is paused). ``on_job_end``: called from the loop after any of its jobs
    finished or failed (e.g. to refresh the report); it must return quickly."""

    flow: BatchFlow
    progress: RunProgress
    standing: Standing = field(default_factory=FixedStanding)
    on_job_end: Callable[[], None] | None = None
    seq: int = field(default_factory=lambda: next(_served))  # served earlier, first among equals
    stop: BaseException | None = None  # set on a full disk: start nothing more of it
    waits: Waits = field(default_factory=Waits)  # what its queued jobs wait for (their `after`)
    ended: int = 0  # jobs ended (done or failed) while served
    _ended_seen: int = 0

    @property
    def ledger(self) -> Ledger:
        return self.flow.ledger

    @property
    def priority(self) -> int:
        return self.standing.priority

    @property
    def paused(self) -> bool:
        return self.standing.paused

    @property
    def preempts(self) -> bool:
        return self.standing.preempts

    @contextmanager
    def step(self) -> Iterator[None]:
        """A step boundary's ledger changes, one commit (``Ledger.grouped``). A commit the disk
        refuses stops the batch as a refused write does (its ledger refuses every change after)."""
        try:
            with self.ledger.grouped():
                yield
        except CommitError as e:
            if classify_exception(e) is not FailureKind.STORAGE:
                raise
            self.stop = self.stop or BatchStopped(e)

    def notify_job_end(self) -> None:
        if self.on_job_end is not None and self.ended != self._ended_seen:
            self._ended_seen = self.ended
            self.on_job_end()


@dataclass(eq=False)
class QueuedJob:
    """A pending job in the scheduler's queue."""

    batch: ServedBatch
    job_id: str
    gpus: int
    model: str
    adapters: frozenset[str]  # its LoRA files' digests: a group holding them is preferred
    order: int  # first queued first, among jobs of one priority and batch
    avoid: frozenset[str] = frozenset()  # groups it failed on in this run: others first
    prompts: tuple[str, ...] = ()  # every segment's prompt and the negative prompt: the texts encoded ahead of it


class JobQueue:
    """The scheduler's pending jobs in the order they start: priority (higher first), then when
    their batch was served, then each job's turn. It remembers the groups each job failed on in
    this run, so that it is offered other groups first when it comes back.

    Its cost grows with the jobs, not their square: a batch's 20,000 jobs are queued one ``add``
    at a time (re-sorting the queue on each add was quadratic), so the order is sorted once, when
    next read, and a job queued again (a retry) is inserted in its place; a removal leaves its entry
    in that order until more than half of it is gone, and a read starts after the removed ones at
    its head (the scheduler reads the queue from its head on every pass)."""

    def __init__(self) -> None:
        self._jobs: dict[QueuedJob, None] = {}  # the queued jobs (a QueuedJob hashes by identity)
        self._by_id: dict[tuple[int, str], QueuedJob] = {}  # (batch seq, job id) -> its entry
        self._order: list[QueuedJob] | None = []  # the jobs in start order, and some removed; None: to sort
        self._head = 0  # entries of _order before this one are all removed
        self._removed = 0  # entries of _order no longer queued
        self._counts: dict[int, int] = {}  # batch seq -> its queued jobs
        self._turns = itertools.count()
        self._failed_on: dict[tuple[int, str], set[str]] = {}  # (batch seq, job id) -> group ids

    def add(self, batch: ServedBatch, job: JobRecord) -> None:
        q = QueuedJob(batch, job.id, job.spec.gpus, job.spec.model,
                      frozenset(sha for sha, _ in job.spec.lora_digests if sha), next(self._turns),
                      frozenset(self._failed_on.get((batch.seq, job.id), ())),
                      job_texts(job.spec))
        self._jobs[q] = None
        self._by_id[(batch.seq, job.id)] = q
        self._counts[batch.seq] = self._counts.get(batch.seq, 0) + 1
        if self._order is not None:
            at = bisect.bisect_right(self._order, _start_key(q), key=_start_key)
            self._order.insert(at, q)
            self._head = min(self._head, at)

    def reorder(self) -> None:
        """After a batch's priority changed."""
        self._order = None

    def _ordered(self) -> list[QueuedJob]:
        if self._order is None:
            self._order = sorted(self._jobs, key=_start_key)
            self._head = self._removed = 0
        return self._order

    def failed_on(self, batch: ServedBatch, job_id: str, group_id: str) -> None:
        self._failed_on.setdefault((batch.seq, job_id), set()).add(group_id)

    def of(self, batch: ServedBatch) -> list[QueuedJob]:
        return list(self.queued_of(batch))

    def queued_of(self, batch: ServedBatch) -> Iterator[QueuedJob]:
        """The batch's queued jobs in start order. A batch's jobs sort together (its priority and
        seq lead the key), so its run of the order is found by bisection: walking the farm's whole
        queue for it, at each conditioning call's look-ahead, grew with every other batch queued."""
        if not self._counts.get(batch.seq):
            return iter(())
        order = self._ordered()
        at = bisect.bisect_left(order, (-batch.priority, batch.seq, -1), key=_start_key)
        run = itertools.takewhile(lambda q: q.batch is batch, (order[i] for i in range(at, len(order))))
        return (q for q in run if q in self._jobs)

    def count(self, batch: ServedBatch) -> int:
        return self._counts.get(batch.seq, 0)

    def find(self, batch: ServedBatch, job_id: str) -> QueuedJob | None:
        """The job's entry, while it is queued."""
        return self._by_id.get((batch.seq, job_id))

    def remove(self, q: QueuedJob) -> None:
        del self._jobs[q]
        del self._by_id[(q.batch.seq, q.job_id)]
        if (left := self._counts[q.batch.seq] - 1) > 0:
            self._counts[q.batch.seq] = left
        else:
            del self._counts[q.batch.seq]
        if self._order is not None:
            self._removed += 1
            if self._removed > len(self._jobs):
                self._order = [job for job in self._order if job in self._jobs]
                self._head = self._removed = 0

    def __iter__(self) -> Iterator[QueuedJob]:
        order = self._ordered()
        while self._head < len(order) and order[self._head] not in self._jobs:
            self._head += 1
        return (order[i] for i in range(self._head, len(order)) if order[i] in self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)


def _start_key(q: QueuedJob) -> tuple[int, int, int]:
    return -q.batch.priority, q.batch.seq, q.order
