#!/usr/bin/env python3
"""Benchmark LoRA switching and the merged DiT's forward at full size (one CUDA GPU).

A PAN2 DiT of the Wan2.2-TI2V-5B config with random weights in bf16 (the fp32 modules as the loader
keeps them), routed as PAN2Pipeline runs it (fused kernels, fp32 residual stream, the attention
backend pan2render.kernels.attention picks). Random LoRAs over every attention and feed-forward
linear of the 30 blocks (musubi-tuner's layout, bf16 factors, alpha = rank / 2), written to
safetensors files and read back through `pan2render.models.lora.read_lora`. Measured, per --ranks:

1. reading the file (safetensors -> checked `LoraWeights` on the host) and moving it to the GPU;
2. the first merge (it also copies the touched weights for the restore);
3. switching between adapter sets, each switch an exact restore + merge (`MergedLoras.set`):
   another scale of the same adapter, another adapter of the same rank, two stacked; with the
   restore copies on the GPU (the default) and on the host (--backup cpu as well);
4. clearing (restore only), checked bit-equal to the weights before any merge;
5. a DiT forward at 704x1248x121 (26,598 tokens, batch 1) without and with the merged adapter,
   alternated, min of --reps each, and their ratio.

Writes everything to --out (JSON) as it goes. Results of record: docs/performance.md, "LoRA".
Usage (GPU host):  python scripts/bench_lora.py --out lora.json
CPU smoke test of the script itself:  python scripts/bench_lora.py --tiny --out /tmp/lora.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_parallel import build_dit

from pan2render.kernels.attention import describe_attention, warm_up_attention
from pan2render.models.dit import PAN2DiT, PAN2DiTConfig
from pan2render.models.lora import LoraWeights, MergedLoras, linear_shapes, read_lora
from pan2render.models.tiny import cache_root

TINY = PAN2DiTConfig(num_attention_heads=3, attention_head_dim=20, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)
# Musubi-tuner's names for the block linears it trains (the original Wan names, dots flattened).
MUSUBI = {"attn1.to_q": "self_attn_q", "attn1.to_k": "self_attn_k", "attn1.to_v": "self_attn_v",
          "attn1.to_out.0": "self_attn_o", "attn2.to_q": "cross_attn_q", "attn2.to_k": "cross_attn_k",
          "attn2.to_v": "cross_attn_v", "attn2.to_out.0": "cross_attn_o", "ffn.net.0.proj": "ffn_0",
          "ffn.net.2": "ffn_2"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def write_lora(path: Path, shapes: dict[str, tuple[int, int]], *, num_layers: int, rank: int, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_layers):
        for ours, theirs in MUSUBI.items():
            out, inp = shapes[f"blocks.{i}.{ours}"]
            key = f"lora_unet_blocks_{i}_{theirs}"
            tensors[f"{key}.lora_down.weight"] = (torch.randn(rank, inp, generator=g) / inp ** 0.5).bfloat16()
            tensors[f"{key}.lora_up.weight"] = (torch.randn(out, rank, generator=g) * 0.02).bfloat16()
            tensors[f"{key}.alpha"] = torch.tensor(rank / 2)
    save_file(tensors, str(path))
    return path


def switching(model: PAN2DiT, a: LoraWeights, b: LoraWeights, *, device: torch.device, reps: int,
              backup: str | None) -> dict[str, float]:
    """Seconds of the first merge, of each kind of switch (min of reps) and of a clear; whether the
    clear gave back the weights bit for bit."""
    probe = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("blocks.0.")}
    merged = MergedLoras(model, backup_device=backup)
    out: dict[str, float] = {"first_merge_s": seconds(lambda: merged.set([(a, 1.0)]), device)}
    out["restore_copies_gib"] = round(merged.restore_bytes / 2**30, 3)
    kinds = {"another_scale": ([(a, 0.5)], [(a, 1.0)]), "another_adapter": ([(b, 1.0)], [(a, 1.0)]),
             "two_stacked": ([(a, 0.7), (b, 0.4)], [(a, 1.0)])}
    for kind, (there, back) in kinds.items():
        times = []
        for _ in range(reps):
            times.append(seconds(lambda: merged.set(there), device))
            merged.set(back)
        out[f"switch_{kind}_s"] = min(times)
    out["clear_s"] = seconds(merged.clear, device)
    out["clear_bit_exact"] = all(torch.equal(p, probe[n]) for n, p in model.named_parameters() if n in probe)
    return out


def forward_cost(model: PAN2DiT, adapter: LoraWeights, *, grid: tuple[int, int, int], device: torch.device,
                 dtype: torch.dtype, reps: int) -> dict[str, float]:
    """A batch-1 forward without and with the adapter merged, alternated (min of reps each)."""
    frames, h, w = grid
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, model.config.in_channels, frames, h, w, generator=g).to(device, dtype)
    context = model.prepare_context(torch.randn(1, 512, model.config.text_dim, generator=g).to(device, dtype))
    t = torch.tensor([500.0], device=device)
    merged = MergedLoras(model)
    with torch.no_grad():
        model(x, t, context)  # first-call costs (compiles, autotuning)
        best = {"plain": math.inf, "merged": math.inf}
        for _ in range(reps):
            for label, adapters in (("plain", []), ("merged", [(adapter, 1.0)])):
                merged.set(adapters)
                best[label] = min(best[label], seconds(lambda: model(x, t, context), device))
    merged.clear()
    return {"forward_plain_s": best["plain"], "forward_merged_s": best["merged"],
            "forward_ratio": best["merged"] / best["plain"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    p.add_argument("--ranks", default="32,64", help="comma-separated LoRA ranks")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--backup", default="device,cpu", help="where the restore copies live: device, cpu or both")
    p.add_argument("--height", type=int, default=704)
    p.add_argument("--width", type=int, default=1248)
    p.add_argument("--frames", type=int, default=121)
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU: checks the script, not speed")
    args = p.parse_args()
    if args.tiny:
        device, dtype, config = torch.device("cpu"), torch.float32, TINY
        args.height, args.width, args.frames, args.reps = 64, 64, 5, 1
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --tiny for a CPU smoke test)")
    else:
        device, dtype, config = torch.device("cuda"), torch.bfloat16, PAN2DiTConfig()
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                               "torch": torch.__version__, "size": f"{args.width}x{args.height}x{args.frames}"}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    log(f"building the DiT ({config.num_layers} blocks, width {config.inner_dim}) on {device} in {dtype}")
    model = build_dit(config, device, dtype)
    if device.type == "cuda":
        warm_up_attention(device, dtype, heads=config.num_attention_heads, head_dim=config.attention_head_dim,
                          compile_cache=cache_root() / "flash-attn-4")
        results["attention"] = describe_attention(device, dtype, config.attention_head_dim)
    shapes = linear_shapes(model)
    grid = ((args.frames - 1) // 4 + 1, args.height // 16, args.width // 16)
    backups = {"device": None, "cpu": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        for rank in (int(r) for r in args.ranks.split(",")):
            entry: dict[str, Any] = {}
            results[f"rank{rank}"] = entry
            paths = [write_lora(Path(tmp) / f"r{rank}-{s}.safetensors", shapes, num_layers=config.num_layers,
                                rank=rank, seed=s) for s in (1, 2)]
            entry["file_mib"] = round(paths[0].stat().st_size / 2**20, 1)
            t0 = time.perf_counter()
            host = read_lora(paths[0], linears=shapes)
            entry["read_s"] = time.perf_counter() - t0
            entry["to_device_s"] = seconds(lambda: host.to(device), device)  # noqa: F821 - bound above (ruff reads the del below as unbinding it)
            a, b = host.to(device), read_lora(paths[1], linears=shapes).to(device)
            entry["modules"] = len(a.deltas)
            for where in args.backup.split(","):
                entry[f"backup_{where}"] = switching(model, a, b, device=device, reps=args.reps, backup=backups[where])
                log(f"rank {rank}, restore copies on {where}: {entry[f'backup_{where}']}")
                save()
            entry.update(forward_cost(model, a, grid=grid, device=device, dtype=dtype, reps=args.reps))
            log(f"rank {rank}: read {entry['read_s']:.2f} s, to device {entry['to_device_s']:.3f} s, forward "
                f"{entry['forward_plain_s'] * 1e3:.1f} ms plain / {entry['forward_merged_s'] * 1e3:.1f} ms merged "
                f"(x{entry['forward_ratio']:.4f})")
            save()
            del a, b, host
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
