"""Fast lanes for guided sampling: a step cache (MagCache), guidance gating and FP8 matmuls.

Torch-free rules shared by the job schema (``pan2render.jobs``), the sampler
(``pan2render.models.pipeline``), the driver (params.json) and ``pan2-render compare``: the
settings (`FastLanes`), the per-step plan they give (`plan_sampling`: which guidance branch computes
its forward, which reuses its cached block residual, which does not run) and the published
calibration the step cache falls back to.

Every decision here is a pure function of the settings, the step count and a calibration, never of
the tensors of the run: each rank of a group derives the same plan, and a benchmark's speed figures
do not depend on its random weights.

**MagCache** (Ma et al., "MagCache: Fast Video Generation with Magnitude-Aware Cache",
arXiv:2506.09045; reference code Zehong-Ma/MagCache, MagCache4Wan2.2/magcache_generate.py). The
DiT's block residual ``r_i = blocks(x_i) - x_i`` changes slowly in magnitude; ``gamma_i =
mean_tokens ||r_i|| / ||r_{i-1}||`` (per guidance branch, calibrated once per model) is near 1 for
most of a run. Per branch, each step outside the first ``retention`` part multiplies an accumulated
ratio by ``gamma_i``, counts one more skip and adds ``|1 - accumulated ratio|`` to an accumulated
error; while that error stays under ``threshold`` and no more than ``max_skips`` (K) steps in a row
were skipped, the step reuses the last computed residual (``x_i + r_cached``: the patch embedding and
the head still run, the 30 blocks do not); otherwise it computes and the three accumulators reset.
As in the reference, the cond and uncond branches keep separate state and separate residuals, and
the first part kept exact counts model calls (two per guided step): call ``2 i + b`` of branch b at
step i is retained while ``2 i + b < int(2 N * retention)``. One rule of ours: a branch's first
evaluation always computes (with retention 0 the reference would reuse a residual it never cached).

**Guidance gating** (FastVideo's CFG gating, after Castillo et al.'s Adaptive Guidance): the first
``guided_steps(N, guidance_until)`` steps run both branches; after them only the conditional one,
plus ``(guidance - 1)`` times the last ``cond - uncond`` difference a guided step computed:
``uncond + g (cond - uncond) = cond + (g - 1)(cond - uncond)``. ``guidance_until`` 1 runs every step
guided: today's path exactly.

**FP8** (``precision: fp8``): the DiT's per-token linears in float8 e4m3 with per-row scales
(``pan2render.kernels.fp8``); nothing here decides anything about it beyond its name.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pan2render.sampling import DMD, is_int

CACHE_NONE = "none"
MAGCACHE = "magcache"
CACHES: tuple[str, ...] = (CACHE_NONE, MAGCACHE)
BF16 = "bf16"
FP8 = "fp8"
PRECISIONS: tuple[str, ...] = (BF16, FP8)

# MagCache's published setting for Wan2.2-TI2V-5B at 1280x704 ("E006K2R02": threshold 0.06, K=2,
# retention 0.2; Zehong-Ma/MagCache, MagCache4Wan2.2/README.md, 1.97x on one L20).
DEFAULT_CACHE_THRESHOLD = 0.06
DEFAULT_CACHE_MAX_SKIPS = 2
DEFAULT_CACHE_RETENTION = 0.2
# 1: every step guided (no gating).
DEFAULT_GUIDANCE_UNTIL = 1.0

# The fast-lane job fields (jobs.spec declares each), in the order params.json and compare list them.
FAST_LANE_FIELDS: tuple[str, ...] = ("cache", "cache_threshold", "cache_max_skips", "cache_retention",
                                     "guidance_until", "precision")


class Branch(enum.IntEnum):
    """A classifier-free guidance branch; the value is its index in MagCache's interleaved lists."""

    COND = 0
    UNCOND = 1


class Action(enum.Enum):
    """What one branch does at one step."""

    COMPUTE = "compute"  # the whole forward; its block residual is kept
    REUSE = "reuse"  # the patch embedding, the kept residual and the head: no block runs
    ABSENT = "absent"  # not run (an unguided job's uncond branch, or a gated step's)


