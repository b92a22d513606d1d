"""Planning before a run: how long will this batch take?

Every job's seconds per stage on one GPU come from a cost model (:class:`CostModel`, documented in
docs/performance.md, "Planning estimates"): a sampling step costs a fixed overhead plus a part per
DiT token and a part per token squared (self-attention), an unguided step half a guided one; the
decode costs a part per latent frame plus a part per output pixel; the encode a part per job plus
a part per pixel.
Its coefficients come from

1. **this machine's own runs**, where a ledger has any (the output folder's own and the folders
   beside it, e.g. ``renders/*``): done jobs of the same model on the same kind of device, of any
   size, step count or group size. Jobs of one size scale the reference's shape to them (one
   factor per stage); jobs of two or more sizes fit the overhead and the per-size part apart; or else
2. **the reference table** (:data:`REFERENCES`): one measured machine per model kind and device,
   scaled to the job and marked as a guess with its range. There is no reference for a full-size
   checkpoint on CPU (logical GPUs): such a job gets no estimate rather than an H200's figure.

The batch's wall time comes from placing the jobs, in order, on the GPUs the run would use (a job
of ``gpus: N`` takes N GPUs at once and runs in 1/N of its one-GPU time: sequence-parallel groups
measured 1.8-2.0x on 2 GPUs, so this is optimistic), plus one group start per group size.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from pan2render.jobs.inputs import dit_tokens
from pan2render.jobs.ledger import LEDGER_NAME, EventKind, JobState, Ledger, Stage
from pan2render.jobs.spec import JobSpec
from pan2render.lanes import guided_steps
from pan2render.long_video import is_long, video_frames
from pan2render.sampling import WAN22
from pan2render.tiny_dit import TINY_MODEL

CPU, CUDA = "cpu", "cuda"  # the device kinds a history sample and a run are matched on
# A dmd job's steps are its timesteps (`steps` None); its checkpoint's own, unread here (no torch),
DMD_OWN_STEPS = 3  # count as the DMD rows measured (docs/performance-history.md)
UNGUIDED_STEP_COST = 0.5  # an unguided step runs one forward where a guided one runs two
# Two sizes this far apart (in tokens, or in pixels for the decode) fit a stage's overhead and its
# per-size part apart; closer, one factor over the reference's shape is the safer guess.
FIT_SPREAD = 1.5
K = TypeVar("K")


# ---------------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class JobSize:
    """What a job's cost depends on."""

    tokens: int  # DiT sequence length
    latent_frames: int
    pixels: int  # frames x height x width of the video
    step_units: float  # steps in guided-step equivalents (an unguided step counts UNGUIDED_STEP_COST)
    segments: int = 1  # clips sampled one after another (a chained job), each of the sizes above
    video_pixels: int = 0  # frames x height x width of the mp4 (segments joined, interpolated); 0: ``pixels``

    @classmethod
    def of(cls, spec: JobSpec) -> JobSize:
        steps = spec.steps if spec.steps is not None else len(spec.timesteps or ()) or DMD_OWN_STEPS
        guided = guided_steps(steps, spec.guidance_until) if spec.guidance > 1.0 else 0
        return cls(tokens=dit_tokens(frames=spec.frames, height=spec.height, width=spec.width),
                   latent_frames=WAN22.latent_frames(spec.frames), pixels=spec.frames * spec.height * spec.width,
                   step_units=guided + (steps - guided) * UNGUIDED_STEP_COST, segments=spec.segments,
                   video_pixels=video_frames(spec) * spec.height * spec.width)


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one job on one GPU, per stage."""

    conditioning: float
    sampling: float
    decode: float
    encode: float

    @property
    def total(self) -> float:
        return self.conditioning + self.sampling + self.decode + self.encode

    @property
    def on_gpu(self) -> float:
        """What holds the group: the encode runs beside the next job's sampling."""
        return self.conditioning + self.sampling + self.decode

    def left(self, done: StageTimes) -> StageTimes:
        """What is left of these times once the fractions ``done`` (0..1 per stage) are."""
        return StageTimes(*(t * (1.0 - d) for t, d in ((self.conditioning, done.conditioning),
                                                        (self.sampling, done.sampling), (self.decode, done.decode),
                                                        (self.encode, done.encode))))


