"""Flow-matching samplers for PAN2 / Wan2.2: UniPC (the default) and Euler.

PAN2's DiT predicts the flow velocity ``v = noise - x0`` of the straight path
``x_sigma = (1 - sigma) * x0 + sigma * noise``. A sampler walks ``sigma`` from ~1 down to 0 over
``num_steps`` model evaluations.

The schedule (shared by both samplers) is diffusers' ``UniPCMultistepScheduler`` flow schedule
(``use_flow_sigmas=True``, diffusers 0.42):

    u_i     = 1 + i * (1/T - 1) / N                for i = 0..N-1   (np.linspace(1, 1/T, N+1)[:-1])
    sigma_i = s * u_i / (1 + (s - 1) * u_i)        (the flow shift s; s > 1 spends more steps at high noise)
    sigma_0 -= 1e-6                                (sigma_0 is always 1; UniPC takes log(1 - sigma))
    sigma_N = 0

with T = ``num_train_timesteps``. All of it is computed in float64 exactly as numpy does and then
stored as float32, so the values equal diffusers' bit for bit.

- ``FlowUniPCScheduler`` equals ``UniPCMultistepScheduler`` as Wan2.2 ships it
  (``prediction_type="flow_prediction"``, ``use_flow_sigmas=True``, ``solver_order=2``,
  ``solver_type="bh2"``, ``predict_x0=True``, ``lower_order_final=True``,
  ``final_sigmas_type="zero"``). Only that configuration is implemented (plus ``solver_order=1``
  and ``disable_corrector``, which cost nothing). Its ``timesteps`` are int64
  ``trunc(sigma_i * T)``, what diffusers feeds the DiT.
- ``FlowEulerScheduler`` is ``x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v_i`` over the SAME
  sigmas. diffusers' ``FlowMatchEulerDiscreteScheduler(shift=s)`` uses a different schedule
  (N points from 1 to its shifted sigma_min *inclusive*, and sigma_min is shifted twice), e.g.
  N=4, s=5: diffusers [1.0, 0.910, 0.717, 0.024] vs ours [1.0, 0.938, 0.834, 0.626]; so ours
  equals ``FlowMatchEulerDiscreteScheduler(shift=1.0)`` with ``set_timesteps(sigmas=<our sigmas>)``
  instead. Its ``timesteps`` are float32 ``sigma_i * T``, as that scheduler feeds the DiT.

Both keep their state (history, last sample) in float32 whatever the model dtype: the model
output is upcast before any arithmetic. (diffusers multiplies ``sigma * model_output`` in the
model's dtype first; with a bf16 model we are slightly more precise than diffusers, by design.)

UniPC reference: Zhao et al., "UniPC: A Unified Predictor-Corrector Framework for Fast Sampling of
Diffusion Models", arXiv:2302.04867 (B(h) variant "bh2": B(h) = e^h - 1, data prediction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

SchedulerName = Literal["unipc", "euler"]
SCHEDULER_NAMES: tuple[str, ...] = ("unipc", "euler")

# sigma_0 is nudged below 1 by this much so that log(1 - sigma_0) is finite (diffusers does the same,
# scheduling_unipc_multistep.py set_timesteps, "to avoid inf torch.log(alpha_si)").
_SIGMA_MAX_NUDGE = 1e-6


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

# scheduler_config.json keys whose value must be exactly this for our code to equal diffusers'.
# Value: (the one value we support, diffusers 0.42's default when the key is missing).
_FIXED_KEYS: dict[str, tuple[Any, Any]] = {
    "prediction_type": ("flow_prediction", "epsilon"),
    "use_flow_sigmas": (True, False),
    "predict_x0": (True, True),
    "solver_type": ("bh2", "bh2"),
    "lower_order_final": (True, True),  # False would run order 2 into sigma=0: inf/nan in diffusers too
    "final_sigmas_type": ("zero", "zero"),
    "thresholding": (False, False),
    "use_karras_sigmas": (False, False),
    "use_exponential_sigmas": (False, False),
    "use_beta_sigmas": (False, False),
    "use_dynamic_shifting": (False, False),
    "solver_p": (None, None),
    "shift_terminal": (None, None),
}

# Keys diffusers reads but that have no effect once use_flow_sigmas=True and thresholding=False
# (they shape the discrete-beta schedule, the thresholding, or schedules we reject above).
_INERT_KEYS: frozenset[str] = frozenset({
    "beta_start", "beta_end", "beta_schedule", "trained_betas", "rescale_betas_zero_snr",
    "timestep_spacing", "steps_offset", "dynamic_thresholding_ratio", "sample_max_value",
    "time_shift_type", "sigma_min", "sigma_max",
})

# Keys that become SchedulerConfig fields, with diffusers 0.42's defaults for a missing key.
_FIELD_KEYS: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "flow_shift": 1.0,
    "solver_order": 2,
    "disable_corrector": [],
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_flow_shift(flow_shift: object, *, where: str) -> float:
    if not isinstance(flow_shift, (int, float)) or isinstance(flow_shift, bool):
        raise ValueError(f"{where}={flow_shift!r} must be a number > 0 (Wan2.2-TI2V-5B uses 5.0)")
    if not math.isfinite(flow_shift) or flow_shift <= 0:
        raise ValueError(f"{where}={flow_shift!r} must be a finite number > 0 (Wan2.2-TI2V-5B uses 5.0)")
    return float(flow_shift)


@dataclass(frozen=True)
class SchedulerConfig:
    """What our samplers read from a Wan2.2 ``scheduler/scheduler_config.json``.

    Defaults reproduce Wan2.2-TI2V-5B-Diffusers. ``from_dict`` reads the JSON the way diffusers'
    ``UniPCMultistepScheduler.from_config`` does and rejects anything we do not implement.
    """

    # Training-time timestep range; sigma_i * num_train_timesteps is the DiT's timestep.
    num_train_timesteps: int = 1000
    # Default flow shift s in sigma = s*u / (1 + (s-1)*u); set_timesteps(flow_shift=...) overrides it.
    flow_shift: float = 5.0
    # UniPC multistep order: 2 (Wan2.2) or 1. Euler ignores it.
    solver_order: int = 2
    # Step indices i whose corrector is skipped: the correction applied at step i + 1 to the
    # sample predicted at step i (diffusers' semantics). Euler ignores it.
    disable_corrector: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.num_train_timesteps) or self.num_train_timesteps < 2:
            raise ValueError(
                f"num_train_timesteps={self.num_train_timesteps!r} must be an int >= 2 (Wan2.2 uses 1000)"
            )
        object.__setattr__(self, "flow_shift", _check_flow_shift(self.flow_shift, where="flow_shift"))
        if not _is_int(self.solver_order) or self.solver_order not in (1, 2):
            raise ValueError(
                f"solver_order={self.solver_order!r} is not supported: allowed 1 or 2 (Wan2.2 ships 2)"
            )
        dc = self.disable_corrector
        if not isinstance(dc, (tuple, list)) or not all(_is_int(i) and i >= 0 for i in dc):
            raise ValueError(
                f"disable_corrector={list(dc) if isinstance(dc, tuple) else dc!r} must be a list of step indices (ints >= 0), e.g. [] or [0]"
            )
        object.__setattr__(self, "disable_corrector", tuple(sorted(set(dc))))

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SchedulerConfig:
        """Build from a diffusers ``scheduler_config.json`` dict (UniPCMultistepScheduler keys).

        Keys starting with ``_`` (``_class_name``, ``_diffusers_version``) are ignored, as diffusers
        does. A missing key takes diffusers' default, so a dict that lacks e.g. ``prediction_type``
        is rejected exactly where diffusers would silently build an epsilon-prediction scheduler.
        """
        if not isinstance(config, dict):
            raise ValueError(f"scheduler config must be a dict, got {type(config).__name__}")
        keys = {k for k in config if not (isinstance(k, str) and k.startswith("_"))}
        unknown = sorted(map(str, keys - set(_FIXED_KEYS) - _INERT_KEYS - set(_FIELD_KEYS)))
        if unknown:
            known = sorted([*_FIELD_KEYS, *_FIXED_KEYS, *_INERT_KEYS])
            raise ValueError(
                f"scheduler config has unknown key(s) {unknown}; known UniPCMultistepScheduler keys "
                f"are {known}. Remove them (is this a UniPC scheduler_config.json?)"
            )
        for key, (supported, default) in _FIXED_KEYS.items():
            value = config.get(key, default)
            if value != supported or type(value) is not type(supported):
                missing = " (missing, so diffusers' default)" if key not in config else ""
                raise ValueError(
                    f"scheduler config {key}={value!r}{missing} is not supported: only {supported!r} "
                    "is (we implement the Wan2.2 flow-matching UniPC configuration). "
                    f"Set {key} to {supported!r} in scheduler_config.json."
                )
        values = {key: config.get(key, default) for key, default in _FIELD_KEYS.items()}
        if not isinstance(values["disable_corrector"], (list, tuple)):
            raise ValueError(
                f"scheduler config disable_corrector={values['disable_corrector']!r} must be a list "
                "of step indices (ints >= 0), e.g. []"
            )
        return cls(
            num_train_timesteps=values["num_train_timesteps"],
            flow_shift=values["flow_shift"],
            solver_order=values["solver_order"],
            disable_corrector=tuple(values["disable_corrector"]),
        )


# ----------------------------------------------------------------------------------------------
# Schedule
# ----------------------------------------------------------------------------------------------


def flow_sigmas(*, num_steps: int, flow_shift: float, num_train_timesteps: int) -> torch.Tensor:
    """The N shifted noise levels sigma_0 > ... > sigma_{N-1} (float64, the final 0 not included).

    Mirrors numpy's linspace arithmetic (``i * step + start``, last point excluded) so that the
    int64 truncation of ``sigma * T`` gives diffusers' timesteps exactly.
    """
    start, stop = 1.0, 1.0 / num_train_timesteps
    step = (stop - start) / num_steps  # linspace(start, stop, N + 1): N intervals
    u = torch.arange(num_steps, dtype=torch.float64) * step + start  # [N]
    sigmas = flow_shift * u / (1 + (flow_shift - 1) * u)  # [N]
    if abs(sigmas[0].item() - 1.0) < _SIGMA_MAX_NUDGE:
        sigmas[0] -= _SIGMA_MAX_NUDGE
    return sigmas


# ----------------------------------------------------------------------------------------------
# Samplers
# ----------------------------------------------------------------------------------------------


class FlowScheduler:
    """Shared schedule and step bookkeeping; subclasses implement ``_update``.

    Use per job: ``set_timesteps(n)``, then for each ``t`` in ``.timesteps`` in order:
    ``sample = step(model(sample, t), t, sample)``.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        if not isinstance(config, SchedulerConfig):
            raise ValueError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.timesteps: torch.Tensor = torch.empty(0)  # [N], what the DiT gets as timestep
        self.sigmas: torch.Tensor = torch.empty(0)  # [N + 1] float32, sigmas[N] = 0
        self._step_index: int | None = None

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.numel())

    @property
    def step_index(self) -> int | None:
        """Index of the next ``step`` call in ``timesteps``; None before ``set_timesteps``."""
        return self._step_index

    def set_timesteps(self, num_steps: int, *, flow_shift: float | None = None) -> None:
        """Start a new job of ``num_steps`` model evaluations; clears all per-job state."""
        if not _is_int(num_steps) or num_steps < 1:
            raise ValueError(f"num_steps={num_steps!r} must be an int >= 1 (Wan2.2 uses 50)")
        shift = self.config.flow_shift if flow_shift is None else _check_flow_shift(flow_shift, where="flow_shift")
        T = self.config.num_train_timesteps
        sigmas64 = flow_sigmas(num_steps=num_steps, flow_shift=shift, num_train_timesteps=T)
        self.sigmas = torch.cat([sigmas64, sigmas64.new_zeros(1)]).to(torch.float32)  # [N + 1]
        self.timesteps = self._timesteps_from(sigmas64, T)
        self._step_index = 0
        self._reset_state()

    def step(self, model_output: torch.Tensor, timestep: int | float | torch.Tensor,
             sample: torch.Tensor) -> torch.Tensor:
        """Advance ``sample`` from ``sigmas[i]`` to ``sigmas[i + 1]``; returns it in ``sample.dtype``.

        ``timestep`` must be ``timesteps[i]`` (checked, to catch a pipeline that skips or repeats
        a step). Arithmetic and stored state are float32.
        """
        i = self._check_step(timestep)
        if model_output.shape != sample.shape:
            raise ValueError(
                f"model_output shape {tuple(model_output.shape)} != sample shape {tuple(sample.shape)}; "
                "the DiT output must have the latent's shape"
            )
        prev = self._update(model_output.to(torch.float32), sample.to(torch.float32), i)
        self._step_index = i + 1
        return prev.to(sample.dtype)

    # -- subclass hooks -------------------------------------------------------------------------

    def _timesteps_from(self, sigmas64: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
        raise NotImplementedError

    def _reset_state(self) -> None:
        pass

    def _update(self, v: torch.Tensor, x: torch.Tensor, i: int) -> torch.Tensor:
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------------

    def _check_step(self, timestep: int | float | torch.Tensor) -> int:
        i = self._step_index
        if i is None:
            raise RuntimeError(f"{type(self).__name__}.step() called before set_timesteps(num_steps)")
        if i >= self.num_steps:
            raise RuntimeError(
                f"{type(self).__name__}.step() called {i + 1} times but the schedule has {self.num_steps} "
                "steps; call set_timesteps() to start the next job"
            )
        if isinstance(timestep, torch.Tensor):
            if timestep.numel() != 1:
                raise ValueError(
                    f"step() takes the scalar timestep from .timesteps, got a tensor of shape "
                    f"{tuple(timestep.shape)} (pass t, not the per-token expanded timesteps)"
                )
            timestep = timestep.item()
        expected = self.timesteps[i].item()
        if float(timestep) != float(expected):
            raise ValueError(
                f"step() got timestep {timestep!r} but step {i} of {self.num_steps} expects {expected!r}; "
                "call step() once per entry of .timesteps, in order"
            )
        return i


class FlowEulerScheduler(FlowScheduler):
    """Flow-matching Euler: ``x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v_i`` (see module doc)."""

    def _timesteps_from(self, sigmas64: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
        # float32 sigma * T, as FlowMatchEulerDiscreteScheduler feeds the DiT.
        return sigmas64.to(torch.float32) * num_train_timesteps  # [N] float32

    def _update(self, v: torch.Tensor, x: torch.Tensor, i: int) -> torch.Tensor:
        dt = (self.sigmas[i + 1] - self.sigmas[i]).item()  # float32 difference, < 0
        return x + dt * v


class FlowUniPCScheduler(FlowScheduler):
    """UniPC (bh2, data prediction, order <= 2) over the flow schedule; equals diffusers' config.

    Per step i, with the model's velocity v_i at sample x_i (sigma_i):
      1. x0_i = x_i - sigma_i * v_i                  (flow output -> data prediction)
      2. UniC: unless i == 0 (or disabled), re-derive x_i from the previous sample x_{i-1} with
         x0_{i-1}, ..., x0_{i-p} and the new x0_i (order p = the predictor order used at i-1).
      3. UniP: predict x_{i+1} from x_i with x0_i (and x0_{i-1} at order 2).
    Order is 1 at the first step (no history) and at the last (lower_order_final), else
    ``solver_order``.

    In log-SNR lambda = log((1 - sigma) / sigma) with h = lambda_t - lambda_s > 0, the common
    first-order part is the DDIM / DPM-Solver-1 step in data prediction:
      x_t = (sigma_t / sigma_s) * x_s - alpha_t * (e^{-h} - 1) * x0_s,   alpha = 1 - sigma,
    and the higher-order terms add alpha_t * B(h) * sum_k rho_k * D_k with B(h) = e^{-h} - 1
    ("bh2") and D_k divided differences of x0 in lambda.
    The scalar coefficients are computed in float32 in the same order as diffusers, so that our
    result stays within float32 rounding of theirs over 50 steps.
    """

    def _timesteps_from(self, sigmas64: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
        # int64 trunc(sigma * T) from the float64 sigmas, as UniPCMultistepScheduler feeds the DiT.
        return (sigmas64 * num_train_timesteps).to(torch.int64)  # [N] int64

    def _reset_state(self) -> None:
        s = self.sigmas  # [N + 1] float32
        # log-SNR per sigma, float32; lambda_N = +inf at sigma_N = 0 (only the last, order-1 step
        # reaches it, where e^{-h} - 1 = -1 and the update returns x0 exactly).
        self._lambdas = torch.log(1 - s) - torch.log(s)  # [N + 1]
        self._x0_history: list[torch.Tensor] = []  # newest last, at most solver_order, float32
        self._last_sample: torch.Tensor | None = None  # x_{i-1} the last predictor started from
        self._last_order = 0  # order of the last predictor step

    def _update(self, v: torch.Tensor, x: torch.Tensor, i: int) -> torch.Tensor:
        cfg = self.config
        x0 = x - self.sigmas[i].item() * v  # flow_prediction -> x0 (predict_x0)
        if i > 0 and (i - 1) not in cfg.disable_corrector and self._last_sample is not None:
            x = self._corrector(x0, i)
        self._x0_history = [*self._x0_history, x0][-cfg.solver_order:]
        order = min(cfg.solver_order, self.num_steps - i, len(self._x0_history))
        self._last_sample, self._last_order = x, order
        return self._predictor(x, i, order)

    def _first_order_part(self, x_s: torch.Tensor, x0_s: torch.Tensor, s: int, t: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x_t of the order-1 step from sigma index s to t, with h and B(h) (0-d float32)."""
        sig_s, sig_t = self.sigmas[s], self.sigmas[t]
        h = self._lambdas[t] - self._lambdas[s]
        phi = torch.expm1(-h)  # e^{-h} - 1, in (-1, 0]; -1 at sigma_t = 0
        x_t = (sig_t / sig_s).item() * x_s - ((1 - sig_t) * phi).item() * x0_s
        return x_t, h, phi

    def _divided_difference(self, x0_k: torch.Tensor, x0_s: torch.Tensor, k: int, s: int,
                            h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """D = (x0_k - x0_s) / r with r = (lambda_k - lambda_s) / h (r < 0 for an older k)."""
        r = (self._lambdas[k] - self._lambdas[s]) / h
        return (x0_k - x0_s) / r.item(), r

    def _predictor(self, x: torch.Tensor, i: int, order: int) -> torch.Tensor:
        """UniP-bh2 from sigmas[i] to sigmas[i + 1] (diffusers: multistep_uni_p_bh_update)."""
        x0_i = self._x0_history[-1]
        x_next, h, phi = self._first_order_part(x, x0_i, i, i + 1)
        if order == 2:
            # The order-2 predictor uses the fixed rho = 1/2 instead of solving for it.
            d1, _ = self._divided_difference(self._x0_history[-2], x0_i, i - 1, i, h)
            x_next = x_next - ((1 - self.sigmas[i + 1]) * phi).item() * (0.5 * d1)
        return x_next

    def _corrector(self, x0_i: torch.Tensor, i: int) -> torch.Tensor:
        """UniC-bh2: redo the step sigmas[i-1] -> sigmas[i] with the new x0_i (multistep_uni_c_bh_update)."""
        order = self._last_order
        x0_prev = self._x0_history[-1]  # x0 at i - 1
        x_i, h, phi = self._first_order_part(self._last_sample, x0_prev, i - 1, i)
        d_t = x0_i - x0_prev
        scale = ((1 - self.sigmas[i]) * phi).item()  # alpha_t * B(h)
        if order == 1:
            return x_i - scale * (0.5 * d_t)
        # Order 2: rho solves [[1, 1], [r, 1]] rho = b, with b_k = k! * phi_{k+1}(-h) / B(h)
        # built by the recurrence phi_{k+1} = phi_k / (-h) - 1/k!.
        d1, r = self._divided_difference(self._x0_history[-2], x0_prev, i - 2, i - 1, h)
        hh = -h
        p1 = phi / hh - 1
        b1 = p1 / phi
        p2 = p1 / hh - 0.5
        b2 = p2 * 2 / phi
        rho0 = (b1 - b2) / (1 - r)
        rho1 = b1 - rho0
        return x_i - scale * (rho0.item() * d1 + rho1.item() * d_t)


def make_scheduler(name: SchedulerName | str, config: SchedulerConfig) -> FlowScheduler:
    """``"unipc"`` -> FlowUniPCScheduler (default sampler), ``"euler"`` -> FlowEulerScheduler."""
    if name == "unipc":
        return FlowUniPCScheduler(config)
    if name == "euler":
        return FlowEulerScheduler(config)
    raise ValueError(f"unknown sampler {name!r}: allowed {list(SCHEDULER_NAMES)}")
