"""The Triton kernel behind `pan2render.kernels.fp8.quantize_rows` (imported on first use)."""

from __future__ import annotations

import triton
import triton.language as tl

# A constexpr: a compiled kernel may read no other global (the CPU interpreter would allow it).
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _gelu_tanh(v):
    # 0.5 v (1 + tanh(u)) = v sigmoid(2u), u = sqrt(2/pi) (v + 0.044715 v^3): no tanh needed.
    u = _SQRT_2_OVER_PI * (v + 0.044715 * v * v * v)
    return v * tl.sigmoid(2.0 * u)


@triton.jit
def quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, cols, stride_x, stride_out, fp8_max, min_amax,
                         GELU: tl.constexpr, STORE_SCALED: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: pass 1 finds the row's amax (of GELU(x) when GELU), pass 2 stores
    ``clamp(v / s, +-fp8_max)`` as e4m3 (fp32 when STORE_SCALED) and s = amax / fp8_max."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    out_row = out_ptr + row.to(tl.int64) * stride_out
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32)
        if GELU:
            v = _gelu_tanh(v)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0), min_amax) / fp8_max
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            v = _gelu_tanh(v)
        q = tl.minimum(tl.maximum(v / scale, -fp8_max), fp8_max)
        if STORE_SCALED:
            tl.store(out_row + offs, q, mask=mask)
        else:
            tl.store(out_row + offs, q.to(tl.float8e4nv), mask=mask)
