"""Flow-matching samplers for PAN2 / Wan2.2: UniPC (the default), Euler and DMD (few-step).

PAN2's DiT predicts the flow velocity ``v = noise - x0`` of the straight path
``x_sigma = (1 - sigma) * x0 + sigma * noise``. A sampler walks ``sigma`` from ~1 down to 0 over
``num_steps`` model evaluations.

The schedule of UniPC and Euler is diffusers' ``UniPCMultistepScheduler`` flow schedule
(``use_flow_sigmas=True``, diffusers 0.42):

    u_i     = 1 + i * (1/T - 1) / N                for i = 0..N-1   (np.linspace(1, 1/T, N+1)[:-1])
    sigma_i = s * u_i / (1 + (s - 1) * u_i)        (the flow shift s; s > 1 spends more steps at high noise)
    sigma_0 -= 1e-6                                (sigma_0 is always 1; UniPC takes log(1 - sigma))
    sigma_N = 0

with T = ``num_train_timesteps``. All of it is computed in float64 exactly as numpy does and then
stored as float32, so the values equal diffusers' bit for bit.

- ``FlowUniPCSampler`` equals ``UniPCMultistepScheduler`` as Wan2.2 ships it
  (``prediction_type="flow_prediction"``, ``use_flow_sigmas=True``, ``solver_order=2``,
  ``solver_type="bh2"``, ``predict_x0=True``, ``lower_order_final=True``,
  ``final_sigmas_type="zero"``). Only that configuration is implemented (plus ``solver_order=1``
  and ``disable_corrector``, which cost nothing). Its ``timesteps`` are int64
  ``trunc(sigma_i * T)``, what diffusers feeds the DiT.
- ``FlowEulerSampler`` is ``x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v_i`` over the SAME
  sigmas. diffusers' ``FlowMatchEulerDiscreteScheduler(shift=s)`` uses a different schedule
  (N points from 1 to its shifted sigma_min *inclusive*, and sigma_min is shifted twice), e.g.
  N=4, s=5: diffusers [1.0, 0.910, 0.717, 0.024] vs ours [1.0, 0.938, 0.834, 0.626]; so ours
  equals ``FlowMatchEulerDiscreteScheduler(shift=1.0)`` with ``set_timesteps(sigmas=<our sigmas>)``
  instead. Its ``timesteps`` are float32 ``sigma_i * T``, as that scheduler feeds the DiT.

Both keep their state (history, last sample) in float32 whatever the model dtype: the model
output is upcast before any arithmetic. (diffusers multiplies ``sigma * model_output`` in the
model's dtype first; with a bf16 model we are slightly more precise than diffusers, by design.)

- ``FlowDMDSampler`` is the few-step sampler of step-distilled (DMD) checkpoints such as
  FastWan2.2-TI2V-5B, run as FastVideo runs it (``DmdStrategy`` in
  ``fastvideo/pipelines/stages/denoising_dmd_strategy.py`` with ``pred_noise_to_pred_video`` of
  ``fastvideo/models/utils.py``). The job lists integer timesteps t_0 > ... > t_{N-1} in [1, T];
  each is warped through the shifted flow schedule, ``u_i = t_i / T``,
  ``sigma_i = s * u_i / (1 + (s - 1) * u_i)``, and the DiT gets ``sigma_i * T``. Per step:
  ``x0 = x - sigma_i * v``; then ``x = (1 - sigma_{i+1}) * x0 + sigma_{i+1} * noise`` with fresh
  noise, or ``x0`` itself after the last step.
  Where ours matches FastVideo: the same x0 estimate, the same re-noising (their
  ``scheduler.add_noise``), fresh standard-normal noise of the full latent shape per step, no
  guidance. Where it differs: FastVideo warps ``dmd_denoising_steps`` by indexing the 1000-entry
  table of a ``FlowMatchEulerDiscreteScheduler(shift=s)`` at ``T - t_i`` and later looks sigma up
  at the *nearest* entry of that table (``argmin |timesteps - t|``); for an integer t in [1, T]
  that entry is exactly ``s*u/(1+(s-1)*u)`` with ``u = t/T``, so we compute it in closed form
  (float64, then float32) instead of a float32 table lookup: the same sigma up to float32
  rounding, and no table to keep in step with T. FastVideo draws the noise from the batch's
  generator on its device in the model's dtype; we draw float32 noise from the job's seeded CPU
  generator, so a result does not depend on the device or the group size. The first-frame
  (image) conditioning keeps its per-token timestep 0 and is re-imposed after every step, as in
  the other samplers.

A checkpoint's ``scheduler_config.json`` may be a ``UniPCMultistepScheduler`` (Wan2.2's) or a
``FlowMatchEulerDiscreteScheduler`` (distilled checkpoints; its shift is the key ``shift``).
``SchedulerConfig.from_dict`` reads what the samplers need (T, the shift, the class for the
default sampler), logs keys it does not use, and refuses only values that change the math in a
way we do not implement, naming the file and the key.

UniPC reference: Zhao et al., "UniPC: A Unified Predictor-Corrector Framework for Fast Sampling of
Diffusion Models", arXiv:2302.04867 (B(h) variant "bh2": B(h) = e^h - 1, data prediction).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..sampling import DEFAULT_NUM_TRAIN_TIMESTEPS, DMD, SAMPLERS, flow_sigma_values, is_int, timesteps_problem

log = logging.getLogger(__name__)



# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ClassRules:
    """How one diffusers scheduler class's ``scheduler_config.json`` maps onto SchedulerConfig."""

    # The sampler a job gets from this checkpoint when it names none (library use).
    default_sampler: str
    # The key holding the flow shift s, with diffusers' default for a missing key.
    shift_key: str
    shift_default: float
    # key -> (the one value we implement, diffusers 0.42's default when the key is missing): any
    # other value changes the math in a way we do not implement, so the config is refused.
    fixed: dict[str, tuple[Any, Any]]
    # Keys that become SchedulerConfig fields (besides T and the shift), with diffusers' defaults.
    fields: dict[str, Any]


