"""A sampling's whole state at a step boundary (`SamplerState`), and its step-checkpoint bytes.

`PAN2Pipeline.sample` hands one to its ``on_checkpoint`` hook, carries one in `SamplingPreempted`
when ``should_stop`` stops it, and continues from one (``resume_from``): the continued sampling is
the same computation as one never stopped (bit-equal on the CPU). `pack_sampler_state` /
`unpack_sampler_state` turn it into a step checkpoint's bytes and back; the format and its checks
(damaged, stale, foreign) are `pan2render.step_checkpoint`'s, which the runner's driver runs
without torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from ..step_checkpoint import (
    GENERATOR,
    LATENTS,
    SAMPLER_PREFIX,
    SCHEDULE,
    CheckpointHeader,
    CheckpointKey,
    StepCheckpointError,
    key_problem,
    metadata_for,
    read_checkpoint,
    step_problem,
)
from .samplers import FlowSampler, StepState

__all__ = ["CheckpointKey", "SamplerState", "SamplingPreempted", "StepCheckpointError", "StepHooks", "capture_state",
           "pack_sampler_state", "resume_state", "unpack_sampler_state"]


@dataclass(frozen=True)
class SamplerState:
    """Everything the next step of a sampling reads, on the CPU, and what it belongs to."""

    key: CheckpointKey  # the request it continues (the spec hash is the caller's, set when packed)
    latents: Tensor  # float32 [1, C, T, h, w] after ``step`` steps (the first frame imposed, where given)
    schedule: Tensor  # float32 [N + 1]: the sigmas it runs over
    generator: Tensor  # uint8: the job's CPU noise generator, ``torch.Generator.get_state()``
    sampler: StepState  # the sampler's own state, its tensors float32 on the CPU

    @property
    def step(self) -> int:
        """Steps done; a sampling resumed from this state runs steps ``step`` .. N - 1."""
        return self.sampler.step

    def nbytes(self) -> dict[str, int]:
        """Bytes of its tensors: ``latents``, ``sampler`` (the sampler's own and the generator) and
        ``total`` (the schedule too)."""
        own = sum(t.nbytes for t in self.sampler.tensors.values()) + self.generator.nbytes
        latents = self.latents.nbytes
        return {"latents": latents, "sampler": own, "total": latents + own + self.schedule.nbytes}


class SamplingPreempted(Exception):
    """``should_stop`` stopped a sampling at a step boundary; ``state`` continues it (``resume_from``)."""

    def __init__(self, state: SamplerState) -> None:
        super().__init__(f"sampling stopped at a step boundary after step {state.step} of "
                         f"{state.key.total_steps} (should_stop); resume_from=.state continues it")
        self.state = state


def pack_sampler_state(state: SamplerState, *, spec_hash: str = "") -> bytes:
    """The state as step-checkpoint bytes (safetensors), marked with the job's ``spec_hash``."""
    from safetensors.torch import save  # only where checkpoints are written

    key = replace(state.key, spec_hash=spec_hash) if spec_hash else state.key
    tensors = {LATENTS: state.latents, SCHEDULE: state.schedule, GENERATOR: state.generator,
               **{SAMPLER_PREFIX + name: t for name, t in state.sampler.tensors.items()}}
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    header = CheckpointHeader(key=key, step=state.step, counters=dict(state.sampler.counters))
    return save(tensors, metadata=metadata_for(header, {name: t.numpy() for name, t in tensors.items()}))


def unpack_sampler_state(data: bytes, *, spec_hash: str = "", model_id: str = "") -> SamplerState:
    """A state from step-checkpoint bytes, checked (`step_checkpoint.read_checkpoint`): raises
    `StepCheckpointError` with the reason for a damaged, foreign or stale one (another
    ``spec_hash`` / ``model_id`` where given; `PAN2Pipeline.sample` checks the rest of the request
    when it resumes)."""
    header, arrays = read_checkpoint(data, spec_hash=spec_hash, model_id=model_id)
    # safetensors' arrays view the bytes read-only; the state owns writable copies
    tensors = {name: torch.from_numpy(np.array(a)) for name, a in arrays.items()}
    own = {name[len(SAMPLER_PREFIX):]: t for name, t in tensors.items() if name.startswith(SAMPLER_PREFIX)}
    return SamplerState(key=header.key, latents=tensors[LATENTS], schedule=tensors[SCHEDULE],
                        generator=tensors[GENERATOR],
                        sampler=StepState(step=header.step, tensors=own, counters=header.counters))


# ---------------------------------------------------------------------------------- in the sampling loop
def capture_state(key: CheckpointKey, latents: Tensor, sampler: FlowSampler,
                  generator: torch.Generator) -> SamplerState:
    """The state at this step boundary, copied to the CPU (the device -> host copy is the part of a
    checkpoint on the device's path; packing it is the caller's, and can run beside the next step)."""
    own = sampler.state()
    return SamplerState(key=key, latents=_to_host(latents), schedule=sampler.sigmas.clone(),
                        generator=generator.get_state(),
                        sampler=StepState(step=own.step, tensors={k: _to_host(t) for k, t in own.tensors.items()},
                                          counters=dict(own.counters)))


def _to_host(t: Tensor) -> Tensor:
    # A copy even on the CPU: the pipeline writes the first frame into its latents in place.
    return t.detach().to("cpu", torch.float32, copy=True)


def resume_state(state: SamplerState, *, key: CheckpointKey, sampler: FlowSampler,
                 generator: torch.Generator, device: torch.device) -> Tensor:
    """Set ``sampler`` (just set up for the request ``key`` describes) and the job's ``generator``
    to ``state``; returns its latents on ``device``. Raises `StepCheckpointError` when the state
    belongs to another request or schedule, or does not fit this sampler."""
    problem = key_problem(state.key, key) or step_problem(state.step, key.total_steps)
    if problem is None and tuple(state.latents.shape) != key.latent_shape:
        problem = f"damaged: latents of shape {list(state.latents.shape)} in a state for {list(key.latent_shape)}"
    if problem is None and not torch.equal(state.schedule, sampler.sigmas):
        problem = "stale: it was sampled over another schedule (its flow_shift or timesteps differ)"
    if problem is not None:
        raise StepCheckpointError(f"cannot resume from this step checkpoint: {problem}")
    try:
        generator.set_state(state.generator)
        sampler.load_state(state.sampler, device=device)
    except (ValueError, RuntimeError) as e:
        raise StepCheckpointError(f"cannot resume from this step checkpoint: damaged: {e}") from e
    return state.latents.to(device, torch.float32, copy=True)


class StepHooks:
    """What `PAN2Pipeline.sample` does at a step boundary (after every step but the last): a
    checkpoint when ``checkpoint_every_s`` seconds of sampling passed since the last one (0: never),
    handed to ``on_checkpoint``; a stop when ``should_stop`` says so on any rank (agreed over the
    ranks that run the steps), which checkpoints and raises `SamplingPreempted`. ``active`` is False
    when neither can happen: the loop then calls nothing."""

    def __init__(self, *, checkpoint_every_s: float = 0.0,
                 on_checkpoint: Callable[[SamplerState], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(checkpoint_every_s, bool) or not isinstance(checkpoint_every_s, (int, float)) \
                or not math.isfinite(checkpoint_every_s) or checkpoint_every_s < 0:
            raise ValueError(f"checkpoint_every_s={checkpoint_every_s!r}: must be a number of seconds >= 0 "
                             "(0 turns timed step checkpoints off)")
        self.every_s = float(checkpoint_every_s) if on_checkpoint is not None else 0.0
        self.on_checkpoint = on_checkpoint
        self.should_stop = should_stop
        self.active = should_stop is not None or self.every_s > 0
        self._clock = clock  # seconds, monotonic
        self._last = clock()

    def start(self) -> None:
        """The sampling's first step starts now: the first checkpoint is due ``every_s`` after it."""
        self._last = self._clock()

    def at_boundary(self, capture: Callable[[], SamplerState], any_rank: Callable[[bool], bool]) -> None:
        """Called between two steps; ``capture`` makes the state, ``any_rank`` agrees a flag over the ranks."""
        stop = self.should_stop is not None and any_rank(bool(self.should_stop()))
        due = self.every_s > 0 and self._clock() - self._last >= self.every_s
        if not (stop or due):
            return
        state = capture()
        if self.on_checkpoint is not None:
            self.on_checkpoint(state)
            self._last = self._clock()  # the hook's own time is not sampling time
        if stop:
            raise SamplingPreempted(state)
