"""``precision``: the DiT's per-token linears in bf16 (as loaded) or FP8, per job.

`DiTPrecision` holds a pipeline's switch. ``applied(precision)`` gives every `TokenLinear` of the
DiT an `Fp8Linear` op (``pan2render.kernels.fp8``) for the length of a job and takes it away after,
whatever happens, so one loaded model serves bf16 and fp8 jobs alike, and every wrapper of the
plain model (Ulysses, the guidance split) runs the same linears. The FP8 weights are quantised on
the first fp8 job and kept (one byte per weight plus a scale per output channel: ~4.5 GB beside
the bf16 weights for Wan2.2-TI2V-5B).

Where FP8 cannot run (no CUDA, a GPU before compute capability 8.9) a job asking for it is
refused with `PrecisionUnavailable`, before any step: never a silent bf16 render in its place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..kernels.fp8 import Fp8Linear, SharedInput, fp8_problem
from ..lanes import BF16, FP8, PRECISIONS
from .dit import PAN2DiT

__all__ = ["DiTPrecision", "PrecisionUnavailable"]


class PrecisionUnavailable(ValueError):
    """A job's ``precision`` cannot run on this pipeline's device (deterministic: never retried)."""


class DiTPrecision:
    """The precision switch of one pipeline's DiT (see the module doc). ``emulate``: FP8 through
    its fp32 reference on any device (tests)."""

    def __init__(self, dit: PAN2DiT, device: torch.device, *, emulate: bool = False) -> None:
        self.dit = dit
        self.device = torch.device(device)
        self.emulate = emulate
        self._fp8: list[tuple[object, Fp8Linear]] | None = None

    def problem(self, precision: str) -> str | None:
        """Why ``precision`` cannot run here (None: it can)."""
        if precision not in PRECISIONS:
            return f"precision {precision!r} is not one of {', '.join(PRECISIONS)}"
        if precision == FP8 and not self.emulate:
            return fp8_problem(self.device)
        return None

    def check(self, precision: str) -> None:
        problem = self.problem(precision)
        if problem is not None:
            raise PrecisionUnavailable(problem)

    @contextlib.contextmanager
    def applied(self, precision: str) -> Iterator[None]:
        """The DiT's per-token linears run in ``precision`` inside; bf16 (the loaded weights) after."""
        self.check(precision)
        if precision == BF16:
            yield
            return
        ops = self._fp8_ops()
        try:
            for linear, op in ops:
                linear.op = op  # type: ignore[attr-defined]
            yield
        finally:
            for linear, _ in ops:
                linear.op = None  # type: ignore[attr-defined]

    def _fp8_ops(self) -> list[tuple[object, Fp8Linear]]:
        if self._fp8 is None:
            shared = SharedInput()  # one per DiT: consecutive linears of one input quantise it once
            with torch.no_grad():
                self._fp8 = [(linear, Fp8Linear(linear, shared=shared, emulate=self.emulate))
                             for _, linear in self.dit.token_linears()]
        return self._fp8
