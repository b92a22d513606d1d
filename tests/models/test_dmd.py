"""The DMD few-step sampler: exactness on an oracle, the formulas step by step, FastVideo's warp,
and the pipeline's use of it (no guidance, first-frame conditioning, the checkpoint's timesteps).

CPU only, toy latents; seconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pan2render.models import PAN2Pipeline, PAN2PipelineConfig
from pan2render.models.loading import ModelFolderError
from pan2render.models.samplers import FlowDMDSampler, SchedulerConfig, make_sampler

LATENT_SHAPE = (1, 4, 3, 5, 6)  # [B, C, T, H, W], a toy Wan latent
T = 1000
TIMESTEP_LISTS = ([1000], [1000, 757, 522], [1000, 750, 500, 250], [999, 874, 749, 624, 500, 375, 250, 125])


def _x0() -> torch.Tensor:
    return torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(123))


def _sigma(t: int, shift: float) -> float:
    """The formula of the issue, written out again here: u = t/T, sigma = s*u / (1 + (s-1)*u)."""
    u = t / T
    return shift * u / (1 + (shift - 1) * u)


@pytest.mark.parametrize("shift", [1.0, 5.0, 12.0])
@pytest.mark.parametrize("timesteps", TIMESTEP_LISTS)
def test_oracle_velocity_gives_x0_after_any_number_of_steps(timesteps: list[int], shift: float) -> None:
    """A model that knows x0 returns the velocity noise - x0 of the sample it is given (the noise
    in x = (1 - sigma) x0 + sigma noise is (x - (1 - sigma) x0) / sigma): the sampler must land on x0."""
    x0 = _x0()
    sched = make_sampler("dmd", SchedulerConfig(flow_shift=shift))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(LATENT_SHAPE, generator=gen)
    sched.set_dmd_timesteps(timesteps, generator=gen)
    for t in sched.timesteps:
        sigma = float(t) / T  # the DiT's timestep is sigma * T
        noise = (x - (1 - sigma) * x0) / sigma
        x = sched.step(noise - x0, t, x)
    err = float((x - x0).abs().max() / x0.abs().max())
    print(f"{len(timesteps)} steps, shift {shift}: max rel err vs x0 {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("shift", [1.0, 5.0])
@pytest.mark.parametrize("timesteps", TIMESTEP_LISTS[1:])
def test_sampler_equals_the_formulas_step_by_step(timesteps: list[int], shift: float) -> None:
    """A reference loop from the formulas, with the same noises (drawn from a copy of the generator)."""
    def velocity(x: torch.Tensor, t: float) -> torch.Tensor:  # any deterministic stand-in for the DiT
        return torch.tanh(1.3 * x) * (0.6 + t / T) + 0.25 * torch.sin(3.0 * x)

    ours_gen, ref_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x = torch.randn(LATENT_SHAPE, generator=ours_gen)
    ref = torch.randn(LATENT_SHAPE, generator=ref_gen)
    sched = make_sampler("dmd", SchedulerConfig(flow_shift=shift))
    sched.set_dmd_timesteps(timesteps, generator=ours_gen)
    sigmas = [_sigma(t, shift) for t in timesteps]
    assert [float(t) for t in sched.timesteps] == pytest.approx([s * T for s in sigmas], rel=1e-6)
    for i, t in enumerate(sched.timesteps):
        x = sched.step(velocity(x, float(t)), t, x)
        x0 = ref - sigmas[i] * velocity(ref, sigmas[i] * T)
        if i + 1 < len(timesteps):
            ref = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * torch.randn(LATENT_SHAPE, generator=ref_gen)
        else:
            ref = x0
        err = float((x - ref).abs().max() / ref.abs().max())
        print(f"step {i}: sigma {sigmas[i]:.6f}, max rel err {err:.2e}")
        assert err <= 1e-6, f"step {i}"


def test_warp_equals_fastvideos_nearest_entry_of_the_euler_table() -> None:
    """FastVideo indexes FlowMatchEulerDiscreteScheduler(shift=s)'s full 1000-entry table at T - t and
    looks sigma up at the nearest timestep of that table; ours is the closed form (module doc)."""
    diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference: pip install -e .[test]")
    table = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=T, shift=5.0)
    timesteps = [1000, 757, 522, 250, 1]
    warped = torch.cat([table.timesteps, torch.zeros(1)])[[T - t for t in timesteps]]
    nearest = (table.timesteps[None] - warped[:, None]).abs().argmin(dim=1)
    their_sigmas = table.sigmas[nearest]
    sched = FlowDMDSampler(SchedulerConfig(flow_shift=5.0))
    sched.set_dmd_timesteps(timesteps, generator=torch.Generator())
    print("FastVideo warped timesteps", warped.tolist(), "ours", sched.timesteps.tolist())
    torch.testing.assert_close(sched.timesteps, warped.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(sched.sigmas[:-1], their_sigmas.float(), rtol=1e-6, atol=0)


def test_usage_errors_are_clear() -> None:
    sched = FlowDMDSampler(SchedulerConfig())
    with pytest.raises(ValueError, match="set_dmd_timesteps"):
        sched.set_timesteps(3)
    for bad, fragment in (([], "is empty"), ([1000, 1000], "not strictly decreasing"), ([1001], "out of range"),
                          ([500, 0], "out of range"), ([1000.0], "float")):
        with pytest.raises(ValueError, match=fragment):
            sched.set_dmd_timesteps(bad, generator=torch.Generator())
    with pytest.raises(ValueError, match="out of range"):  # the checkpoint's own T bounds the list
        FlowDMDSampler(SchedulerConfig(num_train_timesteps=500)).set_dmd_timesteps([600], generator=torch.Generator())
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU"):
            sched.set_dmd_timesteps([1000], generator=torch.Generator(device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu_with_the_same_cpu_noise() -> None:
    """The fresh noise is drawn on the CPU and moved: a CUDA sample walks the same path as a CPU one."""
    def run(device: str) -> torch.Tensor:
        gen = torch.Generator().manual_seed(9)
        x = torch.randn(LATENT_SHAPE, generator=gen).to(device)
        sched = make_sampler("dmd", SchedulerConfig(flow_shift=5.0))
        sched.set_dmd_timesteps([1000, 757, 522], generator=gen)
        for t in sched.timesteps:
            x = sched.step(torch.tanh(1.3 * x) * (0.6 + float(t) / T), t, x)
        return x

    cpu, gpu = run("cpu"), run("cuda")
    err = float((gpu.cpu() - cpu).abs().max() / cpu.abs().max())
    print(f"dmd cuda vs cpu, 3 steps: max rel err {err:.2e}")
    assert gpu.is_cuda and err <= 1e-5


# -- through the pipeline (the embedded tiny checkpoint) ---------------------------------------------

SIZE = dict(height=64, width=64, frames=5, seed=5)


@pytest.fixture(scope="module")
def tiny_root() -> Path:
    """The embedded tiny checkpoint in the default cache (built once, shared with the runner tests)."""
    from pan2render.models.tiny import tiny_model_folder

    return tiny_model_folder()


@pytest.fixture(scope="module")
def tiny(tiny_root: Path) -> PAN2Pipeline:
    return PAN2Pipeline.from_pretrained(tiny_root, PAN2PipelineConfig(device="cpu"))


def _formulas(tiny: PAN2Pipeline, embeds: torch.Tensor, timesteps: list[int], shift: float) -> torch.Tensor:
    """The dmd loop written out on the tiny DiT, warping each timestep with ``shift``."""
    gen = torch.Generator().manual_seed(SIZE["seed"])
    shape = (1, 48, 2, 4, 4)
    x = torch.randn(shape, generator=gen)
    ctx = tiny.dit.prepare_context(embeds[None])
    for i, t in enumerate(timesteps):
        sigma = torch.tensor(_sigma(t, shift), dtype=torch.float64).float().item()
        with torch.no_grad():
            v = tiny.dit(x, torch.tensor([sigma * T], dtype=torch.float32), ctx).float()
        x0 = x - sigma * v
        if i + 1 < len(timesteps):
            nxt = torch.tensor(_sigma(timesteps[i + 1], shift), dtype=torch.float64).float().item()
            x = (1 - nxt) * x0 + nxt * torch.randn(shape, generator=gen)
        else:
            x = x0
    return x[0]


def test_pipeline_dmd_is_the_formulas_with_the_jobs_generator(tiny: PAN2Pipeline) -> None:
    """The pipeline's dmd loop equals the formulas applied to its own DiT, with the noise continuing the
    job's seeded CPU generator (the initial latents first, then one draw per step but the last)."""
    embeds = torch.randn(512, tiny.dit.config.text_dim, generator=torch.Generator().manual_seed(0))
    timesteps = [1000, 757, 522]
    got = tiny.sample(prompt_embeds=embeds, sampler="dmd", timesteps=timesteps, guidance=1.0, **SIZE)
    want = _formulas(tiny, embeds, timesteps, tiny.scheduler_config.flow_shift)
    err = float((got - want).abs().max() / want.abs().max())
    print(f"pipeline dmd vs the formulas on the tiny DiT: max rel err {err:.2e}")
    assert err <= 1e-5
    with pytest.raises(ValueError, match="guidance"):
        tiny.sample(prompt_embeds=embeds, sampler="dmd", timesteps=timesteps, guidance=2.0, **SIZE)
    with pytest.raises(ValueError, match="timesteps"):
        tiny.sample(prompt_embeds=embeds, sampler="euler", steps=3, timesteps=timesteps, guidance=1.0, **SIZE)
    with pytest.raises(ValueError, match="needs timesteps"):  # the tiny checkpoint lists none of its own
        tiny.sample(prompt_embeds=embeds, sampler="dmd", guidance=1.0, **SIZE)


