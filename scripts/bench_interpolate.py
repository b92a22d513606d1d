#!/usr/bin/env python3
"""Benchmark frame interpolation: seconds per output frame of `pan2render.models.ifnet.interpolate`
(RIFE v4.26.heavy) on a video at --size, in bf16 and fp32, against ccvfi's IFNet in the same run.

Rows (each timed --repeats times after --warmup runs, the median kept, the device synchronised
around each run):

- ``ours``: `interpolate` as the interpolate stage calls it (--batch in-betweens per pass, each
  frame encoded once);
- ``ours-channels_last`` (bf16): the same with the weights in channels-last, cuDNN's preferred
  layout for tensor-core convolutions: a variant to decide on, not a setting of the model;
- ``ccvfi-per-pair``: ccvfi's IFNet as its own wrapper runs it, one in-between per call, both
  frames encoded at each call (padded as Practical-RIFE pads, so the network sees what ours sees);
- ``ccvfi-batched``: ccvfi's IFNet given the same --batch pairs per call (its timestep one float:
  factor 2 only), which separates what batching buys from what the implementation does.

Figures: ``s_per_output_frame`` (all (T - 1) * factor + 1 frames, the originals included, as the
stage delivers them) and ``s_per_in_between``, the peak device memory of the run, ``ratio`` ours
over each ccvfi row (below 1: ours faster), the bf16 output's max difference from fp32 and ours
from ccvfi's at the same size (fp32; on a GPU both run TF32 convolutions, PyTorch's default).
Random weights unless --weights names a file (ccvfi rows for a v4.26.heavy file only: its network is
that one); speed does not depend on the weights' values.

GPU host: python scripts/bench_interpolate.py                      (704x1280, 25 frames, factor 2)
CPU:      python scripts/bench_interpolate.py --size 64x96 --device cpu --frames 5
Prints one JSON line; --out writes it to a file too.
"""

from __future__ import annotations

import argparse
import json
import platform
import runpy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's pan2render, not whichever one is installed

from pan2render.models.ifnet import IFNet, IFNetConfig, interpolate, load_ifnet

