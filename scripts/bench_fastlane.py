#!/usr/bin/env python3
"""Benchmark the fast lanes (MagCache, guidance gating, FP8) on the full-size random-weight DiT.

One process, one GPU, the Wan2.2-TI2V-5B DiT built in bf16 from random weights at 704x1248x121
(26,598 tokens, 512 text tokens), sampled through PAN2Pipeline (the VAE is not built: decoding is
not part of these figures). In order, each section saved to --out as soon as it is done:

1. forward, batch 1: bf16 and fp8 (min of --reps), fp8's relative L2 against bf16 on the same
   inputs, and a reused step (patch embedding + kept residual + head, MagCache's skip) against a
   computed one;
2. --steps guided sampling (guidance 2.5) on the exact path and with `pan2-720p-fast`'s lanes
   (MagCache 0.06 / K=2 / retention 0.2 on MagCache's published Wan2.2-TI2V-5B ratios, gating
   at 0.5, fp8): both wall times, their ratio, the fast plan's schedule (which steps computed);
3. each run's sampling seconds against its computed forwards x its forward time (+ reused
   steps x the reused step's time): the gap says how far a fast lane's speed follows from the
   schedule it records.

The skip schedule depends only on the calibration and the step count, never on the random
weights, so the fast run's forwards are the ones a real checkpoint would run.

Usage (GPU host, ~4-5 min on one H200):  python scripts/bench_fastlane.py --out bench_fastlane.json
Fewer steps (the ratios are what matter; say so): --steps 20 (the published ratios are then
nearest-interpolated, as MagCache does, and the plan records it).
CPU smoke test of the script itself: python scripts/bench_fastlane.py --tiny --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dit import TINY, log, rel_l2, sample_only_vae, sync, timed
from bench_parallel import build_dit

from pan2render.jobs.presets import list_presets
from pan2render.lanes import FAST_LANE_FIELDS
from pan2render.models.dit import PAN2DiTConfig
from pan2render.models.pipeline import PAN2Pipeline, PAN2PipelineConfig
from pan2render.models.samplers import SchedulerConfig
from pan2render.models.step_cache import KeepResidual, ResidualSlot, ReuseResidual

PRESET = "pan2-720p-fast"


def build_pipeline(config: PAN2DiTConfig, device: torch.device, dtype: torch.dtype, *, tiny: bool) -> PAN2Pipeline:
    dit = build_dit(config, device, dtype)
    pipe = PAN2Pipeline(dit=dit, vae=sample_only_vae(config), text_encoder=None, scheduler_config=SchedulerConfig(),
                        config=PAN2PipelineConfig(device=str(device), dtype=dtype), model_id="bench-random")
    if tiny and device.type == "cpu":
        pipe.precision.emulate = True  # the script's CPU smoke test: FP8 through its fp32 reference
    return pipe


def forwards(pipe: PAN2Pipeline, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Section 1: one forward in bf16 and fp8, fp8's error, and a reused step's cost."""
    dit, dtype = pipe.dit, pipe.config.dtype
    gen = torch.Generator(device="cpu").manual_seed(1)
    lat = (args.frames - 1) // 4 + 1
    x = torch.randn(1, dit.config.in_channels, lat, args.height // 16, args.width // 16, generator=gen)
    x = x.to(device, dtype)
    t = torch.tensor([700.0], device=device)
    ctx = dit.prepare_context(torch.randn(1, 512, dit.config.text_dim, generator=gen).to(device, dtype))
    grid = dit.token_grid(x.shape)
    out: dict[str, Any] = {"tokens": grid[0] * grid[1] * grid[2]}
    with torch.no_grad():
        bf16_s, bf16_peak, bf16 = timed(lambda: dit(x, t, ctx), device=device, reps=args.reps, warmup=1)
        with pipe.precision.applied("fp8"):
            fp8_s, fp8_peak, fp8 = timed(lambda: dit(x, t, ctx), device=device, reps=args.reps, warmup=1)
        slot = ResidualSlot()
        dit(x, t, ctx, blocks=KeepResidual(slot))
        reuse_s, _, _ = timed(lambda: dit(x, t, ctx, blocks=ReuseResidual(slot)), device=device, reps=args.reps,
                              warmup=1)
    out.update(forward_bf16_s=round(bf16_s, 4), forward_fp8_s=round(fp8_s, 4), fp8_speedup=round(bf16_s / fp8_s, 3),
               fp8_rel_l2_vs_bf16=round(rel_l2(fp8, bf16), 5), activation_peak_gib={"bf16": round(bf16_peak, 2),
                                                                                  "fp8": round(fp8_peak, 2)},
               reused_step_s=round(reuse_s, 4), reused_over_computed=round(reuse_s / bf16_s, 4))
    log(f"forward bf16 {bf16_s:.3f} s, fp8 {fp8_s:.3f} s (x{bf16_s / fp8_s:.2f}), fp8 rel. L2 vs bf16 "
        f"{rel_l2(fp8, bf16):.3e}; a reused step {reuse_s * 1e3:.1f} ms ({reuse_s / bf16_s:.1%} of a forward)")
    return out


def sampling(pipe: PAN2Pipeline, args: argparse.Namespace, device: torch.device, lanes: dict[str, Any],
             fwd: dict[str, Any]) -> dict[str, Any]:
    """Sections 2-3 for one set of lanes: wall time, plan, and the time its schedule predicts."""
    gen = torch.Generator().manual_seed(2)
    cond, uncond = (torch.randn(512, pipe.dit.config.text_dim, generator=gen) for _ in range(2))
    job = dict(prompt_embeds=cond, negative_prompt_embeds=uncond, height=args.height, width=args.width,
               frames=args.frames, steps=args.steps, guidance=args.guidance, seed=0)
    plan = pipe.sampling_plan(steps=args.steps, guidance=args.guidance, **lanes)
    sync(device)
    t0 = time.perf_counter()
    pipe.sample(**job, **lanes)
    sync(device)
    seconds = time.perf_counter() - t0
    forward = fwd["forward_fp8_s"] if lanes.get("precision") == "fp8" else fwd["forward_bf16_s"]
    reused = sum(a.value == "reuse" for step in plan.steps for a in step.values())
    predicted = plan.forwards * forward + reused * fwd["reused_step_s"]
    return {"lanes": lanes, "seconds": round(seconds, 2), "forwards": plan.forwards, "reused": reused,
            "predicted_s": round(predicted, 2), "measured_over_predicted": round(seconds / predicted, 4),
            "plan": plan.describe()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON file the figures are written to")
    p.add_argument("--height", type=int, default=704)
    p.add_argument("--width", type=int, default=1248)
    p.add_argument("--frames", type=int, default=121)
    p.add_argument("--steps", type=int, default=50, help="sampling steps of both runs (default 50)")
    p.add_argument("--guidance", type=float, default=2.5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks the script, not speed")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = PAN2DiTConfig(**TINY) if args.tiny else PAN2DiTConfig()
    if args.tiny:
        args.height, args.width, args.frames, args.steps, args.reps = 64, 96, 9, min(args.steps, 8), 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                               "torch": torch.__version__, "shape": [args.frames, args.height, args.width],
                               "steps": args.steps, "guidance": args.guidance}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    pipe = build_pipeline(config, device, dtype, tiny=args.tiny)
    pipe.warm_up_attention()
    results["forward"] = fwd = forwards(pipe, args, device)
    save()
    fast = {k: v for k, v in list_presets()[PRESET].items() if k in FAST_LANE_FIELDS}
    if args.tiny:  # the tiny DiT is not the architecture the published ratios are for
        from pan2render.lanes import Calibration
        from pan2render.models.calibration import store_calibration

        store_calibration(pipe.model_id, Calibration(cond=(1.0,) + (0.995,) * (args.steps - 1),
                                                     uncond=(1.0,) + (0.995,) * (args.steps - 1), source="flat"),
                          conditioned=False)
    for name, lanes in (("exact", {}), (PRESET, fast)):
        log(f"sampling {args.steps} guided steps: {name} {lanes}")
        results[name] = sampling(pipe, args, device, lanes, fwd)
        log(f"  {results[name]['seconds']} s, {results[name]['forwards']} forwards, measured / predicted "
            f"{results[name]['measured_over_predicted']}")
        save()
    results["fast_over_exact"] = round(results[PRESET]["seconds"] / results["exact"]["seconds"], 4)
    log(f"{PRESET}: {results['fast_over_exact']:.3f}x the exact path's sampling seconds")
    save()
    print(json.dumps({k: results[k] for k in ("forward", "fast_over_exact")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
