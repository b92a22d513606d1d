"""Estimates a user can plan a night by: from this machine's own runs of another size, scaled by the
cost model, within 2x of what the job then takes; a guess from the reference table says so, and a
full-size checkpoint on CPU gets no H200 figure."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from runner_helpers import spec, write_batch

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import Ledger
from pan2render.jobs.spec import JobSpec
from pan2render.runner.cli import main as cli
from pan2render.runner.views.estimates import (
    CPU,
    CUDA,
    DMD_OWN_STEPS,
    UNGUIDED_STEP_COST,
    History,
    JobSize,
    plan,
)
from pan2render.runner.views.status import format_estimate


def _render(tmp_path: Path, name: str, *, height: int, width: int, frames: int) -> tuple[Path, Path]:
    batch = write_batch(tmp_path / f"{name}.yaml", [{"name": f"{name}-{i}", "prompt": f"clip {i}"} for i in range(2)],
                        defaults={"height": height, "width": width, "frames": frames, "steps": 4})
    out = tmp_path / "renders" / name
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == 0
    return batch, out


def _measured(out: Path) -> float:
    """The shortest of the folder's done jobs, its stages summed (the estimate takes the same low
    end of its samples: other work on a shared machine only ever adds time)."""
    ledger = Ledger.open_readonly(out)
    try:
        return min(sum(r.seconds or 0.0 for r in ledger.stages(j.id).values()) for j in ledger.jobs())
    finally:
        ledger.close()


def test_an_unseen_size_is_estimated_within_2x_from_a_run_of_another_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model renders 32x32x5 here; a batch of 64x64x17 (10x the DiT tokens, 14x the
    pixels) is estimated from those ledgers alone, and rendered too. Negative control: scaling the small
    jobs' stage seconds in proportion to tokens and pixels (no overhead in the model) is off by
    more than 2x at these sizes, so the tolerance tells a cost model from none."""
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")
    # The two sizes are rendered in turns, three runs each, and each side counts its quickest job:
    # on a shared machine the load changes from run to run, and only ever adds time.
    smalls, bigs = [], []
    for turn in range(3):
        _, small = _render(tmp_path, f"small{turn}", height=32, width=32, frames=5)
        big_batch, big = _render(tmp_path, f"big{turn}", height=64, width=64, frames=17)
        smalls.append(small)
        bigs.append(big)
    jobs = load_batch(big_batch).jobs
    estimate = plan(jobs, gpus=1, device=CPU, history=History.from_folders(smalls))
    assert {e.source for e in estimate.estimates} == {"history"}
    print(format_estimate(estimate, gpus_note="logical GPUs on this CPU"))
    predicted = estimate.estimates[0].gpu_seconds
    measured = min(_measured(big) for big in bigs)
    st = []
    for folder in smalls:
        ledger = Ledger.open_readonly(folder)
        st += [ledger.stages(j.id) for j in ledger.jobs()]
        ledger.close()
    small_size, big_size = JobSize.of(load_batch(tmp_path / "small0.yaml").jobs[0]), JobSize.of(jobs[0])
    tokens, pixels = big_size.tokens / small_size.tokens, big_size.pixels / small_size.pixels
    proportional = min(
        (s["conditioning"].seconds or 0) + s["sampling"].seconds * tokens + (s["decode"].seconds + s["encode"].seconds)
        * pixels for s in st)
    print(f"64x64x17: estimated {predicted:.2f} s from 32x32x5, measured {measured:.2f} s; "
          f"proportional scaling {proportional:.2f} s")
    assert 0.5 <= predicted / measured <= 2.0
    assert not 0.5 <= proportional / measured <= 2.0