@dataclass(frozen=True)
class FastLanes:
    """One job's fast-lane settings (the job fields of the same names)."""

    cache: str = CACHE_NONE
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD  # MagCache: accumulated error allowed before a compute
    cache_max_skips: int = DEFAULT_CACHE_MAX_SKIPS  # MagCache K: consecutive reused steps at most
    cache_retention: float = DEFAULT_CACHE_RETENTION  # MagCache: first fraction of model calls kept exact
    guidance_until: float = DEFAULT_GUIDANCE_UNTIL  # fraction of steps run with both guidance branches
    precision: str = BF16  # the DiT's per-token linears: bf16, or fp8 e4m3 with per-row scales

    def __post_init__(self) -> None:
        problems = [f"{name}={getattr(self, name)!r}: {message}" for name, message in self.problems()]
        if problems:
            raise ValueError("invalid fast-lane settings: " + "; ".join(problems))

    def problems(self) -> list[tuple[str, str]]:
        """(field, what is allowed) for every value out of range (the batch check words its own)."""
        out: list[tuple[str, str]] = []
        if self.cache not in CACHES:
            out.append(("cache", f"allowed: {', '.join(CACHES)}"))
        if not _number_in(self.cache_threshold, 0.0, math.inf):
            out.append(("cache_threshold", "allowed: a number >= 0"))
        if not (is_int(self.cache_max_skips) and self.cache_max_skips >= 0):
            out.append(("cache_max_skips", "allowed: an integer >= 0"))
        if not _number_in(self.cache_retention, 0.0, 1.0):
            out.append(("cache_retention", "allowed: a number from 0 to 1"))
        if not _number_in(self.guidance_until, 0.0, 1.0) or self.guidance_until == 0:
            out.append(("guidance_until", "allowed: a number > 0 and <= 1"))
        if self.precision not in PRECISIONS:
            out.append(("precision", f"allowed: {', '.join(PRECISIONS)}"))
        return out

    @property
    def steps_exact(self) -> bool:
        """No cache and no gating: every step runs today's forwards (the precision may still differ)."""
        return self.cache == CACHE_NONE and self.guidance_until == 1.0

    @property
    def exact(self) -> bool:
        return self.steps_exact and self.precision == BF16

    @classmethod
    def of(cls, values: dict[str, Any]) -> "FastLanes":
        """From a mapping holding (some of) `FAST_LANE_FIELDS` (a job's sampling arguments)."""
        return cls(**{k: values[k] for k in FAST_LANE_FIELDS if k in values})


def _number_in(value: object, lo: float, hi: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and lo <= value <= hi)


def lane_problems(*, sampler: str, cache: str) -> list[tuple[str, str]]:
    """(field, message) for every rule a fast lane breaks with the rest of the job."""
    if cache != CACHE_NONE and sampler == DMD:
        return [("cache", f"got {cache} with sampler dmd; allowed: none (a step-distilled checkpoint's few "
                          "steps each move far: MagCache's ratios are calibrated on many-step samplers)")]
    return []


def guided_steps(steps: int, guidance_until: float) -> int:
    """How many first steps run both guidance branches: ``floor(N * guidance_until)``, at least one
    (a gated step needs a difference to reuse). FastVideo's ``int(len(timesteps) * fraction)``; the
    1e-9 keeps e.g. 100 * 0.29 = 28.999999999999996 at 29."""
    return min(steps, max(1, math.floor(steps * guidance_until + 1e-9)))


# --------------------------------------------------------------------------------------------------
# Calibration


class CalibrationMissing(ValueError):
    """A cached job's model has no usable calibration for its kind of job (deterministic: the same on
    any worker, so never retried); the message starts with the command that makes one."""