@dataclass(frozen=True)
class CostModel:
    """Seconds of one job's stages on one GPU, as a function of its :class:`JobSize`."""

    conditioning: float  # per job (prompts are encoded together and cached, so a median)
    step_overhead: float  # per guided step, whatever the size (launches, the text side, Python)
    step_per_token: float  # per guided step and DiT token (the linears)
    step_per_token2: float  # per guided step and token squared (self-attention)
    decode_per_latent_frame: float
    decode_per_pixel: float
    encode_overhead: float  # per job: opening the container, the encoder's set-up, the check
    encode_per_pixel: float

    def step(self, tokens: int) -> float:
        return self.step_overhead + self.step_per_token * tokens + self.step_per_token2 * tokens ** 2

    def decode(self, size: JobSize) -> float:
        return self.decode_per_latent_frame * size.latent_frames + self.decode_per_pixel * size.pixels

    def times(self, size: JobSize) -> StageTimes:
        """A chained job samples and decodes each segment once (the video joins the frames its
        segments' decodes kept on the worker); interpolation is not in the model."""
        decodes = size.segments
        return StageTimes(conditioning=self.conditioning,
                          sampling=self.step(size.tokens) * size.step_units * size.segments,
                          decode=self.decode(size) * decodes,
                          encode=self.encode_overhead + self.encode_per_pixel * (size.video_pixels or size.pixels))


@dataclass(frozen=True)
class Reference:
    """One measured machine for a model kind on a device kind: its cost model, a group's start and
    how far another machine of that kind may be from it (``spread``: factors, low and high)."""

    where: str
    cost: CostModel
    group_start_s: float  # command start -> first job running (Ray, weights, warm-up)
    spread: tuple[float, float]


# Measured figures and how they were fitted: docs/performance.md ("Planning estimates").
REFERENCES: dict[tuple[str, str], Reference] = {
    ("checkpoint", CUDA): Reference(
        where="a full-size checkpoint on one H200", group_start_s=30.0, spread=(0.8, 3.0),
        cost=CostModel(conditioning=0.4, step_overhead=0.0, step_per_token=2.86e-5, step_per_token2=1.16e-9,
                       decode_per_latent_frame=0.0, decode_per_pixel=2.82e-8, encode_overhead=0.05,
                       encode_per_pixel=1.4e-8)),
    # An idle machine: with other jobs on its 2 cores the same runs took 10-25x longer, hence the range.
    (TINY_MODEL, CPU): Reference(
        where="the tiny model on an idle 2-core CPU", group_start_s=15.0, spread=(0.5, 25.0),
        cost=CostModel(conditioning=0.03, step_overhead=7.3e-3, step_per_token=1.55e-4, step_per_token2=0.0,
                       decode_per_latent_frame=5.3e-3, decode_per_pixel=1.18e-6, encode_overhead=0.01,
                       encode_per_pixel=2.6e-7)),
}


def model_kind(model: str) -> str:
    return TINY_MODEL if model == TINY_MODEL else "checkpoint"


def reference_for(model: str, device: str) -> Reference | None:
    """The reference for a model on a device kind. The tiny model on a GPU gets the CPU's figures
    (an upper bound); a full-size checkpoint on CPU gets none (an H200's figures would be off by
    orders of magnitude)."""
    kind = model_kind(model)
    return REFERENCES.get((kind, device)) or (REFERENCES[(TINY_MODEL, CPU)] if kind == TINY_MODEL else None)


# ---------------------------------------------------------------------------------------- history
@dataclass(frozen=True)
class Sample:
    """One done job of an earlier run: its size and its stage seconds in GPU-seconds (a group of N
    ran its stages in 1/N of one GPU's time, taken as N times the work)."""

    size: JobSize
    times: StageTimes


