#!/usr/bin/env python3
"""Why does the DiT's self-attention run slower inside the forward than alone?

docs/performance.md: cuDNN SDPA at the DiT's self-attention shape ([1, 24, 26598, 128]) does
~640 TFLOP/s in a short burst, but the 30 calls inside a forward average ~550 TFLOP/s. This probe
separates the candidate causes on one GPU, in one run:

1. burst: 10 calls after a warm-up (what the micro-benchmark measured);
2. sustained: the same call back to back for ``--seconds`` (clocks and power under long load);
3. in a forward-like mix: each attention call preceded by the block's GEMMs at the same shape
   (QKV/O projections and the FFN), so the attention starts on a GPU that was just busy with
   matrix work, as in the model;

while ``nvidia-smi`` samples the SM clock, power and temperature every 50 ms. Prints TFLOP/s per
phase and the clock/power range seen in each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F


def sampler(stop: threading.Event, samples: list[tuple[float, str]]) -> None:
    cmd = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
           "-i", str(torch.cuda.current_device()), "-lms", "50"]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    except OSError as e:
        print(f"nvidia-smi unavailable: {e}", flush=True)
        return
    assert proc.stdout is not None
    while not stop.is_set():
        line = proc.stdout.readline()
        if not line:
            break
        samples.append((time.perf_counter(), line.strip()))
    proc.terminate()


def window(samples: list[tuple[float, str]], t0: float, t1: float) -> str:
    rows = []
    for t, line in samples:
        if t0 <= t <= t1:
            try:
                rows.append([float(v) for v in line.split(",")])
            except ValueError:
                continue
    if not rows:
        return "no samples"
    clk = [r[0] for r in rows]
    pwr = [r[1] for r in rows]
    tmp = [r[2] for r in rows]
    return (f"SM clock {min(clk):.0f}-{max(clk):.0f} MHz (mean {sum(clk) / len(clk):.0f}), power "
            f"{min(pwr):.0f}-{max(pwr):.0f} W, temp {min(tmp):.0f}-{max(tmp):.0f} C, {len(rows)} samples")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=26598)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--json", type=str, default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_attention_clocks: needs a CUDA GPU; skipping")
        return 0
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt = torch.device("cuda"), torch.bfloat16
    L, H, D = args.tokens, args.heads, args.head_dim
    dim = H * D
    q, k, v = (torch.randn(1, L, H, D, device=dev, dtype=dt).transpose(1, 2) for _ in range(3))
    x = torch.randn(L, dim, device=dev, dtype=dt)
    w_qkv = torch.randn(3 * dim, dim, device=dev, dtype=dt) * dim**-0.5
    w_o = torch.randn(dim, dim, device=dev, dtype=dt) * dim**-0.5
    w_up = torch.randn(args.ffn, dim, device=dev, dtype=dt) * dim**-0.5
    w_down = torch.randn(dim, args.ffn, device=dev, dtype=dt) * args.ffn**-0.5
    attn_flop = 4 * L * L * H * D
    gemm_flop = 2 * L * dim * (3 * dim + dim + 2 * args.ffn)

    def attend() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)

    def gemms() -> None:
        F.linear(x, w_qkv)
        F.linear(x, w_o)
        h = F.linear(x, w_up)
        F.linear(h, w_down)

    stop = threading.Event()
    samples: list[tuple[float, str]] = []
    th = threading.Thread(target=sampler, args=(stop, samples), daemon=True)
    th.start()
    for _ in range(3):
        attend()
        gemms()
    torch.cuda.synchronize()
    time.sleep(2.0)  # idle: let clocks and power settle back
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                  "cudnn": torch.backends.cudnn.version()}

    def timed_calls(fn, n: int) -> list[float]:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        ev[0].record()
        for i in range(n):
            fn()
            ev[i + 1].record()
        torch.cuda.synchronize()
        return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]

    t0 = time.perf_counter()
    burst = timed_calls(attend, 10)
    t1 = time.perf_counter()
    results["burst_attention_tflops"] = attn_flop / (sum(burst) / len(burst) * 1e-3) / 1e12
    results["burst_clocks"] = window(samples, t0, t1)
    time.sleep(2.0)

    n = max(10, int(args.seconds / (sum(burst) / len(burst) * 1e-3)))
    t0 = time.perf_counter()
    sustained = timed_calls(attend, n)
    t1 = time.perf_counter()
    tail = sustained[-max(5, n // 5):]
    results["sustained_calls"] = n
    results["sustained_first10_tflops"] = attn_flop / (sum(sustained[:10]) / 10 * 1e-3) / 1e12
    results["sustained_last_fifth_tflops"] = attn_flop / (sum(tail) / len(tail) * 1e-3) / 1e12
    results["sustained_clocks"] = window(samples, t0, t1)
    time.sleep(2.0)

    # forward-like: GEMMs then attention, attention timed alone by events around it
    reps = max(5, int(args.seconds / (sum(burst) / len(burst) * 1e-3 * 2.2)))
    a_ms, g_ms = [], []
    t0 = time.perf_counter()
    for _ in range(reps):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        gemms()
        e[1].record()
        attend()
        e[2].record()
        torch.cuda.synchronize()
        g_ms.append(e[0].elapsed_time(e[1]))
        a_ms.append(e[1].elapsed_time(e[2]))
    t1 = time.perf_counter()
    tail_a = a_ms[-max(3, reps // 5):]
    tail_g = g_ms[-max(3, reps // 5):]
    results["mixed_reps"] = reps
    results["mixed_attention_tflops_last_fifth"] = attn_flop / (sum(tail_a) / len(tail_a) * 1e-3) / 1e12
    results["mixed_gemm_tflops_last_fifth"] = gemm_flop / (sum(tail_g) / len(tail_g) * 1e-3) / 1e12
    results["mixed_clocks"] = window(samples, t0, t1)
    stop.set()
    for key, val in results.items():
        print(f"{key}: {val:.1f}" if isinstance(val, float) else f"{key}: {val}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