def nearest_interp(values: Sequence[float], length: int) -> list[float]:
    """MagCache's step-count interpolation of one branch's ratios: entry j of the result is
    ``values[round(j * (len - 1) / (length - 1))]`` (numpy's round: half to even); one step takes the
    last value."""
    if length < 1 or not values:
        raise ValueError(f"cannot interpolate {len(values)} ratios to {length} steps")
    if length == 1:
        return [float(values[-1])]
    scale = (len(values) - 1) / (length - 1)
    return [float(values[round(j * scale)]) for j in range(length)]


@dataclass(frozen=True)
class Calibration:
    """MagCache's magnitude ratios for one model: per branch, step i's ``gamma_i`` (step 0 is 1.0,
    having no step before it), measured on one exact run of ``steps`` steps."""

    cond: tuple[float, ...]
    uncond: tuple[float, ...]  # empty for a calibration of an unguided run
    source: str  # where the ratios come from (a file, or the publication)
    settings: dict[str, Any] = field(default_factory=dict)  # the run they were measured on

    def __post_init__(self) -> None:
        if not self.cond or (self.uncond and len(self.uncond) != len(self.cond)):
            raise ValueError(f"{self.source}: {len(self.cond)} cond and {len(self.uncond)} uncond ratios: "
                             "expected one per step for each branch calibrated")
        bad = [r for r in (*self.cond, *self.uncond) if not _number_in(r, 0.0, math.inf)]
        if bad:
            raise ValueError(f"{self.source}: magnitude ratio {bad[0]!r} is not a finite number >= 0")

    @property
    def steps(self) -> int:
        return len(self.cond)

    def ratios(self, branch: Branch, steps: int) -> list[float]:
        """``branch``'s ratios for a run of ``steps`` steps (nearest-interpolated when it differs)."""
        values = self.cond if branch is Branch.COND else self.uncond
        if not values:
            raise CalibrationMissing(f"{self.source}: calibrated on an unguided run: no {branch.name.lower()} "
                                     "ratios; calibrate with guidance > 1 to cache guided jobs")
        return nearest_interp(values, steps)

    @classmethod
    def interleaved(cls, values: Sequence[float], *, source: str, settings: dict[str, Any]) -> "Calibration":
        """From MagCache's published layout: (cond, uncond) pairs for steps 1.. N-1, step 0 left out."""
        if len(values) % 2:
            raise ValueError(f"{source}: an interleaved list needs (cond, uncond) pairs, got {len(values)} values")
        return cls(cond=(1.0, *values[0::2]), uncond=(1.0, *values[1::2]), source=source, settings=settings)

    def to_json(self) -> dict[str, Any]:
        return {"cond": list(self.cond), "uncond": list(self.uncond), "source": self.source,
                "settings": dict(self.settings)}

    @classmethod
    def from_json(cls, d: dict[str, Any], *, source: str) -> "Calibration":
        try:
            return cls(cond=tuple(d["cond"]), uncond=tuple(d.get("uncond") or ()), source=source,
                       settings=dict(d.get("settings") or {}))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{source}: not a MagCache calibration ({e})") from e


