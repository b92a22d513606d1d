"""The scheduler's queue: jobs start in the order of their batch's priority, then when the batch
was served, then their turn in it; a batch queued job by job costs work in proportion to its jobs
(counted, tests/op_count.py), as does cancelling it job by job."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from op_count import assert_linear
from runner_helpers import write_batch

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import JobRecord, JobState
from pan2render.jobs.spec import JobSpec
from pan2render.runner.serve.serving import FixedStanding, JobQueue, ServedBatch


@dataclasses.dataclass
class _Standing:
    priority: int = 0
    paused: bool = False
    preempts: bool = False


def _batch(standing: Any = None) -> ServedBatch:
    # The queue reads a batch's standing and when it was served, nothing of its flow or progress.
    return ServedBatch(flow=None, progress=None, standing=standing or FixedStanding())  # type: ignore[arg-type]


def _records(tmp_path: Path, n: int, prefix: str = "j") -> list[JobRecord]:
    base = load_batch(write_batch(tmp_path / "one.yaml", [{"name": "fox", "prompt": "a fox"}])).jobs[0]
    specs: list[JobSpec] = [dataclasses.replace(base, name=f"{prefix}{i}") for i in range(n)]
    return [JobRecord(id=s.job_id, name=s.name, spec=s, spec_hash=s.spec_hash, state=JobState.PENDING, attempts=0,
                      retries_left=1, error=None, error_stage=None, position=i, created_at=0.0, updated_at=0.0)
            for i, s in enumerate(specs)]


def test_jobs_start_by_priority_then_batch_then_turn(tmp_path: Path) -> None:
    low, high = _Standing(priority=0), _Standing(priority=5)
    first, second = _batch(low), _batch(high)
    a, b = _records(tmp_path, 3, "a"), _records(tmp_path, 3, "b")
    queue = JobQueue()
    for x, y in zip(a, b):  # interleaved, as a retry or a requeue adds them
        queue.add(first, x)
        queue.add(second, y)
    assert [q.job_id for q in queue] == [r.id for r in b + a] and len(queue) == 6
    queue.remove(next(q for q in queue if q.job_id == b[1].id))
    assert [q.job_id for q in queue.of(second)] == [b[0].id, b[2].id] and len(queue) == 5
    high.priority = -1
    queue.reorder()
    assert [q.job_id for q in queue] == [a[0].id, a[1].id, a[2].id, b[0].id, b[2].id]
    queue.add(first, b[1])  # a job of the first batch again (a retry): its turn is after the others
    assert [q.job_id for q in queue.of(first)] == [r.id for r in a] + [b[1].id]


def test_queueing_and_cancelling_a_batch_job_by_job_grows_linearly(tmp_path: Path) -> None:
    """What `Scheduler.serve` does with a batch (one add per pending job; it re-sorted the whole
    queue on each), what starting them does (one removal each), and a cancel of the batch behind
    another batch's jobs (one removal each, from the back of the queue)."""
    records = _records(tmp_path, 400)

    def make(n: int) -> Callable[[], object]:
        def serve_and_cancel() -> None:
            queue, ahead, batch = JobQueue(), _batch(_Standing(priority=1)), _batch()
            for record in records[:n]:
                queue.add(ahead, record)
                queue.add(batch, record)
            for q in list(queue)[:n // 2]:  # half of the first batch's jobs start, in order
                queue.remove(q)
            for q in queue.of(batch):
                queue.remove(q)
            assert len(queue) == n - n // 2

        return serve_and_cancel

    assert_linear(make, 100, "queueing, starting and cancelling a batch")


def test_a_batchs_queued_jobs_cost_its_own_jobs_not_the_farms_queue(tmp_path: Path) -> None:
    """The conditioning look-ahead reads one batch's queued jobs at each call: found by bisection
    in the start order, it walks that batch's jobs (and its removed entries), never the batches
    queued ahead of it; before, it walked the whole farm's queue. Counted: the same read behind 4x
    the other batches' jobs costs the same, but for the bisection's few more steps."""
    from op_count import trace_events

    records = _records(tmp_path, 200)

    def cost(ahead: int) -> int:
        queue, mine = JobQueue(), _batch(_Standing(priority=0))
        for _ in range(ahead // 10):  # batches of 10 jobs queued ahead (higher priority, served before)
            others = _batch(_Standing(priority=1))
            for record in records[:10]:
                queue.add(others, record)
        for record in records[:10]:
            queue.add(mine, record)
        queue.remove(queue.find(mine, records[0].id))  # one of its own started
        list(queue)  # the order sorted, as the scheduler's pass leaves it
        seen = []
        events = trace_events(lambda: seen.extend(q.job_id for q in queue.queued_of(mine)),
                              within="serving.py")
        assert seen == [r.id for r in records[1:10]]
        return events

    small, large = cost(40), cost(640)
    print(small, large)
    assert large <= 1.2 * small  # 16x the jobs ahead: 4 more steps of bisection; walking them was 16x
    empty = JobQueue()
    assert list(empty.queued_of(_batch())) == []
