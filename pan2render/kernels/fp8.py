"""FP8 (e4m3) matmuls for the DiT's per-token linears: per-row scales, ``torch._scaled_mm``.

``precision: fp8`` runs every `TokenLinear` of the DiT (``pan2render.models.dit``) as

    y = (q(x) @ q(W).T) * s_x s_W^T + b,    q(v) = round_e4m3(v / s),   s = amax(row) / 448,

one scale per activation row (token) and one per weight row (output channel), the products
accumulated by the tensor cores (``torch._scaled_mm`` with row-wise scales, fast accumulation) and
returned in the activation's dtype. Hopper runs it at ~1.1-1.2 PFLOP/s at the DiT's shapes against
~0.72 in bf16 (docs/performance.md). It needs CUDA compute capability 8.9 or newer: `fp8_problem`
says why a device cannot, and the pipeline refuses the job rather than fall back.

Accuracy. e4m3 keeps 3 mantissa bits: a value in the normal range (``|v| / s >= 2^-6``) is rounded
to within ``2^-4`` of itself, relative; below it the rounding step is ``2^-9 s`` (absolute). So per
element ``|q(v) s - v| <= 2^-4 |v| + 2^-10 s``, the bound `tests/kernels/test_fp8.py` checks, and a
GEMM of Gaussian operands lands at a relative L2 error of ~3.5% (both operands' ~2.5% combined);
the whole DiT forward's relative L2 against bf16 is measured by ``scripts/bench_fastlane.py``.

`quantize_rows` is the one quantiser: a Triton kernel on CUDA (one pass per row for the amax, one
for the scaled cast, with the tanh-GELU of the feed-forward applied on the way in when asked) and
`quantize_rows_reference` elsewhere, which the kernel is tested against. `fp8_matmul_reference` is
what the GPU computes, in fp32 on any device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

__all__ = ["E4M3_MAX", "Fp8Linear", "fp8_matmul_reference", "fp8_problem", "quantize_rows",
           "quantize_rows_reference", "dequantize_rows"]

FP8 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(FP8).max)  # 448
# An all-zero row gets this amax, so its scale is positive and its values quantise to 0.
MIN_AMAX = 1e-12
# What _scaled_mm's row-wise scaling needs (sm_89 Ada, sm_90 Hopper and newer).
MIN_CAPABILITY = (8, 9)
_BLOCK = 1024  # elements of a row per Triton loop iteration


def fp8_problem(device: torch.device | str) -> str | None:
    """Why FP8 matmuls cannot run on ``device`` (None: they can)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return (f"precision fp8 needs a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
                f"newer (Ada, Hopper); this pipeline runs on {device.type}: use precision bf16")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"precision fp8 needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ for row-scaled "
                f"FP8 matmuls; {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: use "
                "precision bf16")
    if not hasattr(torch, "_scaled_mm"):
        return f"precision fp8 needs torch._scaled_mm, which torch {torch.__version__} lacks: use precision bf16"
    return None


# ---- the quantiser ------------------------------------------------------------------------------


