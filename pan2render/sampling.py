"""Sampler names and the rules that tie a job's ``sampler``, ``timesteps`` and ``guidance`` together.

One torch-free place shared by batch validation (``pan2render.jobs``), the sampling request
(``pan2render.models.pipeline``) and the samplers themselves (``pan2render.models.scheduler``), so
that a job the batch accepts is a job the pipeline runs, and the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence

# The samplers a job may name. "dmd" is the few-step sampler of step-distilled checkpoints
# (distribution matching distillation): it takes an explicit list of timesteps and no guidance.
SAMPLERS: tuple[str, ...] = ("unipc", "euler", "dmd")
DMD = "dmd"
# What diffusers' flow schedulers default to, and every Wan2.x checkpoint uses.
DEFAULT_NUM_TRAIN_TIMESTEPS = 1000


def timesteps_problem(timesteps: object, *, num_train_timesteps: int) -> str | None:
    """What is wrong with a DMD ``timesteps`` list (None if nothing): a non-empty list of integers
    in [1, num_train_timesteps], strictly decreasing (the first is the noisiest)."""
    allowed = (f"a non-empty list of integers in 1..{num_train_timesteps}, strictly decreasing, "
               "e.g. [1000, 757, 522]")
    if not isinstance(timesteps, (list, tuple)):
        return f"got {timesteps!r}; allowed: {allowed}"
    if not timesteps:
        return f"is empty; allowed: {allowed}"
    bad = [t for t in timesteps if isinstance(t, bool) or not isinstance(t, int)]
    if bad:
        return f"got {bad[0]!r} ({type(bad[0]).__name__}) in {list(timesteps)}; allowed: {allowed}"
    out = [t for t in timesteps if not 1 <= t <= num_train_timesteps]
    if out:
        return f"{out[0]} in {list(timesteps)} is out of range; allowed: {allowed}"
    for a, b in zip(timesteps, timesteps[1:]):
        if b >= a:
            return f"{list(timesteps)} is not strictly decreasing ({a} then {b}); allowed: {allowed}"
    return None


def combination_problems(*, sampler: str, timesteps: Sequence[int] | None, guidance: float
                         ) -> list[tuple[str, str]]:
    """(field, message) for every rule a sampler/timesteps/guidance combination breaks."""
    problems: list[tuple[str, str]] = []
    if sampler == DMD and guidance > 1:
        problems.append(("guidance", f"got {guidance:g} with sampler dmd; allowed: 1 (a step-distilled "
                                     "checkpoint runs without classifier-free guidance)"))
    if sampler != DMD and timesteps is not None:
        problems.append(("timesteps", f"set with sampler {sampler!r}; timesteps are for sampler dmd only "
                                      "(use steps with unipc or euler)"))
    return problems