# Schedules we reject in either class: they replace the shifted flow sigmas we compute.
_COMMON_FIXED: dict[str, tuple[Any, Any]] = {
    "use_karras_sigmas": (False, False),
    "use_exponential_sigmas": (False, False),
    "use_beta_sigmas": (False, False),
    "use_dynamic_shifting": (False, False),
    "shift_terminal": (None, None),
}

_CLASSES: dict[str, _ClassRules] = {
    "UniPCMultistepScheduler": _ClassRules(
        default_sampler="unipc", shift_key="flow_shift", shift_default=1.0,
        fixed={
            **_COMMON_FIXED,
            "prediction_type": ("flow_prediction", "epsilon"),
            "use_flow_sigmas": (True, False),
            "predict_x0": (True, True),
            "solver_type": ("bh2", "bh2"),
            # False would run order 2 into sigma=0: inf/nan in diffusers too.
            "lower_order_final": (True, True),
            "final_sigmas_type": ("zero", "zero"),
            "thresholding": (False, False),
            "solver_p": (None, None),
        },
        fields={"solver_order": 2, "disable_corrector": []},
    ),
    # Flow prediction by construction (no prediction_type key).
    "FlowMatchEulerDiscreteScheduler": _ClassRules(
        default_sampler="euler", shift_key="shift", shift_default=1.0,
        fixed={
            **_COMMON_FIXED,
            "invert_sigmas": (False, False),
            "stochastic_sampling": (False, False),
        },
        fields={},
    ),
}
# A config without _class_name is read as Wan2.2's UniPC one.
_DEFAULT_CLASS = "UniPCMultistepScheduler"



