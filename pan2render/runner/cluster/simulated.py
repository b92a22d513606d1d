"""The simulated executor: the executor interface on virtual GPUs, for measuring the scheduler at
any size (``scripts/bench_scale.py``) and testing it on thousands of jobs in seconds.

GPUs sit on virtual nodes (``nodes``: GPUs per node, e.g. 125 nodes of 8); a group of 1, 2, 4 or 8
takes GPUs of one node, as a STRICT_PACK placement group does. Its workers answer each call after
the time the cost model (``sim_model.CostModel``) draws for it: GPU-lane calls one after the other
in the order they were sent (the next job's first call waits behind a decode), a collect when the
job's encode (which starts when its decode ends) is done, a step checkpoint's or a preview's
fetch with none newer when the sampling ends (neither is simulated). Their replies are small but valid
artifacts (``sim_model``), so the stage flow writes, records and checks them as a real worker's.
Faults come at chosen rates (``sim_model.FaultPlan``): a call answering a failure, a worker dying
(every call in flight on its group dies with it), a node leaving the cluster (its groups' calls
die cluster-lost) and coming back.

Time is the clock's (``sim_model``): virtual (deterministic; ``wait`` moves it to the next call's
end), real with the waits skipped, or real. ``record`` keeps what was measured: each GPU-lane
call's busy interval, the faults injected, any job that ran on two groups at once.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pan2render.jobs.spec import JobSpec
from pan2render.runner.cluster.executor import Call, Group, GroupDied, GroupStartError, next_group_number
from pan2render.runner.cluster.sim_model import (
    TEXT_ENCODER_ID,
    Clock,
    CostModel,
    FaultPlan,
    NodeLoss,
    VirtualClock,
    embedding_bytes,
    latents_bytes,
    mp4_bytes,
)
from pan2render.runner.cluster.sim_record import SimRecord
from pan2render.runner.protocol.failures import Failure, FailureKind
from pan2render.runner.protocol.messages import (
    CollectCall,
    CollectReply,
    DecodeCall,
    DecodeReply,
    EncodePromptsCall,
    EncodePromptsReply,
    FetchCheckpointCall,
    FetchPreviewCall,
    Lane,
    LoadCall,
    LoadReply,
    Reply,
    SampleCall,
    SampleReply,
    WorkerCall,
)
from pan2render.runner.protocol.steps import StepReport

FAULTY_CALLS = (SampleCall, DecodeCall, CollectCall)  # the calls a FaultPlan's rates apply to


@dataclass(eq=False)
class _Pending:
    """A call in flight: when it ends, what it answers, the GPU time it holds."""

    group: Group
    message: WorkerCall
    done_at: float
    outcome: Any = None  # its Reply, or the GroupDied it raises
    dies: bool = False  # the group's worker dies as it ends
    busy: list[float] | None = None  # [start, end] of its GPU-lane time (the end moves up if the group dies)
    call: Call | None = None
    ended: bool = False


@dataclass(eq=False)
class _Workers:
    """A group's simulated workers: where they are and what they hold."""

    node: int
    epoch: int  # the node's epoch when placed: a node that left and came back has new GPUs
    gpus: tuple[int, ...]
    dead: bool = False
    lost: bool = False  # its node left the cluster
    gpu_free_at: float = 0.0  # when its GPU lane finishes the calls sent so far
    specs: dict[str, JobSpec] = field(default_factory=dict)  # job id -> spec (sent once per attempt)
    encodes: dict[str, float] = field(default_factory=dict)  # job id -> when its encode ends
    sample_ends: dict[str, float] = field(default_factory=dict)  # job id -> when its latest sampling ends
    in_flight: dict[int, _Pending] = field(default_factory=dict)


@dataclass
class _Node:
    size: int
    free: set[int]
    alive: bool = True
    epoch: int = 0
    groups: dict[str, Group] = field(default_factory=dict)


