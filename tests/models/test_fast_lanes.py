"""Fast lanes on one process (tiny model): a cache that never reuses and gating at 1.0 give the
exact path's latents bit for bit; a reusing plan runs exactly its computed forwards' blocks;
calibrate measures and stores the ratios the plan then uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pan2render.lanes import Action, Branch, Calibration, FastLanes, plan_sampling
from pan2render.models.calibration import CalibrationMissing, calibrate, calibration_path, store_calibration
from pan2render.models.dit import PAN2DiTBlock
from pan2render.models.pipeline import PAN2Pipeline
from pan2render.models.step_cache import fast_lane_velocity
from pan2render.models.strategies import SeparateGuidance

JOB = dict(prompt="a red fox in the snow", height=32, width=32, frames=5, steps=8, guidance=2.5, seed=3)
# Ratios close to 1 (a loose threshold then reuses often), for the tiny model.
FLAT = Calibration(cond=(1.0,) + (0.999,) * 7, uncond=(1.0,) + (0.998,) * 7, source="test")


@pytest.fixture(scope="module")
def exact(tiny: PAN2Pipeline) -> torch.Tensor:
    return tiny.sample(**JOB)


@pytest.fixture()
def calibrated(tiny: PAN2Pipeline) -> None:
    store_calibration(tiny.model_id, FLAT, conditioned=False)
    yield
    calibration_path(tiny.model_id).unlink()


def _count_blocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    run = PAN2DiTBlock.run
    monkeypatch.setattr(PAN2DiTBlock, "run", lambda self, *a, **k: calls.append(1) or run(self, *a, **k))
    return calls


def test_a_cache_that_never_reuses_gives_the_exact_latents(tiny: PAN2Pipeline, exact, calibrated) -> None:
    never = tiny.sample(**JOB, cache="magcache", cache_threshold=0.0)
    assert torch.equal(never, exact)
    reusing = tiny.sample(**JOB, cache="magcache", cache_threshold=1.0)  # negative control
    rel = float((reusing - exact).norm() / exact.norm())
    print(f"threshold 1.0: rel. L2 vs exact {rel:.3e}")
    assert 0 < rel < 0.5


def test_a_reusing_plan_runs_the_blocks_of_its_computed_forwards_only(tiny: PAN2Pipeline, calibrated,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lanes = dict(cache="magcache", cache_threshold=1.0, cache_max_skips=2, cache_retention=0.25, guidance_until=0.5)
    plan = tiny.sampling_plan(steps=JOB["steps"], guidance=JOB["guidance"], **lanes)
    assert plan.calibration is not None and plan.calibration.source.endswith(f"{tiny.model_id}.json")
    print(plan.describe())
    assert 0 < plan.forwards < plan.exact_forwards
    calls = _count_blocks(monkeypatch)
    tiny.sample(**JOB, **lanes)
    assert len(calls) == plan.forwards * tiny.dit.config.num_layers


def test_gating_at_1_runs_todays_guided_path_bit_for_bit(tiny: PAN2Pipeline) -> None:
    gen = torch.Generator().manual_seed(5)
    cond, uncond = (torch.randn(1, 512, tiny.dit.config.text_dim, generator=gen) for _ in range(2))
    x = torch.randn(1, 48, 2, 2, 2, generator=gen)
    ts = [torch.tensor([t]) for t in (999.0, 700.0, 300.0)]
    denoiser = SeparateGuidance(tiny.dit)
    today = denoiser.prepare(cond, uncond, 2.5)
    for until, same in ((1.0, True), (0.5, False)):
        plan = plan_sampling(FastLanes(guidance_until=until), steps=3, guided=True)
        lane = fast_lane_velocity(denoiser.branch_forwards(cond, uncond), plan, 2.5)
        results = [torch.equal(lane(x, t), today(x, t)) for t in ts]
        assert all(results) if same else (results[0] and not all(results)), (until, results)


def test_gated_steps_run_one_forward(tiny: PAN2Pipeline, monkeypatch: pytest.MonkeyPatch, exact) -> None:
    calls = _count_blocks(monkeypatch)
    gated = tiny.sample(**JOB, guidance_until=0.5)
    assert len(calls) == (8 + 4) * tiny.dit.config.num_layers  # 4 guided steps (2 forwards), 4 gated (1)
    assert not torch.equal(gated, exact)


def test_calibrate_stores_the_ratios_the_plan_uses(tiny: PAN2Pipeline, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setenv("PAN2_RENDER_CACHE", str(tmp_path))
    with pytest.raises(CalibrationMissing, match="run `pan2-render calibrate MODEL` once"):
        tiny.sample(**JOB, cache="magcache")
    args = {k: v for k, v in JOB.items()}
    cal = calibrate(tiny, **args)
    again = calibrate(tiny, **args)
    print("tiny's ratios:", cal.cond, cal.uncond)
    assert cal.cond == again.cond and len(cal.cond) == len(cal.uncond) == JOB["steps"]
    assert cal.cond[0] == 1.0 and all(0.5 < r < 2.0 for r in cal.cond[1:]) and cal.cond != cal.uncond
    path = store_calibration(tiny.model_id, cal, conditioned=False)
    assert path == tmp_path / "magcache" / f"{tiny.model_id}.json"
    plan = tiny.sampling_plan(steps=JOB["steps"], guidance=JOB["guidance"], cache="magcache")
    assert plan.calibration is not None and plan.calibration.cond == cal.cond
    with pytest.raises(CalibrationMissing, match="image-conditioned"):  # another kind of job
        tiny.sampling_plan(steps=8, guidance=2.5, cache="magcache", conditioned=True)


def test_a_plan_with_reuse_keeps_one_residual_per_branch() -> None:
    plan = plan_sampling(FastLanes(cache="magcache", cache_threshold=1.0, cache_retention=0.0), steps=6, guided=True,
                         calibration=Calibration(cond=(1.0,) * 6, uncond=(1.0,) * 6, source="flat"))
    assert plan.steps[0] == {Branch.COND: Action.COMPUTE, Branch.UNCOND: Action.COMPUTE}
    assert plan.steps[1] == {Branch.COND: Action.REUSE, Branch.UNCOND: Action.REUSE}