def _check_flow_shift(flow_shift: object, *, where: str) -> float:
    if not isinstance(flow_shift, (int, float)) or isinstance(flow_shift, bool):
        raise ValueError(f"{where}={flow_shift!r} must be a number > 0 (Wan2.2-TI2V-5B uses 5.0)")
    if not math.isfinite(flow_shift) or flow_shift <= 0:
        raise ValueError(f"{where}={flow_shift!r} must be a finite number > 0 (Wan2.2-TI2V-5B uses 5.0)")
    return float(flow_shift)


@dataclass(frozen=True)
class SchedulerConfig:
    """What our samplers read from a checkpoint's ``scheduler/scheduler_config.json``.

    Defaults reproduce Wan2.2-TI2V-5B-Diffusers. ``from_dict`` reads the JSON the way diffusers'
    ``from_config`` does for the classes in ``_CLASSES`` and refuses only what we do not implement.
    """

    # Training-time timestep range; sigma_i * num_train_timesteps is the DiT's timestep.
    num_train_timesteps: int = DEFAULT_NUM_TRAIN_TIMESTEPS
    # Default flow shift s in sigma = s*u / (1 + (s-1)*u); set_timesteps(flow_shift=...) overrides it.
    flow_shift: float = 5.0
    # UniPC multistep order: 2 (Wan2.2) or 1. Euler and DMD ignore it.
    solver_order: int = 2
    # Step indices i whose corrector is skipped: the correction applied at step i + 1 to the
    # sample predicted at step i (diffusers' semantics). Euler and DMD ignore it.
    disable_corrector: tuple[int, ...] = ()
    # The sampler the checkpoint's scheduler class stands for (UniPC -> unipc, FlowMatchEuler -> euler).
    default_sampler: str = "unipc"

    def __post_init__(self) -> None:
        if not is_int(self.num_train_timesteps) or self.num_train_timesteps < 2:
            raise ValueError(
                f"num_train_timesteps={self.num_train_timesteps!r} must be an int >= 2 (Wan2.2 uses 1000)"
            )
        object.__setattr__(self, "flow_shift", _check_flow_shift(self.flow_shift, where="flow_shift"))
        if not is_int(self.solver_order) or self.solver_order not in (1, 2):
            raise ValueError(
                f"solver_order={self.solver_order!r} is not supported: allowed 1 or 2 (Wan2.2 ships 2)"
            )
        dc = self.disable_corrector
        if not isinstance(dc, (tuple, list)) or not all(is_int(i) and i >= 0 for i in dc):
            raise ValueError(
                f"disable_corrector={list(dc) if isinstance(dc, tuple) else dc!r} must be a list of step "
                f"indices (ints >= 0), e.g. [] or [0]"
            )
        object.__setattr__(self, "disable_corrector", tuple(sorted(set(dc))))
        if self.default_sampler not in SAMPLERS:
            raise ValueError(f"default_sampler={self.default_sampler!r}: allowed {', '.join(SAMPLERS)}")

    @classmethod
    def from_dict(cls, config: dict[str, Any], *, source: str = "scheduler_config.json") -> SchedulerConfig:
        """Build from a diffusers ``scheduler_config.json`` dict; ``source`` names it in errors.

        Keys starting with ``_`` (``_class_name``, ``_diffusers_version``) are metadata, as in
        diffusers. Keys we do not use are logged, not refused (a newer diffusers adds keys). A
        missing key takes diffusers' default, so a UniPC dict that lacks e.g. ``prediction_type``
        is refused exactly where diffusers would silently build an epsilon-prediction scheduler.
        """
        if not isinstance(config, dict):
            raise ValueError(f"{source}: scheduler config must be a JSON object, got {type(config).__name__}")
        class_name = config.get("_class_name", _DEFAULT_CLASS)
        rules = _CLASSES.get(class_name) if isinstance(class_name, str) else None
        if rules is None:
            raise ValueError(
                f"{source}: _class_name={class_name!r} is not a scheduler we implement; allowed: "
                f"{', '.join(_CLASSES)} (flow-matching schedulers with a shift)"
            )
        for key, (supported, default) in rules.fixed.items():
            value = config.get(key, default)
            if value != supported or type(value) is not type(supported):
                missing = " (missing, so diffusers' default)" if key not in config else ""
                raise ValueError(
                    f"{source}: {key}={value!r}{missing} is not supported for {class_name}: only "
                    f"{supported!r} is (it would change the sampling math in a way we do not implement). "
                    f"Set {key} to {supported!r}."
                )
        used = {"num_train_timesteps", rules.shift_key, *rules.fixed, *rules.fields}
        unused = sorted(str(k) for k in config if not str(k).startswith("_") and k not in used)
        if unused:
            log.info("%s: %s keys not used by our samplers (no effect on the flow schedule): %s",
                     source, class_name, ", ".join(unused))
        values = {key: config.get(key, default) for key, default in rules.fields.items()}
        if not isinstance(values.get("disable_corrector", []), (list, tuple)):
            raise ValueError(
                f"{source}: disable_corrector={values['disable_corrector']!r} must be a list "
                "of step indices (ints >= 0), e.g. []"
            )
        try:
            shift = _check_flow_shift(config.get(rules.shift_key, rules.shift_default), where=rules.shift_key)
            return cls(
                num_train_timesteps=config.get("num_train_timesteps", DEFAULT_NUM_TRAIN_TIMESTEPS),
                flow_shift=shift,
                solver_order=values.get("solver_order", cls.solver_order),
                disable_corrector=tuple(values.get("disable_corrector", ())),
                default_sampler=rules.default_sampler,
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e


# ----------------------------------------------------------------------------------------------
# Schedule
# ----------------------------------------------------------------------------------------------


def flow_sigmas(*, num_steps: int, flow_shift: float, num_train_timesteps: int) -> torch.Tensor:
    """The N shifted noise levels sigma_0 > ... > sigma_{N-1} (float64, the final 0 not included).

    Mirrors numpy's linspace arithmetic (``i * step + start``, last point excluded) so that the
    int64 truncation of ``sigma * T`` gives diffusers' timesteps exactly.
    """
    # The arithmetic is torch-free (the runner's driver records these in params.json without
    # importing torch); float64 either way, the same operations in the same order.
    return torch.tensor(flow_sigma_values(num_steps=num_steps, flow_shift=flow_shift,
                                          num_train_timesteps=num_train_timesteps), dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# Samplers
# ----------------------------------------------------------------------------------------------


def clean_estimate(x: torch.Tensor, v: torch.Tensor, sigma: float) -> torch.Tensor:
    """The model's data prediction at noise level ``sigma``: ``x0 = x - sigma * v`` (float32 in,
    float32 out). UniPC and DMD step from it; a live preview shows it (`pan2render.models.preview`),
    on any slice of the latents: the same arithmetic per element, so the same bits."""
    return x - sigma * v


@dataclass(frozen=True)
class StepState:
    """A sampler's own state at a step boundary: what ``step`` reads besides the sample. A sampler
    set up for the same schedule and given it (``load_state``) continues exactly where this one
    stood, bit for bit."""

    step: int  # steps done: the next ``step`` call is for ``timesteps[step]``
    tensors: dict[str, torch.Tensor]  # float32, the sample's shape (UniPC: its history); none for the others
    counters: dict[str, int]  # small ints (UniPC: the order of its last predictor)


class FlowSampler:
    """Shared schedule and step bookkeeping; subclasses implement ``_update``.

    Use per job: ``set_timesteps(n)``, then for each ``t`` in ``.timesteps`` in order:
    ``sample = step(model(sample, t), t, sample)``. Between two steps ``state()`` captures what the
    next step needs; ``load_state`` on a sampler just set up for the same schedule continues from it.
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
        if not is_int(num_steps) or num_steps < 1:
            raise ValueError(f"num_steps={num_steps!r} must be an int >= 1 (Wan2.2 uses 50)")
        shift = self._shift(flow_shift)
        T = self.config.num_train_timesteps
        self._start(flow_sigmas(num_steps=num_steps, flow_shift=shift, num_train_timesteps=T))

    def _shift(self, flow_shift: float | None) -> float:
        return self.config.flow_shift if flow_shift is None else _check_flow_shift(flow_shift, where="flow_shift")

    def _start(self, sigmas64: torch.Tensor) -> None:
        """Per-job state from the N float64 sigmas (the final 0 not included)."""
        self.sigmas = torch.cat([sigmas64, sigmas64.new_zeros(1)]).to(torch.float32)  # [N + 1]
        self.timesteps = self._timesteps_from(sigmas64, self.config.num_train_timesteps)
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

    def state(self) -> StepState:
        """The sampler's state at this step boundary (its tensors are its own, not copies: the
        caller copies them before the next step if it keeps them)."""
        if self._step_index is None:
            raise RuntimeError(f"{type(self).__name__}.state() called before set_timesteps(num_steps)")
        tensors, counters = self._own_state()
        return StepState(step=self._step_index, tensors=tensors, counters=counters)

    def load_state(self, state: StepState, *, device: torch.device | str) -> None:
        """Continue the job just set up (``set_timesteps`` for the schedule ``state`` was taken
        from) at step ``state.step``; the tensors are copied to ``device``. Raises ValueError naming
        what does not fit this sampler."""
        if self._step_index != 0:
            raise RuntimeError(f"{type(self).__name__}.load_state() continues a job just set up: call "
                               "set_timesteps() first, and no step() before it")
        if not 0 <= state.step < self.num_steps:
            raise ValueError(f"step {state.step} is not a boundary of this {self.num_steps}-step schedule")
        self._load_own_state(state, torch.device(device))
        self._step_index = state.step

    # -- subclass hooks -------------------------------------------------------------------------

    def _own_state(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        return {}, {}

    def _load_own_state(self, state: StepState, device: torch.device) -> None:
        if state.tensors or state.counters:
            raise ValueError(f"the {type(self).__name__} keeps no state between steps, got tensors "
                             f"{sorted(state.tensors)} and counters {sorted(state.counters)}")

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


class FlowEulerSampler(FlowSampler):
    """Flow-matching Euler: ``x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v_i`` (see module doc)."""

    def _timesteps_from(self, sigmas64: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
        # float32 sigma * T, as FlowMatchEulerDiscreteScheduler feeds the DiT.
        return sigmas64.to(torch.float32) * num_train_timesteps  # [N] float32

    def _update(self, v: torch.Tensor, x: torch.Tensor, i: int) -> torch.Tensor:
        dt = (self.sigmas[i + 1] - self.sigmas[i]).item()  # float32 difference, < 0
        return x + dt * v


class FlowUniPCSampler(FlowSampler):
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

    def _own_state(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        # x0.0 is the oldest of the history; last_sample exists once a step ran.
        tensors = {f"x0.{k}": x0 for k, x0 in enumerate(self._x0_history)}
        if self._last_sample is not None:
            tensors["last_sample"] = self._last_sample
        return tensors, {"last_order": self._last_order}

    def _load_own_state(self, state: StepState, device: torch.device) -> None:
        step, order = state.step, self.config.solver_order
        kept = min(step, order)  # the history grows by one x0 per step, up to the solver order
        names = {f"x0.{k}" for k in range(kept)} | ({"last_sample"} if step > 0 else set())
        if set(state.tensors) != names:
            raise ValueError(f"UniPC (order {order}) after {step} step(s) keeps {sorted(names)}, got "
                             f"{sorted(state.tensors)}")
        last_order = state.counters.get("last_order")
        allowed = range(1, order + 1) if step > 0 else range(0, 1)
        if set(state.counters) != {"last_order"} or last_order not in allowed:
            raise ValueError(f"UniPC after {step} step(s) needs counters {{'last_order': {list(allowed)}}}, got "
                             f"{state.counters}")
        own = {k: t.to(device, torch.float32, copy=True) for k, t in state.tensors.items()}
        self._x0_history = [own[f"x0.{k}"] for k in range(kept)]
        self._last_sample = own.get("last_sample")
        self._last_order = last_order

    def _update(self, v: torch.Tensor, x: torch.Tensor, i: int) -> torch.Tensor:
        cfg = self.config
        x0 = clean_estimate(x, v, self.sigmas[i].item())  # flow_prediction -> x0 (predict_x0)
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


def warped_sigmas(timesteps: Sequence[int], *, flow_shift: float, num_train_timesteps: int) -> torch.Tensor:
    """float64 ``sigma_i = s*u_i / (1 + (s-1)*u_i)``, ``u_i = t_i / T``, for DMD's listed timesteps."""
    u = torch.tensor(list(timesteps), dtype=torch.float64) / num_train_timesteps  # [N]
    return flow_shift * u / (1 + (flow_shift - 1) * u)


class FlowDMDSampler(FlowSampler):
    """DMD few-step sampling over listed, warped timesteps (see the module doc).

    Per job: ``set_dmd_timesteps(timesteps, generator=...)``, then ``step`` as for the others.
    Every step but the last draws fresh float32 noise of the sample's shape from ``generator``
    on the CPU (the job's seeded generator, so every device and every rank of a group draws the
    same numbers) and moves it to the sample's device. That generator is its only state between
    steps, and it is the caller's: a caller that stops between steps keeps ``get_state()`` and
    restores it with ``set_state`` before ``load_state``.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._generator: torch.Generator | None = None

    def set_timesteps(self, num_steps: int, *, flow_shift: float | None = None) -> None:
        raise ValueError("the dmd sampler runs listed timesteps: call set_dmd_timesteps(timesteps, generator=...)")

    def set_dmd_timesteps(self, timesteps: Sequence[int], *, generator: torch.Generator,
                          flow_shift: float | None = None) -> None:
        """Start a job over ``timesteps`` (ints in [1, T], strictly decreasing); ``generator`` is a
        CPU ``torch.Generator`` the fresh noise is drawn from."""
        T = self.config.num_train_timesteps
        problem = timesteps_problem(timesteps, num_train_timesteps=T)
        if problem is not None:
            raise ValueError(f"timesteps {problem}")
        if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
            raise ValueError("generator must be a CPU torch.Generator (the job's seeded one), so that the "
                             "noise does not depend on the device")
        self._generator = generator
        self._start(warped_sigmas(timesteps, flow_shift=self._shift(flow_shift), num_train_timesteps=T))

    def _timesteps_from(self, sigmas64: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
        # float32 sigma * T: what FastVideo's warped table holds and feeds the DiT.
        return sigmas64.to(torch.float32) * num_train_timesteps  # [N] float32

    def _update(self, v: torch.Tensor, x: torch.Tensor, i: int) -> torch.Tensor:
        x0 = clean_estimate(x, v, self.sigmas[i].item())  # flow velocity -> clean estimate
        if i + 1 == self.num_steps:
            return x0
        assert self._generator is not None  # set with the timesteps
        noise = torch.randn(x.shape, generator=self._generator, dtype=torch.float32).to(x.device)
        sigma_next = self.sigmas[i + 1].item()
        return (1 - sigma_next) * x0 + sigma_next * noise


_SAMPLERS: dict[str, type[FlowSampler]] = {
    "unipc": FlowUniPCSampler, "euler": FlowEulerSampler, DMD: FlowDMDSampler,
}
assert tuple(_SAMPLERS) == SAMPLERS, "every sampler a job may name has exactly one implementation"


def make_sampler(name: str, config: SchedulerConfig) -> FlowSampler:
    """A fresh sampler for one job: ``"unipc"`` (the default), ``"euler"`` or ``"dmd"``."""
    cls = _SAMPLERS.get(name)
    if cls is None:
        raise ValueError(f"unknown sampler {name!r}: allowed {', '.join(SAMPLERS)}")
    return cls(config)
