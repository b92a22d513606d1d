"""What the scheduler serves, and how: :class:`DriverConfig` (retries, deadlines, waits),
:class:`ServedBatch` (one batch's flow, progress and place in the queue) and :class:`QueuedJob`
(a pending job) in a :class:`JobQueue` (their order)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pan2render.jobs.ledger import JobRecord, Ledger
from pan2render.runner.protocol.messages import JOB_CALLS, default_call_timeouts
from pan2render.runner.serve.jobflow import BatchFlow
from pan2render.runner.serve.progress import RunProgress


@dataclass(frozen=True)
class DriverConfig:
    retries: int = 2  # retries per job after its first attempt (resume grants a fresh budget)
    poll_s: float = 0.5  # longest the loop sleeps in ray.wait before checking deadlines/progress
    group_start_timeout_s: float = 300.0
    # Per-call deadlines, by each call type's timeout_key (defaults: messages.py); a call past its
    # deadline is treated as a dead group.
    call_timeouts_s: dict[str, float] = field(default_factory=default_call_timeouts)
    progress: bool = True  # a live block on stderr when it is a terminal (else plain lines)
    # How long the batch waits for GPUs to come back after the cluster lost the ones a job needs
    # (a node died, its raylet or the GCS restarted) before it stops with a message.
    cluster_wait_s: float = 300.0
    # Times a job's artifact may be redone in one run because it failed its check (corrupt on
    # disk, or freshly written and rejected) before the job fails with the check's reason.
    max_redos: int = 2
    # A sampling that reports no step for this long is hung (a worker stopped, a collective that
    # never completes): its group is torn down and the job retried, charged. A step of a 720p
    # sampling takes ~1.6 s on an H200; 0 turns the watchdog off.
    stall_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries={self.retries} must be >= 0 (0 = no retries)")
        if self.cluster_wait_s < 0 or self.max_redos < 0 or self.stall_timeout_s < 0:
            raise ValueError(f"cluster_wait_s={self.cluster_wait_s}, max_redos={self.max_redos} and "
                             f"stall_timeout_s={self.stall_timeout_s} must be >= 0")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s={self.poll_s} must be > 0")
        missing = {c.timeout_key for c in JOB_CALLS} - set(self.call_timeouts_s)
        if missing:
            raise ValueError(f"call_timeouts_s lacks {sorted(missing)}")


_served = itertools.count()


@dataclass(eq=False)
class ServedBatch:
    """One batch the scheduler serves: its flow (folder + ledger), its progress, its place in the
    queue. ``on_job_end``: called from the loop after any of its jobs finished or failed (e.g. to
    refresh the report); it must return quickly."""

    flow: BatchFlow
    progress: RunProgress
    priority: int = 0  # higher first
    on_job_end: Callable[[], None] | None = None
    paused: bool = False  # no new job of it starts
    # Its queued jobs may stop a lower-priority batch's sampling at a step boundary to take its
    # group (the stopped job continues from its step checkpoint later).
    preempts: bool = False
    seq: int = field(default_factory=lambda: next(_served))  # served earlier, first among equals
    stop: BaseException | None = None  # set on a full disk: start nothing more of it
    ended: int = 0  # jobs ended (done or failed) while served
    _ended_seen: int = 0

    @property
    def ledger(self) -> Ledger:
        return self.flow.ledger

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


class JobQueue:
    """The scheduler's pending jobs in the order they start: priority (higher first), then when
    their batch was served, then each job's turn. It remembers the groups each job failed on in
    this run, so that it is offered other groups first when it comes back."""

    def __init__(self) -> None:
        self._jobs: list[QueuedJob] = []
        self._turns = itertools.count()
        self._failed_on: dict[tuple[int, str], set[str]] = {}  # (batch seq, job id) -> group ids

    def add(self, batch: ServedBatch, job: JobRecord) -> None:
        self._jobs.append(QueuedJob(batch, job.id, job.spec.gpus, job.spec.model,
                                    frozenset(sha for sha, _ in job.spec.lora_digests if sha), next(self._turns),
                                    frozenset(self._failed_on.get((batch.seq, job.id), ()))))
        self.reorder()

    def reorder(self) -> None:
        """After a batch's priority changed."""
        self._jobs.sort(key=lambda q: (-q.batch.priority, q.batch.seq, q.order))

    def failed_on(self, batch: ServedBatch, job_id: str, group_id: str) -> None:
        self._failed_on.setdefault((batch.seq, job_id), set()).add(group_id)

    def of(self, batch: ServedBatch) -> list[QueuedJob]:
        return [q for q in self._jobs if q.batch is batch]

    def remove(self, q: QueuedJob) -> None:
        self._jobs.remove(q)

    def __iter__(self) -> Iterator[QueuedJob]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)
