"""Planning before a run: how long will this batch take?

Every job gets an estimate of its seconds per stage on one GPU, taken from

1. **earlier runs**: the stage seconds recorded in ledgers (the output folder's own and those of
   the folders beside it, e.g. ``renders/*``) for done jobs with the same model, size
   (width x height x frames), group size and guidance on/off; sampling scales per step; or else
2. **the reference table** (:data:`REFERENCES`): one measured job per model kind, scaled to the
   job's latent token count, its steps and guidance; the figures and where they were measured are
   in docs/performance.md ("Planning estimates").

The batch's wall time comes from placing the jobs, in order, on the GPUs the run would use (a job
of ``gpus: N`` takes N GPUs at once and runs in 1/N of its one-GPU time: sequence-parallel groups
measured 1.8-2.0x on 2 GPUs, so this is optimistic), plus one group start per group size.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from pan2render.jobs.batch import TINY_MODEL
from pan2render.jobs.inputs import dit_tokens
from pan2render.jobs.ledger import LEDGER_NAME, JobState, Ledger, Stage
from pan2render.jobs.spec import JobSpec


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one job on one GPU: text conditioning, one sampling step, decode, mp4 encode."""

    conditioning: float
    per_step: float
    decode: float
    encode: float

    def job_seconds(self, steps: int) -> float:
        return self.conditioning + self.per_step * steps + self.decode + self.encode


@dataclass(frozen=True)
class Reference:
    """One measured job: where, its size, guided steps, its stage seconds and a group's start."""

    where: str
    width: int
    height: int
    frames: int
    times: StageTimes
    group_start_s: float  # command start -> first job running (Ray, weights, first-call compiles)


# Measured figures, documented in docs/performance.md ("Planning estimates"). Guided steps
# (two forwards); an unguided step costs about half.
REFERENCES: dict[str, Reference] = {
    "checkpoint": Reference(
        where="one H200, full-size checkpoint", width=1248, height=704, frames=121,
        times=StageTimes(conditioning=0.7, per_step=1.72, decode=3.1, encode=5.0), group_start_s=45.0),
    TINY_MODEL: Reference(
        where="shared 2-core CPU, tiny model", width=64, height=64, frames=17,
        times=StageTimes(conditioning=0.2, per_step=0.24, decode=2.4, encode=0.1), group_start_s=25.0),
}


def _key(spec: JobSpec) -> tuple[str, int, int, int, int, bool]:
    return (spec.model, spec.width, spec.height, spec.frames, spec.gpus, spec.guidance > 1.0)


@dataclass
class History:
    """Stage seconds of done jobs from earlier runs, by (model, size, gpus, guided)."""

    samples: dict[tuple[str, int, int, int, int, bool], list[StageTimes]] = field(default_factory=dict)
    folders: list[Path] = field(default_factory=list)  # ledgers that gave at least one sample

    @classmethod
    def from_folders(cls, folders: list[Path]) -> "History":
        history = cls()
        for folder in folders:
            if not (folder / LEDGER_NAME).is_file():
                continue
            try:
                ledger = Ledger.open_readonly(folder)
            except Exception:  # noqa: BLE001 - an unreadable old ledger only means no history
                continue
            try:
                n = 0
                for job in ledger.jobs():
                    if job.state is not JobState.DONE:
                        continue
                    st = ledger.stages(job.id)
                    secs = {s: st[s].seconds for s in st}
                    if any(v is None for v in secs.values()):
                        continue
                    times = StageTimes(conditioning=secs[Stage.CONDITIONING],
                                       per_step=secs[Stage.SAMPLING] / job.spec.steps,
                                       decode=secs[Stage.DECODE], encode=secs[Stage.ENCODE])
                    history.samples.setdefault(_key(job.spec), []).append(times)
                    n += 1
            except Exception:  # noqa: BLE001 - a ledger of another schema version: skip it
                continue
            finally:
                ledger.close()
            if n:
                history.folders.append(folder)
        return history

    def times(self, spec: JobSpec) -> StageTimes | None:
        rows = self.samples.get(_key(spec))
        if not rows:
            return None
        # Medians: the first job of a group carries first-call compiles in its stage seconds.
        return StageTimes(*(statistics.median(getattr(r, f) for r in rows)
                            for f in ("conditioning", "per_step", "decode", "encode")))