@dataclass
class History:
    """Done jobs of earlier runs on this machine, by (model, device kind)."""

    samples: dict[tuple[str, str], list[Sample]] = field(default_factory=dict)
    folders: list[Path] = field(default_factory=list)  # ledgers that gave at least one sample

    @classmethod
    def from_folders(cls, folders: list[Path]) -> History:
        history = cls()
        for folder in folders:
            if not (folder / LEDGER_NAME).is_file():
                continue
            try:
                ledger = Ledger.open_readonly(folder)
            except Exception:  # an unreadable old ledger only means no history
                continue
            try:
                n = history._add(ledger)
            except Exception:  # a ledger of another schema version: skip it
                n = 0
            finally:
                ledger.close()
            if n:
                history.folders.append(folder)
        return history

    def _add(self, ledger: Ledger) -> int:
        # Each job's device as its params.json says (a farm's batch runs on groups loaded for
        # another batch: no group-load event in its own ledger), else the folder's groups'.
        folder = ledger_device(ledger)
        devices = job_devices(ledger) if folder is None else {}  # (each job's params.json: only when needed)
        n = 0
        # Only the done jobs' specs and stage rows are read (the jobs first: a job recorded in
        # between has its rows too).
        done = ledger.jobs([job_id for job_id, state in ledger.job_states().items() if state is JobState.DONE])
        stages = ledger.all_stages([job.id for job in done])
        for job in done:
            device = devices.get(job.id, folder)
            # Not a job invalidated between the two reads (a resume's check), one with no device to
            # match on, nor a long video: its stage rows are several clips', the model is fitted to one clip's.
            if job.state is not JobState.DONE or device is None or is_long(job.spec):
                continue
            st = stages.get(job.id, {})
            secs = [st[s].seconds for s in (Stage.CONDITIONING, Stage.SAMPLING, Stage.DECODE, Stage.ENCODE)]
            if any(v is None for v in secs):
                continue
            times = StageTimes(*(float(v) * job.spec.gpus for v in secs))
            self.samples.setdefault((job.spec.model, device), []).append(Sample(JobSize.of(job.spec), times))
            n += 1
        return n

    def cost(self, model: str, device: str) -> CostModel | None:
        """A cost model fitted to the done jobs of ``model`` on ``device``; None without any."""
        samples = self.samples.get((model, device))
        if not samples:
            return None
        # A model and device the table lacks (a full-size checkpoint on CPU) take the H200's shape:
        # what scaling needs is the split into overhead and per-size parts, not its figures.
        ref = reference_for(model, device) or REFERENCES[("checkpoint", CUDA)]
        return fit(samples, shape=ref.cost)

    @property
    def jobs(self) -> int:
        return sum(len(v) for v in self.samples.values())


_DEVICE = re.compile(r"\bdevice (\w+)")


def ledger_device(ledger: Ledger) -> str | None:
    """The device kind the folder's groups loaded their models on (the group-load events), None
    when none loaded or both kinds did."""
    kinds = {CUDA if m[1] == CUDA else CPU for e in ledger.events() if e.kind is EventKind.GROUP_LOAD
             for m in [_DEVICE.search(e.detail)] if m}
    return kinds.pop() if len(kinds) == 1 else None


def job_devices(ledger: Ledger) -> dict[str, str]:
    """Each done job's device kind, from the GPU layout its params.json records."""
    from pan2render.runner.protocol.outputs import PARAMS_NAME  # (numpy, for the artifacts' checks)

    out = {}
    for job_id, text in ledger.with_document(PARAMS_NAME).items():
        try:
            device = (json.loads(text).get("gpu_layout") or {}).get("device")
        except (ValueError, AttributeError):
            continue
        if isinstance(device, str) and device:
            out[job_id] = CUDA if device.split(":")[0] == CUDA else CPU
    return out


def history_folders(out: Path | None) -> list[Path]:
    """Where earlier runs are looked for: the output folder and the folders beside it."""
    if out is None:
        return []
    out = out.absolute()
    siblings = sorted(p for p in out.parent.glob("*") if p.is_dir() and p != out) if out.parent.is_dir() else []
    return [out, *siblings]


# ---------------------------------------------------------------------------------------- fitting
def fit(samples: Sequence[Sample], *, shape: CostModel) -> CostModel:
    """``shape`` (the reference's coefficients) fitted to measured jobs, stage by stage: the
    sampling over seconds per guided step, the decode over its seconds, each split into its
    overhead and its per-size part where the samples' sizes are far enough apart, else scaled by one
    factor, and the encode likewise; conditioning takes the samples' median."""
    steps = _typical_by([(s.size.tokens, s.times.sampling / s.size.step_units) for s in samples if s.size.step_units])
    step_fixed, step_sized = _fit_two([(shape.step_overhead, shape.step(n) - shape.step_overhead, t)
                                       for n, t in steps], slowed=SLOWDOWN_SHARE.step)
    decodes = _typical_by([((s.size.latent_frames, s.size.pixels), s.times.decode) for s in samples])
    dec_fixed, dec_sized = _fit_two([(shape.decode_per_latent_frame * f, shape.decode_per_pixel * p, t)
                                     for (f, p), t in decodes], slowed=SLOWDOWN_SHARE.decode)
    encodes = _typical_by([(s.size.pixels, s.times.encode) for s in samples])
    enc_fixed, enc_sized = _fit_two([(shape.encode_overhead, shape.encode_per_pixel * p, t) for p, t in encodes],
                                    slowed=SLOWDOWN_SHARE.encode)
    return replace(shape, conditioning=statistics.median(s.times.conditioning for s in samples),
                   step_overhead=shape.step_overhead * step_fixed, step_per_token=shape.step_per_token * step_sized,
                   step_per_token2=shape.step_per_token2 * step_sized,
                   decode_per_latent_frame=shape.decode_per_latent_frame * dec_fixed,
                   decode_per_pixel=shape.decode_per_pixel * dec_sized,
                   encode_overhead=shape.encode_overhead * enc_fixed,
                   encode_per_pixel=shape.encode_per_pixel * enc_sized)


