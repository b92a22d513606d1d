"""Our flow-matching samplers against diffusers 0.42 (the reference) and against hand computations.

CPU only, tiny latents; the whole file runs in a few seconds.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from pan2render.models.samplers import (
    FlowUniPCSampler,
    SchedulerConfig,
    flow_sigmas,
    make_sampler,
)


def _diffusers():
    """diffusers is the reference (a test dependency); tests that need it skip without it."""
    return pytest.importorskip("diffusers", reason="diffusers is the reference: pip install -e .[test]")


STEPS = (1, 2, 4, 10, 50)
SHIFTS = (1.0, 5.0)
LATENT_SHAPE = (2, 4, 3, 5, 6)  # [B, C, T, H, W], a toy Wan latent
TOL = 1e-5

# Wan2.2-TI2V-5B-Diffusers scheduler/scheduler_config.json as published (diffusers 0.35.0.dev0).
WAN22_TI2V_5B_SCHEDULER_CONFIG = {
    "_class_name": "UniPCMultistepScheduler",
    "_diffusers_version": "0.35.0.dev0",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 5.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "time_shift_type": "exponential",
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_dynamic_shifting": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}


# -- references ------------------------------------------------------------------------------------


def _ref_unipc(shift: float, config: dict | None = None):
    cfg = dict(WAN22_TI2V_5B_SCHEDULER_CONFIG if config is None else config)
    cfg["flow_shift"] = shift
    return _diffusers().UniPCMultistepScheduler.from_config(cfg)


def _ref_euler(num_steps: int, shift: float):
    """diffusers' Euler over the UniPC flow sigmas (shift=1.0: the sigmas are already shifted)."""
    unipc = _ref_unipc(shift)
    unipc.set_timesteps(num_steps)
    euler = _diffusers().FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    euler.set_timesteps(sigmas=unipc.sigmas[:-1].tolist())
    return euler


def _reference(name: str, num_steps: int, shift: float):
    if name == "euler":
        return _ref_euler(num_steps, shift)
    ref = _ref_unipc(shift)
    ref.set_timesteps(num_steps)
    return ref


def _ours(name: str, num_steps: int, shift: float):
    ours = make_sampler(name, SchedulerConfig(flow_shift=shift))
    ours.set_timesteps(num_steps)
    return ours


