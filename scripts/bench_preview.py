#!/usr/bin/env python3
"""Benchmark live previews: what one costs the GPU lane, what the I/O lane spends making its picture,
and that a sampling's latents are the same bits with previews on or off.

A sampling at --size (default 704x1248x121: latent 48x31x44x78) runs three times through the
pipeline's own hooks, with the worker's own hand-over (`SamplingControl.keep_preview`) as its
``on_preview``:

1. previews off (``preview_every_s`` 0);
2. a preview due at every step boundary (``preview_every_s`` tiny): per preview, ``gpu_lane_s``,
   the whole `PreviewHook.at_boundary` call that took it (the x0 of 4 latent frames computed from
   the step's input latents and velocity, copied to the host, handed over), timed around the call
   on the sampling's thread; and the sampling's seconds against run 1's;
3. on the I/O lane's side, for the previews of run 2: ``io_lane_s`` per preview (the map, the
   resize, the WebP encode: `SamplingControl.fetch_preview`) and the file's bytes.

--pipeline fake (default): the runner's stand-in pipeline, on the CPU: its latents are full-size
tensors, its steps cost nothing, so what is timed is the preview alone. --pipeline tiny: the
embedded tiny model (its real DiT loop, `PAN2Pipeline._run_steps`) on --device; on a GPU host,
``--pipeline tiny --device cuda`` measures the copy and its sync on the GPU's path at full size (the
tiny DiT's steps are short, so the figures are the preview's own, not a share of a real step).

CPU:      python scripts/bench_preview.py --out /tmp/bench_preview.json          (~1 min on 2 cores)
GPU host: python scripts/bench_preview.py --pipeline tiny --device cuda --out $OUT/bench_preview.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pan2render.models import preview as preview_module
from pan2render.runner.worker.sampling_control import SamplingControl


def _pipeline(kind: str, device: str) -> Any:
    if kind == "fake":
        from pan2render.runner.worker.fake_pipeline import TEXT_DIM, FakePipeline

        return FakePipeline("bench"), torch.zeros(512, TEXT_DIM)
    from pan2render.models import PAN2Pipeline, PAN2PipelineConfig

    pipe = PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device=device))
    return pipe, torch.zeros(512, pipe.dit.config.text_dim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipeline", choices=("fake", "tiny"), default="fake")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="704x1248x121", help="HxWxF")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = ap.parse_args()
    height, width, frames = (int(v) for v in args.size.split("x"))
    pipe, embeds = _pipeline(args.pipeline, args.device)
    request = dict(prompt_embeds=embeds, negative_prompt_embeds=embeds, height=height, width=width, frames=frames,
                   steps=args.steps, guidance=1.0, seed=0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    # The GPU lane's cost per preview: every at_boundary call that handed one over, timed whole.
    took: list[float] = []
    real = preview_module.PreviewHook.at_boundary

    def timed(self: Any, **kw: Any) -> None:
        before = len(kept)
        t0 = time.perf_counter()
        real(self, **kw)
        if len(kept) > before:
            took.append(time.perf_counter() - t0)

    preview_module.PreviewHook.at_boundary = timed  # type: ignore[method-assign]
    control, kept = SamplingControl(), []
    rgb_map = pipe.preview_map

    def hand_over(latents: Any) -> None:  # what the worker's on_preview does, and a copy for the I/O side
        control.keep_preview("job", latents, rgb_map)
        kept.append(latents)

    runs: dict[str, Any] = {}
    for name, every in (("warm-up", 0.0), ("off", 0.0), ("every boundary", 1e-9)):
        sync()
        t0 = time.perf_counter()
        latents = pipe.sample(**request, preview_every_s=every, on_preview=hand_over if every else None)
        sync()
        runs[name] = {"seconds": time.perf_counter() - t0, "latents": latents}
    bit_equal = torch.equal(runs["off"]["latents"], runs["every boundary"]["latents"])

    # The I/O lane: each preview's picture made as FetchPreviewCall makes it.
    made, sizes = [], []
    for latents in kept:
        control.begin("job")
        control.keep_preview("job", latents, rgb_map)
        t0 = time.perf_counter()
        reply = control.fetch_preview("job", after_step=0, wait_s=0.0)
        made.append(time.perf_counter() - t0)
        sizes.append(len(reply.image))
        control.end("job")

    def ms(values: list[float]) -> dict[str, float]:
        return {"median_ms": 1e3 * statistics.median(values), "max_ms": 1e3 * max(values), "n": len(values)}

    figures = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": f"{platform.node()} {platform.processor() or ''}",
        "cpus": os.cpu_count(), "torch": torch.__version__, "pipeline": args.pipeline, "device": args.device,
        "size": args.size, "steps": args.steps, "latent_frames_shown": list(kept[0].frames),
        "x0_bytes": kept[0].x0.numel() * 4, "gpu_lane": ms(took), "io_lane": ms(made),
        "file_bytes": {"median": statistics.median(sizes), "max": max(sizes)},
        "sampling_s": {"off": runs["off"]["seconds"], "every boundary": runs["every boundary"]["seconds"]},
        "latents_bit_equal": bit_equal,
    }
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    if not bit_equal:
        raise SystemExit("the latents differ with previews on: a preview must only read the sampling")


if __name__ == "__main__":
    main()