def test_pipeline_dmd_warps_with_the_jobs_flow_shift(tiny: PAN2Pipeline) -> None:
    """A job's flow_shift, not the checkpoint's shift, warps its timesteps (it is hashed into the
    job's id: two jobs that differ only in it must render differently, each as its shift says)."""
    embeds = torch.randn(512, tiny.dit.config.text_dim, generator=torch.Generator().manual_seed(0))
    timesteps = [1000, 757, 522]
    own = tiny.scheduler_config.flow_shift
    jobs = 3.0 if own != 3.0 else 8.0
    got = tiny.sample(prompt_embeds=embeds, sampler="dmd", timesteps=timesteps, guidance=1.0,
                      flow_shift=jobs, **SIZE)
    want, other = _formulas(tiny, embeds, timesteps, jobs), _formulas(tiny, embeds, timesteps, own)
    err = float((got - want).abs().max() / want.abs().max())
    off = float((got - other).abs().max() / want.abs().max())
    print(f"job's shift {jobs}: max rel err {err:.2e}; against the checkpoint's shift {own}: {off:.2e}")
    assert err <= 1e-5
    assert off > 1e-3  # negative control: the checkpoint's shift gives another result


def test_first_frame_stays_the_image(tiny: PAN2Pipeline) -> None:
    import numpy as np

    image = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    embeds = torch.randn(512, tiny.dit.config.text_dim, generator=torch.Generator().manual_seed(0))
    got = tiny.sample(prompt_embeds=embeds, image=image, sampler="dmd", timesteps=[1000, 500], guidance=1.0, **SIZE)
    first = tiny.encode_image(image, height=64, width=64)[0, :, 0]
    assert torch.equal(got[:, 0], first.float().cpu())