def fake_velocity(x: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """A deterministic, nonlinear stand-in for the DiT: depends on the sample and the timestep."""
    tau = float(t) / 1000.0
    return torch.tanh(1.3 * x) * (0.6 + tau) + 0.25 * torch.sin(3.0 * x + 5.0 * tau) - 0.4 * tau * x


def _start(seed: int = 0) -> torch.Tensor:
    return torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over the tensor."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _run_ref(ref, x: torch.Tensor) -> list[torch.Tensor]:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in ref.timesteps:
            x = ref.step(fake_velocity(x, t), t, x, return_dict=False)[0]
            out.append(x)
    return out


def _run_ours(ours, x: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for t in ours.timesteps:
        x = ours.step(fake_velocity(x, t), t, x)
        out.append(x)
    return out


# -- schedule ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("num_steps", STEPS)
@pytest.mark.parametrize("name", ["unipc", "euler"])
def test_timesteps_and_sigmas_equal_diffusers(name: str, num_steps: int, shift: float) -> None:
    ref, ours = _reference(name, num_steps, shift), _ours(name, num_steps, shift)
    print(f"{name} N={num_steps} shift={shift}: timesteps[:4]={ours.timesteps[:4].tolist()} "
          f"dtype={ours.timesteps.dtype}")
    assert ours.timesteps.dtype == ref.timesteps.dtype
    assert torch.equal(ours.timesteps, ref.timesteps)
    assert torch.equal(ours.sigmas, ref.sigmas.to(torch.float32))


def test_unipc_timesteps_equal_diffusers_for_every_step_count() -> None:
    """int64 truncation of sigma * 1000 is sensitive to the last bit; check N = 1..120 both shifts."""
    mismatches = []
    for shift in (1.0, 3.0, 5.0):
        ref = _ref_unipc(shift)
        ours = FlowUniPCSampler(SchedulerConfig(flow_shift=shift))
        for n in range(1, 121):
            ref.set_timesteps(n)
            ours.set_timesteps(n)
            if not (torch.equal(ours.timesteps, ref.timesteps) and torch.equal(ours.sigmas, ref.sigmas)):
                mismatches.append((shift, n))
    print(f"schedule mismatches over 360 (shift, N): {mismatches}")
    assert mismatches == []


def test_schedule_by_hand() -> None:
    """N=2, shift 5: u = [1, 0.5005]; sigma = 5u / (1 + 4u); sigma_0 nudged to 1 - 1e-6."""
    s1 = 5 * 0.5005 / (1 + 4 * 0.5005)  # 0.833611...
    expected = [1 - 1e-6, s1, 0.0]
    euler = _ours("euler", 2, 5.0)
    unipc = _ours("unipc", 2, 5.0)
    print(f"sigmas {euler.sigmas.tolist()} (hand {expected}); euler t {euler.timesteps.tolist()}, "
          f"unipc t {unipc.timesteps.tolist()}")
    assert euler.sigmas.tolist() == pytest.approx(expected, abs=1e-7)
    assert torch.equal(unipc.sigmas, euler.sigmas)
    assert euler.timesteps.tolist() == pytest.approx([999.999, 1000 * s1], abs=1e-3)
    assert unipc.timesteps.tolist() == [999, 833]


def test_euler_loop_by_hand() -> None:
    """Three Euler steps with v = fake_velocity, written out with the hand-made schedule."""
    n, shift = 3, 5.0
    u = [1 + i * (0.001 - 1) / n for i in range(n)]
    sig = [shift * ui / (1 + (shift - 1) * ui) for ui in u] + [0.0]
    sig[0] -= 1e-6
    x_hand = _start(1).double()
    for i in range(n):
        v = fake_velocity(x_hand, 1000 * sig[i])
        x_hand = x_hand + (sig[i + 1] - sig[i]) * v
    ours = _ours("euler", n, shift)
    x = _run_ours(ours, _start(1))[-1]
    err = _rel_err(x, x_hand)
    print(f"euler vs hand (float64) N={n}: max rel err {err:.2e}")
    assert err <= TOL


# -- full loops against diffusers ------------------------------------------------------------------


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("num_steps", STEPS)
@pytest.mark.parametrize("name", ["unipc", "euler"])
def test_loop_matches_diffusers(name: str, num_steps: int, shift: float) -> None:
    ref, ours = _reference(name, num_steps, shift), _ours(name, num_steps, shift)
    x_start = _start()
    ref_xs, our_xs = _run_ref(ref, x_start), _run_ours(ours, x_start)
    per_step = [_rel_err(a, b) for a, b in zip(our_xs, ref_xs, strict=True)]
    final = per_step[-1]
    print(f"{name} N={num_steps} shift={shift}: final max rel err {final:.2e}, "
          f"worst step {max(per_step):.2e}")
    assert max(per_step) <= TOL
    assert our_xs[-1].dtype == torch.float32 and torch.isfinite(our_xs[-1]).all()


def test_published_wan22_config_end_to_end() -> None:
    """from_dict on the shipped JSON, 50 steps, against diffusers built from the same JSON."""
    cfg = SchedulerConfig.from_dict(WAN22_TI2V_5B_SCHEDULER_CONFIG)
    assert cfg == SchedulerConfig(num_train_timesteps=1000, flow_shift=5.0, solver_order=2)
    ref = _diffusers().UniPCMultistepScheduler.from_config(WAN22_TI2V_5B_SCHEDULER_CONFIG)
    ref.set_timesteps(50)
    ours = make_sampler("unipc", cfg)
    ours.set_timesteps(50)
    x = _start(2)
    err = _rel_err(_run_ours(ours, x)[-1], _run_ref(ref, x)[-1])
    print(f"published config, N=50: max rel err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("overrides", [{"solver_order": 1}, {"disable_corrector": [0, 3]}])
def test_supported_variants_match_diffusers(overrides: dict) -> None:
    raw = {**WAN22_TI2V_5B_SCHEDULER_CONFIG, **overrides}
    ref = _diffusers().UniPCMultistepScheduler.from_config(raw)
    ref.set_timesteps(10)
    ours = make_sampler("unipc", SchedulerConfig.from_dict(raw))
    ours.set_timesteps(10)
    x = _start(3)
    err = _rel_err(_run_ours(ours, x)[-1], _run_ref(ref, x)[-1])
    print(f"{overrides}: max rel err {err:.2e}")
    assert err <= TOL


# -- behaviour ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["unipc", "euler"])
def test_straight_flow_is_integrated_exactly(name: str) -> None:
    """With the true velocity of x_sigma = (1 - sigma) x0 + sigma * noise, both land on x0."""
    x0, noise = _start(4), _start(5)
    ours = _ours(name, 7, 5.0)
    x = noise
    for t in ours.timesteps:
        x = ours.step(noise - x0, t, x)
    err = _rel_err(x, x0)
    print(f"{name}: straight flow, final max rel err vs x0 {err:.2e}")
    assert err <= 1e-5


@pytest.mark.parametrize("name", ["unipc", "euler"])
def test_set_timesteps_resets_the_job(name: str) -> None:
    ours = _ours(name, 6, 5.0)
    first = _run_ours(ours, _start())[-1]
    ours.set_timesteps(6)  # a full second job
    second = _run_ours(ours, _start())[-1]
    ours.set_timesteps(6)  # an abandoned half job, then a fresh one
    x = _start(9)
    for t in ours.timesteps[:3]:
        x = ours.step(fake_velocity(x, t), t, x)
    ours.set_timesteps(6)
    third = _run_ours(ours, _start())[-1]
    assert torch.equal(first, second) and torch.equal(first, third)


def test_flow_shift_override_equals_config_shift() -> None:
    a = FlowUniPCSampler(SchedulerConfig(flow_shift=5.0))
    a.set_timesteps(10, flow_shift=3.0)
    b = FlowUniPCSampler(SchedulerConfig(flow_shift=3.0))
    b.set_timesteps(10)
    assert torch.equal(a.timesteps, b.timesteps) and torch.equal(a.sigmas, b.sigmas)
    a.set_timesteps(10)  # the override lasts one job
    assert a.sigmas.tolist() == _ours("unipc", 10, 5.0).sigmas.tolist()


@pytest.mark.parametrize("name", ["unipc", "euler"])
def test_bf16_model_output_is_upcast_and_state_is_fp32(name: str) -> None:
    """A bf16 model output gives exactly the fp32 path on its upcast values; the sample keeps its dtype."""
    ours, ref32 = _ours(name, 5, 5.0), _ours(name, 5, 5.0)
    x = x32 = _start(6)
    for t in ours.timesteps:
        v16 = fake_velocity(x, t).to(torch.bfloat16)
        x = ours.step(v16, t, x)
        x32 = ref32.step(v16.float(), t, x32)
    assert x.dtype == torch.float32 and torch.equal(x, x32)
    if name == "unipc":
        assert all(h.dtype == torch.float32 for h in ours._x0_history)
    two = _ours(name, 2, 5.0)
    y = two.step(_start().bfloat16(), two.timesteps[0], _start().bfloat16())
    assert y.dtype == torch.bfloat16


def test_flow_sigmas_are_monotone_and_in_range() -> None:
    for shift in (0.5, 1.0, 5.0, 12.0):
        s = flow_sigmas(num_steps=50, flow_shift=shift, num_train_timesteps=1000)
        assert (s[1:] < s[:-1]).all() and 0 < s[-1] and s[0] < 1, shift


# -- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("prediction_type", "epsilon"),
        ("use_flow_sigmas", False),
        ("predict_x0", False),
        ("solver_type", "bh1"),
        ("solver_order", 3),
        ("lower_order_final", False),
        ("final_sigmas_type", "sigma_min"),
        ("thresholding", True),
        ("use_karras_sigmas", True),
        ("use_dynamic_shifting", True),
        ("shift_terminal", 0.1),
        ("flow_shift", 0.0),
        ("flow_shift", "5"),
        ("num_train_timesteps", 0),
        ("disable_corrector", [-1]),
        ("disable_corrector", 0),
        ("_class_name", "DDIMScheduler"),
    ],
)
def test_from_dict_rejects_unsupported_values(key: str, value: object) -> None:
    raw = {**WAN22_TI2V_5B_SCHEDULER_CONFIG, key: value}
    with pytest.raises(ValueError, match=key) as info:
        SchedulerConfig.from_dict(raw)
    print(f"{key}={value!r}: {info.value}")


def test_from_dict_missing_key_takes_diffusers_default() -> None:
    raw = {k: v for k, v in WAN22_TI2V_5B_SCHEDULER_CONFIG.items() if k != "prediction_type"}
    with pytest.raises(ValueError, match=r"prediction_type='epsilon' \(missing") as info:
        SchedulerConfig.from_dict(raw)
    print(info.value)
    minimal = {"prediction_type": "flow_prediction", "use_flow_sigmas": True}
    assert SchedulerConfig.from_dict(minimal).flow_shift == 1.0  # diffusers' default shift


# A FlowMatchEulerDiscreteScheduler config as diffusers 0.33 writes it (the class distilled Wan
# checkpoints ship), with FastWan2.2's shift.
FLOW_MATCH_EULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.33.1",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 5.0,
    "shift_terminal": None,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": False,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}


def test_flow_match_euler_config_loads_with_its_own_shift(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="pan2render.models.samplers"):
        cfg = SchedulerConfig.from_dict(FLOW_MATCH_EULER_CONFIG, source="ckpt/scheduler/scheduler_config.json")
    print(cfg, caplog.text)
    assert cfg == SchedulerConfig(num_train_timesteps=1000, flow_shift=5.0, default_sampler="euler")
    assert "base_shift" in caplog.text and "ckpt/scheduler/scheduler_config.json" in caplog.text
    assert SchedulerConfig.from_dict({"_class_name": "FlowMatchEulerDiscreteScheduler"}).flow_shift == 1.0
    # The same sigmas as a UniPC config of the same shift: the shift is what the samplers read.
    for name in ("euler", "dmd"):
        wan = SchedulerConfig.from_dict(WAN22_TI2V_5B_SCHEDULER_CONFIG)
        a, b = make_sampler(name, cfg), make_sampler(name, wan)
        for s in (a, b):
            if name == "dmd":
                s.set_dmd_timesteps([1000, 757, 522], generator=torch.Generator())
            else:
                s.set_timesteps(4)
        assert torch.equal(a.sigmas, b.sigmas) and torch.equal(a.timesteps, b.timesteps)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("use_dynamic_shifting", True),
        ("invert_sigmas", True),
        ("stochastic_sampling", True),
        ("shift_terminal", 0.02),
        ("use_beta_sigmas", True),
        ("shift", 0),
        ("shift", "5.0"),
    ],
)
def test_flow_match_euler_config_refuses_what_changes_the_math(key: str, value: object) -> None:
    raw = {**FLOW_MATCH_EULER_CONFIG, key: value}
    with pytest.raises(ValueError, match=rf"^ckpt/scheduler_config.json: {key}=") as info:
        SchedulerConfig.from_dict(raw, source="ckpt/scheduler_config.json")
    print(info.value)