def quantize_rows_reference(x: Tensor, *, gelu: bool = False) -> tuple[Tensor, Tensor]:
    """``x`` ``[M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M]``), one scale per row, in fp32 math;
    ``gelu``: quantise tanh-GELU(x) instead (the feed-forward's activation)."""
    v = x.float()
    if gelu:
        v = F.gelu(v, approximate="tanh")
    scale = v.abs().amax(dim=-1).clamp_min(MIN_AMAX) / E4M3_MAX  # [M]
    return (v / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def dequantize_rows(q: Tensor, scale: Tensor) -> Tensor:
    """e4m3 ``[M, K]`` and its row scales ``[M]`` -> fp32 ``[M, K]``."""
    return q.float() * scale[:, None]


def quantize_rows(x: Tensor, *, gelu: bool = False) -> tuple[Tensor, Tensor]:
    """`quantize_rows_reference`'s result, by the Triton kernel on CUDA (one read of the row for
    its amax, one for the cast: no fp32 copy of the activation)."""
    if not x.is_cuda:
        return quantize_rows_reference(x, gelu=gelu)
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _launch(x, q, scale, gelu=gelu, store_scaled=False)
    return q, scale


def _launch(x: Tensor, out: Tensor, scale: Tensor, *, gelu: bool, store_scaled: bool) -> None:
    from pan2render.kernels.fp8_triton import quantize_rows_kernel  # triton on first use

    rows, cols = x.shape
    quantize_rows_kernel[(rows,)](x, out, scale, cols, x.stride(0), out.stride(0), E4M3_MAX, MIN_AMAX,
                                  GELU=gelu, STORE_SCALED=store_scaled, BLOCK=_BLOCK)


def scaled_rows_by_kernel(x: Tensor, *, gelu: bool = False) -> tuple[Tensor, Tensor]:
    """Tests only (the CPU's Triton interpreter rounds e4m3 wrongly near powers of two): the
    kernel's values ``v / s`` before the e4m3 cast, fp32 ``[M, K]``, and its scales ``[M]``."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _launch(x, out, scale, gelu=gelu, store_scaled=True)
    return out, scale


# ---- the matmul ---------------------------------------------------------------------------------


def fp8_matmul_reference(xq: Tensor, x_scale: Tensor, wq: Tensor, w_scale: Tensor, bias: Tensor | None,
                         *, out_dtype: torch.dtype) -> Tensor:
    """What ``torch._scaled_mm`` computes: dequantised operands, fp32 products and sums, the bias
    added, rounded to ``out_dtype``. xq ``[M, K]``, wq ``[N, K]`` -> ``[M, N]``."""
    y = dequantize_rows(xq, x_scale) @ dequantize_rows(wq, w_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@dataclass
class SharedInput:
    """The last activation quantised, so q, k and v (one input, three linears) quantise it once."""

    x: Tensor | None = None
    version: int = -1
    quantized: tuple[Tensor, Tensor] | None = None

    def get(self, x: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The quantised ``rows`` (``x`` as ``[M, K]``), reused while ``x`` is the same, unchanged tensor."""
        if self.quantized is None or self.x is not x or self.version != x._version:
            self.quantized = quantize_rows(rows)
            self.x, self.version = x, x._version
        return self.quantized


class Fp8Linear:
    """A `LinearOp` (``pan2render.models.dit``): one ``nn.Linear``'s weight quantised once per row,
    its input quantised per row at every call. ``emulate``: compute `fp8_matmul_reference` instead
    of ``torch._scaled_mm`` (any device: tests)."""

    def __init__(self, linear: nn.Linear, *, shared: SharedInput | None = None, emulate: bool = False) -> None:
        weight = linear.weight.detach()
        self.weight, self.weight_scale = quantize_rows(weight)  # [N, K] e4m3, [N] fp32
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.shared = shared if shared is not None else SharedInput()
        self.emulate = emulate

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.weight_scale.numel()

    def __call__(self, x: Tensor, *, features: slice | None = None, gelu_input: bool = False) -> Tensor:
        """``x`` ``[..., K]`` -> ``[..., N]`` (or the ``features`` rows of N) in x's dtype;
        ``gelu_input``: multiply tanh-GELU(x) instead (fused into the input's quantisation)."""
        rows = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_rows(rows, gelu=True) if gelu_input else self.shared.get(x, rows)
        pick = slice(None) if features is None else features
        wq, ws = self.weight[pick], self.weight_scale[pick]
        bias = None if self.bias is None else self.bias[pick]
        if self.emulate:
            out = fp8_matmul_reference(xq, xs, wq, ws, bias, out_dtype=x.dtype)
        else:
            out = _scaled_mm(xq, xs, wq, ws, bias, out_dtype=x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])


_BIAS_IN_SCALED_MM: bool | None = None  # whether this torch's _scaled_mm takes a bias with row-wise scales


def _scaled_mm(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, bias: Tensor | None, *,
               out_dtype: torch.dtype) -> Tensor:
    """``torch._scaled_mm`` with row-wise scales (``[M, 1]`` and ``[1, N]``), fast accumulation;
    the bias in its epilogue where this torch supports that, else added after."""
    global _BIAS_IN_SCALED_MM
    b = wq.t()  # [K, N], column-major as _scaled_mm requires
    sa, sb = xs[:, None], ws[None, :].contiguous()
    if bias is not None and _BIAS_IN_SCALED_MM is not False:
        try:
            out = torch._scaled_mm(xq, b, scale_a=sa, scale_b=sb, bias=bias.to(out_dtype), out_dtype=out_dtype,
                                   use_fast_accum=True)
            _BIAS_IN_SCALED_MM = True
            return out
        except RuntimeError as e:
            if _BIAS_IN_SCALED_MM:
                raise
            _BIAS_IN_SCALED_MM = False
            log.info("precision fp8: torch._scaled_mm takes no bias with row-wise scales here (%s); "
                     "the bias is added after each matmul", e)
    out = torch._scaled_mm(xq, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=True)
    return out if bias is None else out.add_(bias.to(out_dtype))