SCRIPTS = Path(__file__).resolve().parent
random_ifnet_state = runpy.run_path(str(SCRIPTS / "make_random_ifnet.py"))["random_ifnet_state"]
ccvfi_ifnet_class = runpy.run_path(str(SCRIPTS / "ccvfi_ifnet.py"))["ccvfi_ifnet_class"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def video(frames: int, height: int, width: int, device: str) -> torch.Tensor:
    """Smooth random frames [T, 3, H, W] in [0, 1], each the one before moved by (2, 3) pixels."""
    gen = torch.Generator().manual_seed(0)
    coarse = torch.rand(1, 3, height // 16 + 4, width // 16 + 4, generator=gen)
    big = F.interpolate(coarse, size=(height + 3 * frames, width + 2 * frames), mode="bicubic",
                        align_corners=False).clamp(0, 1)[0]
    return torch.stack([big[:, 3 * k:3 * k + height, 2 * k:2 * k + width] for k in range(frames)]).to(device)


def timed(run: Callable[[], Any], *, warmup: int, repeats: int, device: str) -> tuple[float, float, Any]:
    """(median seconds, peak GiB, last result) of ``run``."""
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result = None
    for _ in range(warmup):
        result = run()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        result = run()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return statistics.median(times), peak, result


def ccvfi_interpolate(model: torch.nn.Module, frames: torch.Tensor, factor: int, *, batch: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """ccvfi's network over a video: ``batch`` pairs per call (1: its wrapper's way), frames padded
    to 64 at the right and bottom, in ``dtype`` throughout (ccvfi casts the model and inputs)."""
    count, _, height, width = frames.shape
    pad = (0, -width % 64, 0, -height % 64)
    x = F.pad(frames, pad).to(dtype)
    out = torch.empty(((count - 1) * factor + 1, *frames.shape[1:]), dtype=frames.dtype, device=frames.device)
    out[::factor] = frames
    with torch.no_grad():
        for j in range(1, factor):
            for first in range(0, count - 1, batch):
                last = min(first + batch, count - 1)
                mids = model(torch.cat((x[first:last], x[first + 1:last + 1]), 1), j / factor, [16, 8, 4, 2, 1])
                out[first * factor + j:last * factor:factor] = mids[..., :height, :width].to(frames.dtype)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="704x1280", help="HxW of the frames (default the Wan2.2 TI2V 720p size)")
    ap.add_argument("--frames", type=int, default=25, help="input frames T")
    ap.add_argument("--factor", type=int, default=2, choices=(2, 4))
    ap.add_argument("--batch", type=int, default=8, help="in-betweens per pass")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weights", type=Path, help="an IFNet weights file (default: random v4.26.heavy weights)")
    ap.add_argument("--skip-ccvfi", action="store_true")
    ap.add_argument("--out", type=Path, help="write the JSON line here too")
    args = ap.parse_args(argv)
    height, width = (int(v) for v in args.size.lower().split("x"))
    if args.device.startswith("cuda"):
        torch.backends.cudnn.benchmark = True  # as Practical-RIFE's scripts set it, for both sides

    if args.weights is None:
        config, state = IFNetConfig(), random_ifnet_state(seed=0)
    else:
        loaded = load_ifnet(args.weights)
        config, state = loaded.config, loaded.state_dict()
    # ccvfi's network is v4.26.heavy's alone.
    reference_class = None if args.skip_ccvfi or config != IFNetConfig() else ccvfi_ifnet_class()
    frames = video(args.frames, height, width, args.device)
    n_out = (args.frames - 1) * args.factor + 1
    rows: list[dict[str, Any]] = []
    outputs: dict[tuple[str, str], torch.Tensor] = {}

    def row(impl: str, dtype_name: str, run: Callable[[], torch.Tensor]) -> None:
        try:
            seconds, peak, out = timed(run, warmup=args.warmup, repeats=args.repeats, device=args.device)
        except Exception as e:  # a variant this device cannot run is reported, the others still run
            rows.append({"impl": impl, "dtype": dtype_name, "error": f"{type(e).__name__}: {e}"[:300]})
            return
        outputs[impl, dtype_name] = out
        rows.append({"impl": impl, "dtype": dtype_name, "seconds": round(seconds, 5),
                     "s_per_output_frame": seconds / n_out, "s_per_in_between": seconds / (n_out - args.frames),
                     "peak_gib": round(peak, 3)})

    for name in args.dtypes:
        dtype = DTYPES[name]
        ours = IFNet(config).eval().requires_grad_(False)
        ours.load_state_dict(state)
        ours.to(device=args.device, dtype=dtype)
        row("ours", name, lambda m=ours: interpolate(m, frames, args.factor, batch=args.batch))
        if name == "bf16":
            ours.to(memory_format=torch.channels_last)
            row("ours-channels_last", name, lambda m=ours: interpolate(m, frames, args.factor, batch=args.batch))
        if reference_class is not None:
            reference = reference_class().eval().requires_grad_(False)
            reference.load_state_dict(state)
            reference.to(device=args.device, dtype=dtype)
            for impl, pairs in (("ccvfi-per-pair", 1), ("ccvfi-batched", args.batch)):
                row(impl, name, lambda m=reference, b=pairs, d=dtype: ccvfi_interpolate(m, frames, args.factor,
                                                                                        batch=b, dtype=d))
        ours = reference = None  # freed before the next dtype's models
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    per_frame = {(r["impl"], r["dtype"]): r["s_per_output_frame"] for r in rows if "error" not in r}
    ratios = {f"ours/{impl} {d}": round(per_frame["ours", d] / per_frame[impl, d], 3)
              for impl in ("ccvfi-per-pair", "ccvfi-batched") for d in args.dtypes
              if (impl, d) in per_frame and ("ours", d) in per_frame}
    diffs = {}
    if ("ours", "bf16") in outputs and ("ours", "fp32") in outputs:
        diffs["ours bf16 vs fp32, max abs"] = float((outputs["ours", "bf16"] - outputs["ours", "fp32"]).abs().max())
    if ("ours", "fp32") in outputs and ("ccvfi-per-pair", "fp32") in outputs:
        diffs["ours vs ccvfi fp32, max abs"] = float(
            (outputs["ours", "fp32"] - outputs["ccvfi-per-pair", "fp32"]).abs().max())
    figures = {
        "bench": "interpolate", "size": [height, width], "frames_in": args.frames, "frames_out": n_out,
        "factor": args.factor, "batch": args.batch, "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__, "weights": str(args.weights) if args.weights else "random v4.26.heavy",
        "ccvfi": reference_class is not None, "rows": rows, "ratios": ratios, "diffs": diffs,
    }
    line = json.dumps(figures)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
