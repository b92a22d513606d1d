"""How classifier-free guidance runs its two DiT passes (conditional, unconditional).

Either one batch-2 forward (text K/V of both prompts stacked: ``prepare_context(cat([cond, uncond]))``)
or two batch-1 forwards (one ``ContextCache`` each). The text K/V are computed once per job in both
modes (``PAN2DiT.prepare_context``), never per step.

Why it is a measured choice: cuDNN SDPA was reported slower per token at batch 2 (566 vs 640
TFLOP/s, issue 5). In the whole DiT forward on one H200 (scripts/bench_dit.py, docs/performance.md) a
guided step took 1.720 s batched and 1.724 s as two batch-1 passes (fused kernels, cuDNN): equal
within noise, while batching doubles the activation peak (4.1 vs 2.0 GiB). So the default is two
batch-1 forwards; re-measure on other GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GuidanceConfig:
    batch_branches: bool = False
    """True: one batch-2 forward per step; False: two batch-1 forwards (see docs/performance.md)."""

    def __post_init__(self) -> None:
        if not isinstance(self.batch_branches, bool):
            raise ValueError(f"batch_branches={self.batch_branches!r}: expected true or false")


# The measured choice on one H200 (scripts/bench_dit.py; figures in docs/performance.md).
DEFAULT_GUIDANCE = GuidanceConfig(batch_branches=False)