class SimulatedExecutor:
    starts_in_background = False  # a group is placed at once, or refused
    worker_logs = None
    cluster = "the simulated cluster"

    def __init__(self, *, nodes: Sequence[int], costs: CostModel | None = None, faults: FaultPlan | None = None,
                 clock: Clock | None = None, seed: int = 0):
        """``nodes``: the GPUs of each node (1 to 8 each); ``seed``: the draws of durations and faults."""
        if not nodes or any(not 1 <= n <= 8 for n in nodes):
            raise ValueError(f"nodes={list(nodes)[:8]}: at least one node, each of 1 to 8 GPUs")
        self.costs = costs or CostModel()
        self.faults = faults or FaultPlan()
        self.clock = clock or VirtualClock()
        self._nodes = [_Node(size=n, free=set(range(n))) for n in nodes]
        self._rng = random.Random(seed)
        self._events: list[tuple[float, int, _Pending | NodeLoss]] = []  # a heap, by time then order sent
        self._order = itertools.count()
        self._finished: list[Call] = []  # ended since the last wait
        self._sampling: dict[str, tuple[float, float, int]] = {}  # progress key -> (start, end, steps)
        self.record = SimRecord(gpus=sum(nodes))
        for loss in self.faults.node_losses:
            if not 0 <= loss.node < len(nodes):
                raise ValueError(f"{loss}: there are nodes 0 to {len(nodes) - 1}")
            heapq.heappush(self._events, (loss.at_s, next(self._order), loss))

    # ------------------------------------------------------------------ the cluster
    def total_gpus(self) -> int:
        return sum(n.size for n in self._nodes if n.alive)

    def max_group_size(self) -> int:
        return max((n.size for n in self._nodes if n.alive), default=0)

    def lacks_gpus_for(self, size: int) -> bool:
        return self.total_gpus() < size

    def check_cluster(self) -> None:
        """A simulated cluster is never lost whole (its nodes are, one at a time)."""

    def unreachable(self) -> str | None:
        return None  # (in this process: it answers while the process does)

    def progress(self) -> dict[str, StepReport]:
        """Each sampling's steps so far, as its worker would report them."""
        now, at, out = self.clock.now(), time.time(), {}
        for key, (start, end, total) in self._sampling.items():
            per = (end - start) / total if total else 0.0
            done = total if per <= 0 else min(total, int((now - start) / per))
            if done >= 1:
                first = max(1, done - 7)
                out[key] = StepReport(done=done, total=total, received_at=at,
                                      window=((first, start + per * first), (done, start + per * done)))
        return out

    def shutdown(self) -> None:
        """Nothing runs outside this process."""

    # ------------------------------------------------------------------ groups
    def create_group(self, size: int, *, timeout_s: float, on_wait: Callable[[str], None] | None = None) -> Group:
        fits = [(len(n.free), i) for i, n in enumerate(self._nodes) if n.alive and len(n.free) >= size]
        if not fits:
            raise GroupStartError(f"{size} GPU(s) on one node asked of the simulated cluster; no node has them free")
        _, i = min(fits)  # the fullest node that fits: the big free blocks stay whole for big groups
        node = self._nodes[i]
        gpus = tuple(sorted(node.free)[:size])
        node.free -= set(gpus)
        now = time.time()
        group = Group(id=f"sim-{next_group_number()}", size=size, asked_at=now, placed_at=now,
                      handle=_Workers(node=i, epoch=node.epoch, gpus=gpus, gpu_free_at=self.clock.now()))
        node.groups[group.id] = group
        return group

    def destroy_group(self, group: Group) -> None:
        w: _Workers = group.handle
        self._kill(group, "was torn down", kind=FailureKind.WORKER_DEATH, log=None)
        node = self._nodes[w.node]
        if node.groups.pop(group.id, None) is not None and node.alive and node.epoch == w.epoch:
            node.free |= set(w.gpus)

    def restart_group(self, group: Group, *, timeout_s: float) -> Group:
        """New workers on the same GPUs, holding nothing (a group of a node that left: dead at once)."""
        w: _Workers = group.handle
        self._kill(group, "was restarted", kind=FailureKind.WORKER_DEATH, log=None)
        fresh = Group(id=group.id, size=group.size, faults=group.faults, asked_at=time.time(), placed_at=time.time(),
                      handle=_Workers(node=w.node, epoch=w.epoch, gpus=w.gpus, gpu_free_at=self.clock.now(),
                                      dead=w.lost, lost=w.lost))
        if not w.lost:
            self._nodes[w.node].groups[group.id] = fresh
        return fresh

    def hold_out(self, group: Group) -> None:
        self._kill(group, "was held out of service", kind=FailureKind.WORKER_DEATH, log=None)  # its GPUs stay taken

    # ------------------------------------------------------------------ calls
    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        group.take_seq(message)
        w: _Workers = group.handle
        now = self.clock.now()
        p = _Pending(group=group, message=message, done_at=now)
        if w.dead:
            kind = FailureKind.CLUSTER_LOST if w.lost else FailureKind.WORKER_DEATH
            p.outcome = self._death(group, "is gone", kind=kind)
        else:
            self._schedule(p, w, now)
        p.call = Call(group=group, message=message, started=time.monotonic(), timeout_s=timeout_s, handle=p)
        w.in_flight[id(p)] = p
        self.record.sent(message, group, now, self._job_of(message))
        heapq.heappush(self._events, (p.done_at, next(self._order), p))
        return p.call

    def _schedule(self, p: _Pending, w: _Workers, now: float) -> None:
        """When ``p`` ends and what it answers, as its group's workers would run it."""
        message = p.message
        job = self._job_of(message)
        spec = getattr(message, "spec", None)
        if spec is not None and job is not None:
            w.specs[job] = spec
        seconds = self.costs.draw(self.costs.mean_s(message, w.specs.get(job or "")), self._rng)
        if message.lane is Lane.GPU:
            start = max(now, w.gpu_free_at)
            p.done_at = w.gpu_free_at = start + seconds
            p.busy = [start, p.done_at]
            self.record.busy(p.group, p.busy)
            if isinstance(message, SampleCall):
                w.sample_ends[message.job_id] = p.done_at
        elif isinstance(message, CollectCall):
            p.done_at = max(now, w.encodes.pop(message.job_id, now))
        elif isinstance(message, (FetchCheckpointCall, FetchPreviewCall)):
            # No step checkpoint or preview is ever newer: answered None when the sampling ends (or
            # its wait is up), as a worker with none to give; answered at once, it would be asked again at once.
            p.done_at = max(now, min(w.sample_ends.get(message.job_id, now), now + message.wait_s))
        if isinstance(message, FAULTY_CALLS):
            draw = self._rng.random()
            if draw < self.faults.worker_death_rate:
                p.dies = True
                p.outcome = self._death(p.group, f"died in {type(message).__name__}", kind=FailureKind.WORKER_DEATH)
                return
            if draw < self.faults.worker_death_rate + self.faults.call_failure_rate:
                p.outcome = Reply(rank=0, seconds=seconds, failure=Failure(
                    stage=message.stage or "", kind=FailureKind.UNKNOWN, rank=0,
                    error=f"SimulatedFault: injected into {type(message).__name__}"))
                return
        p.outcome = Reply(rank=0, value=self._answer(p, w, seconds), seconds=seconds)

    def _answer(self, p: _Pending, w: _Workers, seconds: float) -> Any:
        message = p.message
        if isinstance(message, LoadCall):
            return LoadReply(model_id=f"sim-{abs(hash(message.model)) % 10**8:08d}", text_encoder_id=TEXT_ENCODER_ID,
                             backend="none" if p.group.size == 1 else "sim", world_size=p.group.size, device="sim",
                             attention="n/a", load_s=seconds, warmup_s=0.0)
        if isinstance(message, EncodePromptsCall):
            return EncodePromptsReply(embeddings=tuple(embedding_bytes(t) for t in message.texts))
        if isinstance(message, SampleCall):
            spec = w.specs[message.job_id]
            assert p.busy is not None
            self._sampling[message.progress_key or message.job_id] = (p.busy[0], p.busy[1], spec.steps or 1)
            model_id = p.group.loads[message.model].model_id if message.model in p.group.loads else "sim"
            return SampleReply(latents=latents_bytes(spec, model_id=model_id),
                               adapters_held=tuple(a.sha256 for a in message.adapters))
        if isinstance(message, DecodeCall):
            w.encodes[message.job_id] = p.done_at + self.costs.draw(self.costs.encode_s, self._rng)
            w.sample_ends.pop(message.job_id, None)
            return DecodeReply(decode_s=seconds)
        if isinstance(message, CollectCall):
            spec = w.specs.pop(message.job_id)
            return CollectReply(mp4=mp4_bytes(spec.frames, spec.width, spec.height, spec.fps),
                                encode_s=self.costs.encode_s, check_s=0.0)
        return None  # a stop (the sampling runs on: it ends as if the stop came too late), a fetch

    @staticmethod
    def _job_of(message: WorkerCall) -> str | None:
        return getattr(message, "job_id", None)

    def _death(self, group: Group, what: str, *, kind: FailureKind) -> GroupDied:
        return GroupDied(f"worker rank 0 of group {group.id} {what}", kind=kind)

    # ------------------------------------------------------------------ time passes
    def wait(self, calls: Sequence[Call], *, timeout_s: float) -> list[Call]:
        """The calls among ``calls`` that have ended; when none has, time passes (the clock's way)
        until the next call ends."""
        self._advance(self.clock.now())
        wanted = {id(c) for c in calls}
        if calls and not any(id(c) in wanted for c in self._finished) and (at := self._next_at()) is not None:
            self.clock.wait_until(at, timeout_s=timeout_s)
            self._advance(self.clock.now())
        ready = [c for c in self._finished if id(c) in wanted]
        self._finished = []  # the rest nobody waits for: a stop's answer, a torn-down group's calls
        return ready

    def _next_at(self) -> float | None:
        """When the next call ends (or a node leaves or comes back); None: nothing is in flight. A
        call that ended early (its group died) keeps its place in the heap until it comes up."""
        while self._events and isinstance(event := self._events[0][2], _Pending) and event.ended:
            heapq.heappop(self._events)
        return self._events[0][0] if self._events else None

    def _advance(self, now: float) -> None:
        """End every call (and apply every node loss) due by ``now``, in time order."""
        while self._events and self._events[0][0] <= now:
            at, _, event = heapq.heappop(self._events)
            if isinstance(event, NodeLoss):
                self._node_event(event, at)
            elif not event.ended:
                self._end(event)
                if event.dies:
                    self._kill(event.group, f"died in {type(event.message).__name__}",
                               kind=FailureKind.WORKER_DEATH, log="torn-down", told={self._job_of(event.message)})

    def _end(self, p: _Pending) -> None:
        p.ended = True
        w: _Workers = p.group.handle
        w.in_flight.pop(id(p), None)
        if isinstance(p.message, SampleCall):
            self._sampling.pop(p.message.progress_key or p.message.job_id, None)
        if p.dies:
            self.record.fault(self._job_of(p.message), p.message, "death", at=p.done_at)
        elif isinstance(p.outcome, Reply) and p.outcome.failure is not None:
            self.record.fault(self._job_of(p.message), p.message, "failure", at=p.done_at)
        self.record.ended(p.message, p.group, self._job_of(p.message))
        assert p.call is not None
        self._finished.append(p.call)

    def _kill(self, group: Group, what: str, *, kind: FailureKind, log: str | None, lost: bool = False,
              told: set[str | None] | None = None) -> None:
        """The group's workers are gone: every call in flight on it ends now, failing; each job's
        first one is a fault of the record's (``told``: jobs whose fault it has already)."""
        w: _Workers = group.handle
        w.dead, w.lost = True, w.lost or lost
        now, told = self.clock.now(), set(told or ())
        for p in list(w.in_flight.values()):
            p.done_at, p.dies = now, False  # (its own death, if one was drawn, never comes)
            p.outcome = self._death(group, what, kind=kind)
            if p.busy is not None:
                self.record.cut(p.busy, now)
            job = self._job_of(p.message)
            if log is not None and (job is None or job not in told):  # (a sampling's side call is the same job's)
                told.add(job)
                self.record.fault(job, p.message, log, at=now)
            self._end(p)

    def _node_event(self, loss: NodeLoss, at: float) -> None:
        node = self._nodes[loss.node]
        if node.alive:
            node.alive, node.free = False, set()
            self.record.node(loss.node, node.size, alive=False, at=at)
            for group in list(node.groups.values()):
                self._kill(group, f"was on node {loss.node}, which left the cluster", kind=FailureKind.CLUSTER_LOST,
                           log="lost", lost=True)
            node.groups.clear()
            if loss.back_after_s is not None:
                heapq.heappush(self._events, (at + loss.back_after_s, next(self._order), loss))
        else:  # it comes back, its GPUs free
            node.alive, node.free, node.epoch = True, set(range(node.size)), node.epoch + 1
            self.record.node(loss.node, node.size, alive=True, at=at)

    def result(self, call: Call) -> Reply[Any]:
        p: _Pending = call.handle
        assert p.ended, "result() of a call wait() did not return"
        if isinstance(p.outcome, GroupDied):
            if p.outcome.kind is not FailureKind.CLUSTER_LOST and self.lacks_gpus_for(call.group.size):
                raise GroupDied(f"{p.outcome} (the cluster lost the GPUs it needs)",
                                kind=FailureKind.CLUSTER_LOST) from p.outcome
            raise p.outcome
        return p.outcome
