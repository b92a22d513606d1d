"""One ETA per batch: the wall time its jobs left take, planned (`estimates.plan`) from the
folder's own measured stages where it has done jobs, else the reference table, less what the
running jobs have done (their stages done, a sampling's recorded step).

A function of the ledger alone, never of a clock or of who asks: `status`, `queue`, the farm's
monitor and `run`'s progress line read the same ledger and say the same at the same moment (the
step a sampling records every few seconds is what moves it between two jobs' ends). The groups
are taken as up already (no start-up in it), on the GPUs the folder's last run had.
"""

from __future__ import annotations

import json
from pathlib import Path

from pan2render.jobs.ledger import JobRecord, JobState, Ledger, Stage, StageState
from pan2render.runner.views.estimates import CPU, CUDA, History, Plan, StageTimes, job_devices, ledger_device, plan
from pan2render.runner.views.job_status import long_video_of, superseded

LEFT = (JobState.PENDING, JobState.RUNNING)  # a job the batch still has to render (running: interrupted too)


def this_machine_device() -> str:
    from pan2render.runner.cluster.devices import cuda_gpu_count

    return CUDA if cuda_gpu_count() else CPU


def folder_device(ledger: Ledger) -> str:
    """The device kind the folder's jobs ran on (its params.json, its groups' loads); this
    machine's where they say nothing or both kinds."""
    kinds = set(job_devices(ledger).values()) | ({d} if (d := ledger_device(ledger)) else set())
    return kinds.pop() if len(kinds) == 1 else this_machine_device()


def done_part(ledger: Ledger, job_id: str) -> StageTimes:
    """How much of each stage of a started job is done: 1 for a stage done, a sampling's recorded
    step (or its step checkpoint's) over its steps, 0 otherwise."""
    from pan2render.runner.protocol.artifacts import SAMPLING_STEP_DOC, STEP_CHECKPOINT_DOC  # (numpy)

    stages = ledger.stages(job_id)
    sampled = 0.0
    if stages[Stage.SAMPLING].state is not StageState.DONE:
        for name, key, total in ((SAMPLING_STEP_DOC, "step", "steps"), (STEP_CHECKPOINT_DOC, "step", "total")):
            if (doc := ledger.document(job_id, name)) is not None:
                rec = json.loads(doc)
                sampled = max(sampled, rec[key] / rec[total] if rec.get(total) else 0.0)
        segments = ledger.job(job_id).spec.segments
        if segments > 1:  # the step is the current segment's: the segments before it are done whole
            done = (long_video_of(ledger.path.parent, ledger.job(job_id)) or {}).get("segments_done", 0)
            sampled = min(1.0, (done + sampled) / segments)
    return StageTimes(*(1.0 if stages[s].state is StageState.DONE else sampled if s is Stage.SAMPLING else 0.0
                        for s in (Stage.CONDITIONING, Stage.SAMPLING, Stage.DECODE, Stage.ENCODE)))


class BatchEta:
    """The ETA of one batch of a folder (``job_ids``; None: every job of the ledger) on ``gpus``
    GPUs. The folder's history is read again only when its count of done jobs changes: the farm
    asks at every snapshot."""

    def __init__(self, out_dir: Path, job_ids: list[str] | None, *, gpus: int):
        self.out_dir, self.job_ids, self.gpus = out_dir, job_ids, gpus
        self._history: tuple[int, History] | None = None

    def plan(self, ledger: Ledger, jobs: list[JobRecord] | None = None) -> Plan | None:
        """The plan of the jobs left (None: none left); ``jobs``: the ledger's, where the caller read
        them already (`status`)."""
        jobs = ledger.jobs() if jobs is None else jobs
        wanted = None if self.job_ids is None else set(self.job_ids)
        old = superseded(jobs)  # (a version the batch was edited away from is not rendered)
        left = [j for j in jobs if j.state in LEFT and j.id not in old and (wanted is None or j.id in wanted)]
        if not left:
            return None
        done = sum(j.state is JobState.DONE for j in jobs)
        if self._history is None or self._history[0] != done:
            self._history = (done, History.from_folders([self.out_dir]))
        return plan([j.spec for j in left], gpus=self.gpus, history=self._history[1], device=folder_device(ledger),
                    group_starts=False, started=_started(ledger, left))

    def seconds(self, ledger: Ledger) -> float | None:
        the_plan = self.plan(ledger)
        return None if the_plan is None else the_plan.wall_seconds


def _started(ledger: Ledger, left: list[JobRecord]) -> dict[str, StageTimes]:
    """The running jobs' done parts (a pending job counts whole: reading every job's stages at
    every snapshot of a 20,000-job batch would cost more than the estimate is worth)."""
    return {j.id: done_part(ledger, j.id) for j in left if j.state is JobState.RUNNING}