def test_checkpoint_timesteps_are_the_default_and_a_jobs_win(tiny: PAN2Pipeline, tiny_root: Path,
                                                             tmp_path: Path) -> None:
    root = tmp_path / "distilled"
    shutil.copytree(tiny_root, root)
    index = json.loads((root / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps({**index, "dmd_denoising_steps": [1000, 600]}))
    pipe = PAN2Pipeline.from_pretrained(root, PAN2PipelineConfig(device="cpu"))
    assert pipe.default_timesteps == (1000, 600) and pipe.default_sampler == "dmd"
    assert tiny.default_timesteps is None and tiny.default_sampler == "unipc"
    plain = PAN2Pipeline.from_pretrained(tiny_root, PAN2PipelineConfig(device="cpu"))
    assert pipe.model_id.split("-")[-1] != plain.model_id.split("-")[-1]  # its timesteps change its renders
    embeds = torch.randn(512, tiny.dit.config.text_dim, generator=torch.Generator().manual_seed(0))
    own = pipe.sample(prompt_embeds=embeds, guidance=1.0, **SIZE)
    listed = pipe.sample(prompt_embeds=embeds, sampler="dmd", timesteps=[1000, 600], guidance=1.0, **SIZE)
    other = pipe.sample(prompt_embeds=embeds, sampler="dmd", timesteps=[1000, 757, 522], guidance=1.0, **SIZE)
    assert torch.equal(own, listed) and not torch.equal(own, other)
    (root / "model_index.json").write_text(json.dumps({**index, "dmd_denoising_steps": [600, 1000]}))
    with pytest.raises(ModelFolderError, match=r"model_index.json: dmd_denoising_steps .*not strictly decreasing"):
        PAN2Pipeline.from_pretrained(root, PAN2PipelineConfig(device="cpu"))