def test_without_a_run_the_estimate_is_a_guess_with_its_range_and_never_h200_figures_on_cpu(
        tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tiny = write_batch(tmp_path / "tiny.yaml", [{"name": "a", "prompt": "x"}])
    full = write_batch(tmp_path / "full.yaml", [{"name": "a", "prompt": "x"}], model=str(ckpt),
                       defaults={"height": 704, "width": 1248, "frames": 121, "steps": 50})
    tiny_jobs = load_batch(tiny, check_model=False).jobs
    full_jobs = load_batch(full, check_model=False).jobs

    guess = plan(tiny_jobs, gpus=1, device=CPU, history=History())
    text = format_estimate(guess, gpus_note="logical GPUs on this CPU")
    print(text)
    assert guess.estimates[0].source == "reference" and guess.spread[0] < 1 < guess.spread[1]
    assert "a guess" in text and "the tiny model on an idle 2-core CPU" in text

    on_cpu = plan(full_jobs, gpus=1, device=CPU, history=History())
    text = format_estimate(on_cpu, gpus_note="logical GPUs on this CPU")
    print(text)
    assert on_cpu.estimates[0].times is None and "H200" not in text and "none for the 1 job(s)" in text

    on_gpu = plan(full_jobs, gpus=1, device=CUDA, history=History())
    text = format_estimate(on_gpu, gpus_note="GPUs found on this machine")
    print(text)
    # 50 guided steps at 26,598 tokens are most of a job: about a minute and a half on an H200.
    assert "one H200" in text and 60 < on_gpu.estimates[0].gpu_seconds < 200


def _job(name: str, **fields: object) -> JobSpec:
    return dataclasses.replace(spec(name), **fields)


def test_an_unguided_step_is_estimated_as_one_forward_not_two() -> None:
    """guidance 1 runs one DiT forward a step where a guided job runs two: its sampling estimate is
    half the guided job's, the rest of the job the same (and a job gated after half its steps
    three quarters)."""
    guided, unguided, gated = (_job("g", steps=8, guidance=2.5), _job("u", steps=8, guidance=1.0),
                               _job("h", steps=8, guidance=2.5, guidance_until=0.5))
    e = {x.job.name: x.times for x in plan([guided, unguided, gated], gpus=1, device=CPU, history=History()).estimates}
    assert e["u"].sampling == pytest.approx(e["g"].sampling / 2) and e["u"].decode == e["g"].decode
    assert e["h"].sampling == pytest.approx(e["g"].sampling * 3 / 4)
    assert JobSize.of(unguided).step_units == 4 and JobSize.of(guided).step_units == 8


def test_jobs_are_placed_on_the_least_busy_gpu() -> None:
    """Two GPUs, a long job then two short ones: the short ones share the free GPU while the long
    one runs (wall: the long job's), never queue behind it on the busy one."""
    long_job = _job("long", steps=40, height=64, width=64, frames=17)
    short = [_job(f"short{i}", steps=2, seed=i) for i in range(2)]
    the_plan = plan([long_job, *short], gpus=2, device=CPU, history=History(), group_starts=False)
    t = {e.job.name: e.times for e in the_plan.estimates}
    assert t["long"].on_gpu > t["short0"].on_gpu + t["short1"].on_gpu  # (so the placement shows)
    expected = max(t["long"].on_gpu, t["short0"].on_gpu + t["short1"].on_gpu) + t["short1"].encode
    assert the_plan.wall_seconds == pytest.approx(expected)


def test_a_dmd_job_is_estimated_by_its_timesteps() -> None:
    """A dmd job has no `steps` (its timesteps are its steps): 3 timesteps plan as 3 unguided steps,
    its checkpoint's own (none listed) as DMD_OWN_STEPS; before, planning one raised TypeError,
    and the farm's snapshot of its batch with it."""
    listed = _job("listed", sampler="dmd", guidance=1.0, steps=None, timesteps=(1000, 757, 522))
    own = _job("own", sampler="dmd", guidance=1.0, steps=None)
    assert JobSize.of(listed).step_units == 3 * UNGUIDED_STEP_COST
    assert JobSize.of(own).step_units == DMD_OWN_STEPS * UNGUIDED_STEP_COST
    e = {x.job.name: x.times for x in plan([listed, _job("u3", steps=3, guidance=1.0)], gpus=1, device=CPU,
                                           history=History()).estimates}
    assert e["listed"].sampling == pytest.approx(e["u3"].sampling)
