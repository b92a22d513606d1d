"""The fast lanes' plan (pan2render.lanes): MagCache's skip schedule against a re-statement of the
reference code, its determinism, guidance gating's step count, the published calibration."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pan2render.lanes import (
    Action,
    Branch,
    Calibration,
    FastLanes,
    guided_steps,
    magcache_actions,
    nearest_interp,
    plan_sampling,
    published_calibration,
)


def reference_schedule(mag_ratios: list[float], *, steps: int, thresh: float, k: int, retention: float,
                       uncond_calls: int) -> dict[int, list[str]]:
    """MagCache4Wan2.2's ``magcache_forward`` (ti2v), re-stated call by call: one call per branch
    per step, cond then uncond (``cnt % 2``), the interleaved ratio list indexed by ``cnt``, state
    kept per branch. Two additions the reference lacks: a branch's first call computes (the
    reference would reuse a residual it never cached), and after ``uncond_calls`` steps the
    uncond calls stop (guidance gating)."""
    num_steps = steps * 2
    acc_ratio, acc_err, acc_steps = [1.0, 1.0], [0.0, 0.0], [0, 0]
    cached = [False, False]
    out: dict[int, list[str]] = {0: [], 1: []}
    for cnt in range(num_steps):
        b = cnt % 2
        if b == 1 and cnt // 2 >= uncond_calls:
            out[b].append("absent")
            continue
        use_magcache = cnt >= int(num_steps * retention) and cached[b]
        skip = False
        if use_magcache:
            acc_ratio[b] = acc_ratio[b] * mag_ratios[cnt]
            acc_steps[b] += 1
            acc_err[b] += np.abs(1 - acc_ratio[b])
            if acc_err[b] < thresh and acc_steps[b] <= k:
                skip = True
            else:
                acc_err[b], acc_steps[b], acc_ratio[b] = 0, 0, 1.0
        cached[b] = True
        out[b].append("reuse" if skip else "compute")
    return out


def _interleaved(cal: Calibration, steps: int) -> list[float]:
    c, u = cal.ratios(Branch.COND, steps), cal.ratios(Branch.UNCOND, steps)
    return [x for pair in zip(c, u) for x in pair]


def _synthetic(seed: int, steps: int) -> Calibration:
    """A trajectory like a real one: ratios drifting below 1, the two branches close."""
    rng = random.Random(seed)
    cond = [1.0] + [1 - 0.002 * i / steps * 20 - rng.uniform(0, 0.01) for i in range(1, steps)]
    uncond = [1.0] + [r + rng.uniform(-0.002, 0.002) for r in cond[1:]]
    return Calibration(cond=tuple(cond), uncond=tuple(uncond), source="synthetic")


@pytest.mark.parametrize("seed", range(6))
def test_the_skip_schedule_equals_the_reference_algorithm(seed: int) -> None:
    rng = random.Random(100 + seed)
    steps = rng.choice([8, 20, 50, 33])
    cal = _synthetic(seed, steps)
    lanes = FastLanes(cache="magcache", cache_threshold=rng.choice([0.02, 0.06, 0.12, 0.3]),
                      cache_max_skips=rng.choice([1, 2, 3, 4]), cache_retention=rng.choice([0.0, 0.1, 0.2, 0.35]),
                      guidance_until=rng.choice([1.0, 0.5, 0.7]))
    plan = plan_sampling(lanes, steps=steps, guided=True, calibration=cal)
    want = reference_schedule(_interleaved(cal, steps), steps=steps, thresh=lanes.cache_threshold,
                              k=lanes.cache_max_skips, retention=lanes.cache_retention,
                              uncond_calls=plan.guided_steps)
    got = {b: [plan.steps[i][Branch(b)].value for i in range(steps)] for b in (0, 1)}
    print(f"steps {steps}, {lanes}: forwards {plan.forwards} of {plan.exact_forwards}")
    assert got == want
    assert any(a == "reuse" for a in got[0]), "the case reuses nothing: it tests nothing"


def test_the_published_setting_halves_a_50_step_job_and_is_deterministic() -> None:
    """MagCache's E006K2R02 on its published Wan2.2-TI2V-5B ratios: 50 of 100 forwards (the
    published 1.97x), the same plan every time; gating at 0.5 on top leaves 40."""
    cal = published_calibration(conditioned=False)
    lanes = FastLanes(cache="magcache", cache_threshold=0.06, cache_max_skips=2, cache_retention=0.2)
    plans = [plan_sampling(lanes, steps=50, guided=True, calibration=cal) for _ in range(3)]
    assert plans[0].describe() == plans[1].describe() == plans[2].describe()
    assert plans[0].forwards == 50
    assert plans[0].steps_with(Branch.COND, Action.COMPUTE)[:10] == list(range(10))  # retention 0.2: 10 steps
    gated = plan_sampling(FastLanes(cache="magcache", guidance_until=0.5), steps=50, guided=True, calibration=cal)
    assert gated.forwards == 40 and gated.guided_steps == 25
    assert all(gated.steps[i][Branch.UNCOND] is Action.ABSENT for i in range(25, 50))
    assert len(published_calibration(conditioned=True).cond) == 50
    assert published_calibration(conditioned=True).cond != cal.cond


@pytest.mark.parametrize("lanes", [FastLanes(cache="magcache", cache_threshold=0.0),
                                   FastLanes(cache="magcache", cache_max_skips=0, cache_threshold=10.0)])
def test_threshold_0_or_no_skips_allowed_computes_every_step(lanes: FastLanes) -> None:
    plan = plan_sampling(lanes, steps=30, guided=True, calibration=published_calibration(conditioned=False))
    assert plan.forwards == plan.exact_forwards == 60
    loose = plan_sampling(FastLanes(cache="magcache", cache_threshold=10.0), steps=30, guided=True,
                          calibration=published_calibration(conditioned=False))
    assert loose.forwards < 60  # negative control: a loose threshold does reuse


def test_other_step_counts_interpolate_as_magcache_does() -> None:
    values = [float(i) for i in range(50)]
    # MagCache's nearest_interp: np.round(np.arange(n) * (50 - 1) / (n - 1)) indices
    for n in (1, 2, 7, 20, 50, 80):
        idx = [49] if n == 1 else np.round(np.arange(n) * (49 / (n - 1))).astype(int).tolist()
        assert nearest_interp(values, n) == [values[i] for i in idx], n
    plan = plan_sampling(FastLanes(cache="magcache"), steps=20, guided=True,
                         calibration=published_calibration(conditioned=False))
    assert plan.describe()["calibration"]["interpolated"] is True
    assert plan.describe()["calibration"]["calibrated_steps"] == 50


def test_gating_keeps_the_first_fraction_of_steps_guided() -> None:
    assert guided_steps(50, 1.0) == 50 and guided_steps(50, 0.5) == 25
    assert guided_steps(100, 0.29) == 29  # 100 * 0.29 is 28.999999999999996 in floats
    assert guided_steps(4, 0.1) == 1  # a gated step needs a difference to reuse
    plan = plan_sampling(FastLanes(guidance_until=1.0), steps=10, guided=True)
    assert plan.forwards == 20 and not any(plan.gated(i) for i in range(10))
    unguided = plan_sampling(FastLanes(guidance_until=0.5), steps=10, guided=False)
    assert unguided.forwards == 10 and "uncond_computed" not in unguided.describe()


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="guidance_until=0: allowed: a number > 0 and <= 1"):
        FastLanes(guidance_until=0)
    with pytest.raises(ValueError, match="cache='teacache': allowed: none, magcache"):
        FastLanes(cache="teacache")
    with pytest.raises(ValueError, match="needs a calibration"):
        plan_sampling(FastLanes(cache="magcache"), steps=4, guided=True)
    # step 0 has no ratio: a reuse there is impossible even with retention 0
    actions = magcache_actions([1.0] * 4, [True] * 4, branch=Branch.COND, threshold=1.0, max_skips=3, retention=0.0)
    assert actions[0] is Action.COMPUTE and actions[1] is Action.REUSE
