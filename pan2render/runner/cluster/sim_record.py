"""What the simulated cluster (``simulated.py``) measured: the GPUs' busy time, call by call, the
faults it injected, its nodes' comings and goings, and any job that had calls on two groups at once
(which the scheduler must never do: a job runs once at a time)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pan2render.jobs.ledger import stage_name
from pan2render.runner.cluster.executor import Group
from pan2render.runner.protocol.messages import Lane, SampleCall, WorkerCall


@dataclass(frozen=True)
class Fault:
    """One call a fault reached: ``what`` is "failure" (it answered one), "death" (its group's worker
    died in it), "torn-down" (it was in flight on a group whose worker died in another call) or
    "lost" (its group's node left the cluster)."""

    at: float
    job_id: str | None  # None: a call of no one job (a load, prompts encoded for several)
    stage: str | None
    what: str


@dataclass
class SimRecord:
    gpus: int
    calls: Counter[str] = field(default_factory=Counter)  # call type -> calls sent
    faults: list[Fault] = field(default_factory=list)
    twice: list[str] = field(default_factory=list)  # "job on group A while in flight on group B"
    # When the last job's first SampleCall was sent: after it the queue holds retries at most, and
    # GPUs go idle for want of work.
    last_new_sampling: float = 0.0
    _sampled: set[str] = field(default_factory=set)  # jobs that were sent a SampleCall
    _busy: list[tuple[list[float], int]] = field(default_factory=list)  # ([start, end], GPUs)
    _first_busy: dict[tuple[int, int], float] = field(default_factory=dict)  # (node, GPU) -> first busy
    _nodes: list[tuple[float, int, int, bool]] = field(default_factory=list)  # (at, node, GPUs, alive)
    _jobs_on: dict[str, tuple[str, int]] = field(default_factory=dict)  # job id -> (group, calls in flight)

    # ------------------------------------------------------------------ what the executor tells it
    def sent(self, message: WorkerCall, group: Group, at: float, job_id: str | None) -> None:
        self.calls[type(message).__name__] += 1
        if isinstance(message, SampleCall) and message.job_id not in self._sampled:
            self._sampled.add(message.job_id)
            self.last_new_sampling = max(self.last_new_sampling, at)
        if job_id is None or message.lane is Lane.SETUP:
            return
        where, n = self._jobs_on.get(job_id, (group.id, 0))
        if where != group.id:
            self.twice.append(f"{job_id}: {type(message).__name__} on {group.id} while in flight on {where}")
        self._jobs_on[job_id] = (group.id, n + 1)

    def ended(self, message: WorkerCall, group: Group, job_id: str | None) -> None:
        if job_id is None or job_id not in self._jobs_on:
            return
        where, n = self._jobs_on[job_id]
        if n <= 1:
            del self._jobs_on[job_id]
        else:
            self._jobs_on[job_id] = (where, n - 1)

    def busy(self, group: Group, interval: list[float]) -> None:
        """``interval``: [start, end] of a GPU-lane call on ``group`` (kept by reference: a death cuts it)."""
        self._busy.append((interval, group.size))
        for gpu in group.handle.gpus:
            self._first_busy.setdefault((group.handle.node, gpu), interval[0])

    @staticmethod
    def cut(interval: list[float], at: float) -> None:
        interval[1] = max(interval[0], min(interval[1], at))

    def fault(self, job_id: str | None, message: WorkerCall, what: str, *, at: float) -> None:
        self.faults.append(Fault(at=at, job_id=job_id, what=what,
                                 stage=None if message.stage is None else stage_name(message.stage)))

    def node(self, node: int, gpus: int, *, alive: bool, at: float) -> None:
        self._nodes.append((at, node, gpus, alive))

    # ------------------------------------------------------------------ what it says
    def busy_fraction(self, start: float | None = None, end: float | None = None) -> float | None:
        """GPU-lane busy GPU-seconds over the GPU-seconds the live GPUs had between ``start`` and
        ``end``. By default the steady state: from when every GPU first ran a call (the groups
        formed and loaded) to when the last job's first sampling was sent (after it only retries
        start, and GPUs go idle for want of work, not of the scheduler). None when that window is
        empty."""
        if start is None:
            if len(self._first_busy) < self.gpus:
                return None
            start = max(self._first_busy.values())
        end = self.last_new_sampling if end is None else end
        if end <= start:
            return None
        busy = sum(max(0.0, min(e, end) - max(s, start)) * n for (s, e), n in self._busy)
        return busy / self._gpu_seconds(start, end)

    def last_end(self) -> float:
        return max((e for (_, e), _ in self._busy), default=0.0)

    def _gpu_seconds(self, start: float, end: float) -> float:
        """The live GPUs' seconds between ``start`` and ``end`` (a node away does not count)."""
        total = self.gpus * (end - start)
        gone: dict[int, float] = {}
        for at, node, gpus, alive in sorted(self._nodes):
            if not alive:
                gone[node] = at
            elif node in gone:
                total -= gpus * max(0.0, min(at, end) - max(gone.pop(node), start))
        for node, since in gone.items():
            size = next(g for _, n, g, _ in self._nodes if n == node)
            total -= size * max(0.0, end - max(since, start))
        return total

    def summary(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "faults": Counter(f.what for f in self.faults),
                "busy_steady": self.busy_fraction(), "busy_whole": self.busy_fraction(0.0, self.last_end()),
                "makespan_s": self.last_end(), "jobs_on_two_groups": len(self.twice)}