def test_unknown_and_newer_keys_are_logged_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    newer = {**WAN22_TI2V_5B_SCHEDULER_CONFIG, "_diffusers_version": "0.99.0", "shift": 3.0,
             "a_key_from_a_newer_diffusers": 1, "use_flow_sigmas": True}
    with caplog.at_level("INFO", logger="pan2render.models.samplers"):
        assert SchedulerConfig.from_dict(newer) == SchedulerConfig.from_dict(WAN22_TI2V_5B_SCHEDULER_CONFIG)
    print(caplog.text)
    assert "a_key_from_a_newer_diffusers" in caplog.text and "shift" in caplog.text


def test_inert_keys_are_accepted_with_any_value() -> None:
    raw = {**WAN22_TI2V_5B_SCHEDULER_CONFIG, "beta_schedule": "scaled_linear", "timestep_spacing": "trailing",
           "steps_offset": 1, "sigma_min": 0.002}
    assert SchedulerConfig.from_dict(raw) == SchedulerConfig.from_dict(WAN22_TI2V_5B_SCHEDULER_CONFIG)


def test_usage_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="allowed") as info:
        make_sampler("ddim", SchedulerConfig())
    print(info.value)
    with pytest.raises(ValueError, match="solver_order=3"):
        SchedulerConfig(solver_order=3)
    ours = FlowUniPCSampler(SchedulerConfig())
    x = _start()
    with pytest.raises(RuntimeError, match="before set_timesteps"):
        ours.step(x, 999, x)
    with pytest.raises(ValueError, match="num_steps=0"):
        ours.set_timesteps(0)
    with pytest.raises(ValueError, match="flow_shift=-1"):
        ours.set_timesteps(4, flow_shift=-1.0)
    ours.set_timesteps(2)
    with pytest.raises(ValueError, match="expects 999") as info:
        ours.step(x, 833, x)  # skipped a step
    print(info.value)
    with pytest.raises(ValueError, match="shape"):
        ours.step(x[:1], 999, x)
    x = ours.step(x, ours.timesteps[0], x)
    x = ours.step(x, ours.timesteps[1], x)
    with pytest.raises(RuntimeError, match="set_timesteps"):
        ours.step(x, ours.timesteps[1], x)
    assert math.isfinite(x.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["unipc", "euler"])