# MagCache's published magnitude ratios for Wan2.2-TI2V-5B, 50 UniPC steps at 1280x704, guidance
# 5.0, flow shift 5.0: Zehong-Ma/MagCache, MagCache4Wan2.2/magcache_generate.py, the `ti2v` task's
# lists (text-only jobs: `if img is None`; image-conditioned jobs: the other), (cond, uncond) per
# step from step 1. The text-only list is also `wan2.2_ti2v_5B` in Zehong-Ma/ComfyUI-MagCache
# nodes.py. Other step counts take MagCache's nearest interpolation (`nearest_interp`).
_PUBLISHED_TI2V_5B_T2V = (
    0.99505, 0.99389, 0.99441, 0.9957, 0.99558, 0.99551, 0.99499, 0.9945, 0.99534, 0.99548, 0.99468,
    0.9946, 0.99463, 0.99458, 0.9946, 0.99453, 0.99408, 0.99404, 0.9945, 0.99441, 0.99409, 0.99398,
    0.99403, 0.99397, 0.99382, 0.99377, 0.99349, 0.99343, 0.99377, 0.99378, 0.9933, 0.99328,
    0.99303, 0.99301, 0.99217, 0.99216, 0.992, 0.99201, 0.99201, 0.99202, 0.99133, 0.99132, 0.99112,
    0.9911, 0.99155, 0.99155, 0.98958, 0.98957, 0.98959, 0.98958, 0.98838, 0.98835, 0.98826,
    0.98825, 0.9883, 0.98828, 0.98711, 0.98709, 0.98562, 0.98561, 0.98511, 0.9851, 0.98414, 0.98412,
    0.98284, 0.98282, 0.98104, 0.98101, 0.97981, 0.97979, 0.97849, 0.97849, 0.97557, 0.97554,
    0.97398, 0.97395, 0.97171, 0.97166, 0.96917, 0.96913, 0.96511, 0.96507, 0.96263, 0.96257,
    0.95839, 0.95835, 0.95483, 0.95475, 0.94942, 0.94936, 0.9468, 0.94678, 0.94583, 0.94594,
    0.94843, 0.94872, 0.96949, 0.97015,
)
_PUBLISHED_TI2V_5B_I2V = (
    0.99512, 0.99559, 0.99559, 0.99561, 0.99595, 0.99577, 0.99512, 0.99512, 0.99546, 0.99534,
    0.99543, 0.99531, 0.99496, 0.99491, 0.99504, 0.99499, 0.99444, 0.99449, 0.99481, 0.99481,
    0.99435, 0.99435, 0.9943, 0.99431, 0.99411, 0.99406, 0.99373, 0.99376, 0.99413, 0.99405,
    0.99363, 0.99359, 0.99335, 0.99331, 0.99244, 0.99243, 0.99229, 0.99229, 0.99239, 0.99236,
    0.99163, 0.9916, 0.99149, 0.99151, 0.99191, 0.99192, 0.9898, 0.98981, 0.9899, 0.98987, 0.98849,
    0.98849, 0.98846, 0.98846, 0.98861, 0.98861, 0.9874, 0.98738, 0.98588, 0.98589, 0.98539,
    0.98534, 0.98444, 0.98439, 0.9831, 0.98309, 0.98119, 0.98118, 0.98001, 0.98, 0.97862, 0.97859,
    0.97555, 0.97558, 0.97392, 0.97388, 0.97152, 0.97145, 0.96871, 0.9687, 0.96435, 0.96434,
    0.96129, 0.96127, 0.95639, 0.95638, 0.95176, 0.95175, 0.94446, 0.94452, 0.93972, 0.93974,
    0.93575, 0.9359, 0.93537, 0.93552, 0.96655, 0.96616,
)
_PUBLISHED_SETTINGS = {"model": "Wan2.2-TI2V-5B", "steps": 50, "width": 1280, "height": 704, "guidance": 5.0,
                       "flow_shift": 5.0, "sampler": "unipc"}
_PUBLISHED_SOURCE = "MagCache4Wan2.2/magcache_generate.py (Zehong-Ma/MagCache), Wan2.2-TI2V-5B"


def published_calibration(*, conditioned: bool) -> Calibration:
    """The published Wan2.2-TI2V-5B ratios: the image-conditioned list when ``conditioned``."""
    values = _PUBLISHED_TI2V_5B_I2V if conditioned else _PUBLISHED_TI2V_5B_T2V
    kind = "image-conditioned" if conditioned else "text-only"
    return Calibration.interleaved(values, source=f"{_PUBLISHED_SOURCE} {kind}",
                                   settings={**_PUBLISHED_SETTINGS, "image": conditioned})


# --------------------------------------------------------------------------------------------------
# The plan