def _typical_by(pairs: list[tuple[K, float]]) -> list[tuple[K, float]]:
    """One point per size: the lower quartile of its measurements (the smallest of up to four).
    Delays only ever add to a measurement: a group's first job carries first-call compiles in its
    stage seconds, and other work on a shared machine slows some jobs and not others."""
    by: dict[K, list[float]] = {}
    for key, value in pairs:
        by.setdefault(key, []).append(value)
    return [(key, sorted(values)[(len(values) - 1) // 4]) for key, values in by.items()]


@dataclass(frozen=True)
class SlowdownShare:
    """Per stage, how much of a slowdown against the reference the per-size part takes, as an
    exponent: a machine k times slower at one size is taken as k**share slower in its per-size
    part, the overhead taking the rest. Fitted to the tiny model's two CPU measurements, idle and
    with other work on the 2 cores (docs/performance.md, "Planning estimates"): other processes slow
    the many small calls of the overhead far more than the arithmetic."""

    step: float
    decode: float
    encode: float


SLOWDOWN_SHARE = SlowdownShare(step=0.75, decode=0.36, encode=0.3)


def _fit_two(points: list[tuple[float, float, float]], *, slowed: float) -> tuple[float, float]:
    """Factors (a, b) on the reference's parts of each measured size, ``(fixed, sized, seconds)``,
    so that ``seconds ~ a fixed + b sized``: least squares on the relative error where the sized
    parts span FIT_SPREAD or more and both factors come out positive; else from the median ratio k
    of measured seconds to the reference's: one factor on both where this machine is as fast or
    faster, and where it is slower ``b = k ** slowed`` with the overhead taking the rest."""
    sized = [g for f, g, t in points if g > 0]
    if len(sized) >= 2 and max(sized) / min(sized) >= FIT_SPREAD and all(f > 0 for f, _, _ in points):
        rows = [(f / t, g / t) for f, g, t in points if t > 0]
        sff, sgg = sum(f * f for f, _ in rows), sum(g * g for _, g in rows)
        sfg, sf, sg = sum(f * g for f, g in rows), sum(f for f, _ in rows), sum(g for _, g in rows)
        det = sff * sgg - sfg * sfg  # the normal equations of sum((a f + b g) / t - 1)^2, a 2x2 system
        if det > 1e-9 * sff * sgg:
            a, b = (sf * sgg - sg * sfg) / det, (sg * sff - sf * sfg) / det
            if a > 0 and b > 0:
                return a, b
    ratios = [t / (f + g) for f, g, t in points if f + g > 0]
    k = statistics.median(ratios) if ratios else 1.0
    if k > 1 and all(f > 0 for f, _, _ in points):
        b = k ** slowed
        a = statistics.median((t - b * g) / f for f, g, t in points)
        if a >= b:
            return a, b
    return k, k


# ---------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class JobEstimate:
    job: JobSpec
    times: StageTimes | None  # on one GPU; None: nothing to estimate from
    source: str  # "history", "reference" or "none"
    spread: tuple[float, float] = (1.0, 1.0)  # a reference's range, as factors

    @property
    def gpu_seconds(self) -> float:
        """On one GPU (a group of N spends the same GPU time, in 1/N the wall time); 0 when unknown."""
        return 0.0 if self.times is None else self.times.total


@dataclass(frozen=True)
class Plan:
    estimates: list[JobEstimate]
    gpus: int
    device: str
    gpu_seconds: float
    wall_seconds: float
    history: History
    spread: tuple[float, float]  # the range of the whole estimate, as factors (1, 1: all measured)

    @property
    def unknown(self) -> list[JobEstimate]:
        return [e for e in self.estimates if e.source == "none"]

    def sources(self) -> str:
        """Which figures the estimate used, in one line."""
        n_hist = sum(e.source == "history" for e in self.estimates)
        refs = sorted({reference_for(e.job.model, self.device).where  # type: ignore[union-attr]
                       for e in self.estimates if e.source == "reference"})
        n_ref = sum(e.source == "reference" for e in self.estimates)
        parts = []
        if n_hist:
            where = ", ".join(str(f) for f in self.history.folders)
            parts.append(f"{n_hist} job(s) from this machine's runs ({self.history.jobs} done job(s) in {where}, "
                         f"scaled to each job's size and steps)")
        if n_ref:
            parts.append(f"{n_ref} job(s) a guess from the reference table ({'; '.join(refs)}): no done job of that "
                         f"model on this kind of device in the output folder or the folders beside it (--out DIR); "
                         f"the first one makes the estimate this machine's")
        if self.unknown:
            models = ", ".join(sorted({e.job.model for e in self.unknown}))
            parts.append(f"{len(self.unknown)} job(s) without an estimate ({models} has not run here on "
                         f"{'CPU' if self.device == CPU else 'a GPU'}, and the reference table has no figure for it)")
        return "; ".join(parts) + "; see docs/performance.md, \"Planning estimates\"" if parts else "nothing to render"


def plan(jobs: list[JobSpec], *, gpus: int, history: History, device: str = CUDA,
         group_starts: bool = True, started: Mapping[str, StageTimes] | None = None) -> Plan:
    """Estimate ``jobs`` (those still to render) on ``gpus`` GPUs of ``device`` kind (``cpu``:
    logical GPUs on a CPU), placed in order; with ``group_starts``, plus one group start per group
    size (False: the groups are up already). ``started``: job id -> the fraction of each stage done
    (a running job: only what is left of it is counted)."""
    fitted = {model: history.cost(model, device) for model in {job.model for job in jobs}}  # once per model
    estimates = [_estimate(job, fitted[job.model], device) for job in jobs]
    if started:
        estimates = [replace(e, times=e.times.left(started[e.job.job_id]))
                     if e.times is not None and e.job.job_id in started else e for e in estimates]
    free_at = [0.0] * max(gpus, 1)
    last_encode = 0.0
    for e in estimates:
        if e.times is None:
            continue
        n = min(e.job.gpus, len(free_at))
        chosen = sorted(range(len(free_at)), key=lambda i: free_at[i])[:n]
        start = max(free_at[i] for i in chosen)
        for i in chosen:
            free_at[i] = start + e.times.on_gpu / e.job.gpus
        last_encode = e.times.encode / e.job.gpus
    starts = 0.0
    if group_starts:
        for size in {e.job.gpus for e in estimates}:
            refs = [reference_for(e.job.model, device) for e in estimates if e.job.gpus == size]
            starts += max((r.group_start_s for r in refs if r is not None), default=0.0)
    known = [e for e in estimates if e.times is not None]
    wall = max(free_at) + last_encode + starts if known else 0.0
    total = sum(e.gpu_seconds for e in estimates)
    # A guess counts with its reference's range, a measured estimate as it is (by its source: a
    # membership test in the list of guesses compared whole JobSpecs, quadratic in the jobs).
    low = sum(e.gpu_seconds * (e.spread[0] if e.source == "reference" else 1.0) for e in known)
    high = sum(e.gpu_seconds * (e.spread[1] if e.source == "reference" else 1.0) for e in known)
    spread = (low / total, high / total) if total else (1.0, 1.0)
    return Plan(estimates=estimates, gpus=gpus, device=device, gpu_seconds=total, wall_seconds=wall,
                history=history, spread=spread)


def _estimate(job: JobSpec, measured: CostModel | None, device: str) -> JobEstimate:
    """``measured``: the cost model fitted to this machine's runs of the job's model, if any."""
    size = JobSize.of(job)
    if measured is not None:
        return JobEstimate(job=job, times=measured.times(size), source="history")
    if (ref := reference_for(job.model, device)) is not None:
        return JobEstimate(job=job, times=ref.cost.times(size), source="reference", spread=ref.spread)
    return JobEstimate(job=job, times=None, source="none")