def test_cuda_matches_cpu(name: str) -> None:
    """Schedule state stays on the CPU; latents on the GPU step without device errors or syncs on them."""
    cpu, gpu = _ours(name, 10, 5.0), _ours(name, 10, 5.0)
    x_cpu = _run_ours(cpu, _start())[-1]
    x_gpu = _run_ours(gpu, _start().cuda())[-1]
    err = _rel_err(x_gpu.cpu(), x_cpu)
    print(f"{name}: cuda vs cpu, N=10, max rel err {err:.2e}")
    assert x_gpu.is_cuda and err <= TOL


def test_flow_sigmas_equal_the_torch_arithmetic_bit_for_bit() -> None:
    """The schedule is computed without torch (``sampling.flow_sigma_values``: the driver records it
    in params.json without importing torch); it must be the very float64 values torch's arithmetic
    gave, so the timesteps truncated from it stay diffusers' exactly."""
    for steps in (1, 2, 3, 8, 20, 50, 1000):
        for shift in (1.0, 3.0, 5, 5.0, 7.3):
            for train in (1000, 999):
                start, stop = 1.0, 1.0 / train
                step = (stop - start) / steps
                u = torch.arange(steps, dtype=torch.float64) * step + start
                want = shift * u / (1 + (shift - 1) * u)
                if abs(want[0].item() - 1.0) < 1e-6:
                    want[0] -= 1e-6
                got = flow_sigmas(num_steps=steps, flow_shift=shift, num_train_timesteps=train)
                assert got.dtype == torch.float64 and torch.equal(got, want), (steps, shift, train)