def magcache_actions(ratios: Sequence[float], present: Sequence[bool], *, branch: Branch, threshold: float,
                     max_skips: int, retention: float) -> list[Action]:
    """MagCache's decision for one branch at every step (see the module doc). ``ratios[i]``: the
    branch's calibrated ratio at step i; ``present[i]``: whether the branch runs at step i."""
    steps = len(present)
    retained_calls = int(2 * steps * retention)  # the reference's int(num_steps * retention_ratio)
    acc_ratio, acc_err, acc_skips = 1.0, 0.0, 0
    cached = False
    actions: list[Action] = []
    for i, runs in enumerate(present):
        if not runs:
            actions.append(Action.ABSENT)
            continue
        reuse = False
        if cached and 2 * i + branch >= retained_calls:
            acc_ratio *= ratios[i]
            acc_skips += 1
            acc_err += abs(1.0 - acc_ratio)
            reuse = acc_err < threshold and acc_skips <= max_skips
            if not reuse:
                acc_ratio, acc_err, acc_skips = 1.0, 0.0, 0
        cached = True
        actions.append(Action.REUSE if reuse else Action.COMPUTE)
    return actions


@dataclass(frozen=True)
class SamplingPlan:
    """Per step, what each guidance branch does (``steps[i][branch]``), and how it was decided."""

    lanes: FastLanes
    guided: bool  # the job uses classifier-free guidance at all
    guided_steps: int  # steps that run both branches (0 for an unguided job)
    steps: tuple[dict[Branch, Action], ...]
    calibration: Calibration | None = None  # the step cache's, when it has one

    def __len__(self) -> int:
        return len(self.steps)

    def gated(self, i: int) -> bool:
        """Step i of a guided job runs the conditional branch alone (plus the last difference)."""
        return self.guided and i >= self.guided_steps

    def steps_with(self, branch: Branch, action: Action) -> list[int]:
        return [i for i, step in enumerate(self.steps) if step[branch] is action]

    @property
    def forwards(self) -> int:
        """Whole DiT forwards the plan runs (reused steps run only the embedding and the head)."""
        return sum(action is Action.COMPUTE for step in self.steps for action in step.values())

    @property
    def exact_forwards(self) -> int:
        return len(self.steps) * (2 if self.guided else 1)

    def describe(self) -> dict[str, Any]:
        """What params.json records: the settings, which steps computed and reused, per branch."""
        out: dict[str, Any] = {
            "settings": {k: getattr(self.lanes, k) for k in FAST_LANE_FIELDS},
            "steps": len(self.steps),
            "guided_steps": self.guided_steps,
            "forwards": self.forwards,
            "exact_forwards": self.exact_forwards,
        }
        for branch in Branch:
            if branch is Branch.UNCOND and not self.guided:
                continue
            name = branch.name.lower()
            out[f"{name}_computed"] = self.steps_with(branch, Action.COMPUTE)
            out[f"{name}_reused"] = self.steps_with(branch, Action.REUSE)
        if self.calibration is not None:
            cal = self.calibration
            out["calibration"] = {"source": cal.source, "calibrated_steps": cal.steps,
                                  "interpolated": cal.steps != len(self.steps), "settings": cal.settings}
        return out


def plan_sampling(lanes: FastLanes, *, steps: int, guided: bool,
                  calibration: Calibration | None = None) -> SamplingPlan:
    """The plan of a job of ``steps`` steps (``guided``: with classifier-free guidance). A cache
    needs its ``calibration``."""
    if not is_int(steps) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected an integer >= 1")
    g = guided_steps(steps, lanes.guidance_until) if guided else 0
    present = {Branch.COND: [True] * steps, Branch.UNCOND: [guided and i < g for i in range(steps)]}
    if lanes.cache == CACHE_NONE:
        actions = {b: [Action.COMPUTE if p else Action.ABSENT for p in present[b]] for b in Branch}
        calibration = None
    else:
        if calibration is None:
            raise ValueError(f"cache {lanes.cache} needs a calibration")
        actions = {b: magcache_actions(calibration.ratios(b, steps) if any(present[b]) else [1.0] * steps,
                                       present[b], branch=b, threshold=lanes.cache_threshold,
                                       max_skips=lanes.cache_max_skips, retention=lanes.cache_retention)
                   for b in Branch}
    per_step = tuple({b: actions[b][i] for b in Branch} for i in range(steps))
    return SamplingPlan(lanes=lanes, guided=guided, guided_steps=g, steps=per_step, calibration=calibration)