def history_folders(out: Path | None) -> list[Path]:
    """Where earlier runs are looked for: the output folder and the folders beside it."""
    if out is None:
        return []
    out = out.absolute()
    siblings = sorted(p for p in out.parent.glob("*") if p.is_dir() and p != out) if out.parent.is_dir() else []
    return [out, *siblings]


def reference_for(spec: JobSpec) -> Reference:
    return REFERENCES[TINY_MODEL if spec.model == TINY_MODEL else "checkpoint"]


def reference_times(spec: JobSpec) -> StageTimes:
    """The reference job scaled to this job: sampling and decode by latent tokens (linear: an
    optimistic bound for attention, which is quadratic), encode by pixels, steps by guidance."""
    ref = reference_for(spec)
    tokens = (dit_tokens(frames=spec.frames, height=spec.height, width=spec.width)
              / dit_tokens(frames=ref.frames, height=ref.height, width=ref.width))
    pixels = spec.width * spec.height * spec.frames / (ref.width * ref.height * ref.frames)
    guided = 1.0 if spec.guidance > 1.0 else 0.5
    t = ref.times
    return StageTimes(conditioning=t.conditioning, per_step=t.per_step * tokens * guided,
                      decode=t.decode * tokens, encode=t.encode * pixels)


@dataclass(frozen=True)
class JobEstimate:
    job: JobSpec
    gpu_seconds: float  # on one GPU (a group of N spends the same GPU time, in 1/N the wall time)
    source: str  # "history" or "reference"


@dataclass(frozen=True)
class Plan:
    estimates: list[JobEstimate]
    gpus: int
    gpu_seconds: float
    wall_seconds: float
    history: History

    def sources(self) -> str:
        """Which figures the estimate used, for the user."""
        n_hist = sum(e.source == "history" for e in self.estimates)
        n_ref = len(self.estimates) - n_hist
        parts = []
        if n_hist:
            where = ", ".join(str(f) for f in self.history.folders)
            parts.append(f"{n_hist} job(s) from earlier runs' measured stage seconds (same model and size; {where})")
        if n_ref:
            refs = sorted({reference_for(e.job).where for e in self.estimates if e.source == "reference"})
            parts.append(f"{n_ref} job(s) from the reference table ({'; '.join(refs)}; docs/performance.md, "
                         f"\"Planning estimates\")")
        return "; ".join(parts) or "nothing to render"


def plan(jobs: list[JobSpec], *, gpus: int, history: History, group_starts: bool = True) -> Plan:
    """Estimate ``jobs`` (those still to render) on ``gpus`` GPUs, placed in order; with
    ``group_starts``, plus one group start per group size (False: the groups are up already)."""
    estimates = []
    for job in jobs:
        times = history.times(job)
        source = "history" if times is not None else "reference"
        times = times or reference_times(job)
        estimates.append(JobEstimate(job=job, gpu_seconds=times.job_seconds(job.steps), source=source))
    free_at = [0.0] * max(gpus, 1)
    for e in estimates:
        n = min(e.job.gpus, len(free_at))
        chosen = sorted(range(len(free_at)), key=lambda i: free_at[i])[:n]
        start = max(free_at[i] for i in chosen)
        for i in chosen:
            free_at[i] = start + e.gpu_seconds / e.job.gpus
    starts = 0.0
    if group_starts:
        for size in {e.job.gpus for e in estimates}:
            starts += max(reference_for(e.job).group_start_s for e in estimates if e.job.gpus == size)
    wall = max(free_at) + starts if estimates else 0.0
    return Plan(estimates=estimates, gpus=gpus, gpu_seconds=sum(e.gpu_seconds for e in estimates),
                wall_seconds=wall, history=history)
