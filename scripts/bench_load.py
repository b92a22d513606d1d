"""Cold-start load: a full-size checkpoint folder onto one GPU, ours against diffusers', one run.

    python scripts/bench_load.py --out DIR [--checkpoint FOLDER] [--rounds 2]
    python scripts/bench_load.py --out /tmp/bl --tiny        # CPU smoke at toy size

The checkpoint is bench_batch.py's random-weight Wan2.2-TI2V-5B in the diffusers layout (DiT and
VAE fp32, umT5-XXL bf16, sharded; written once, then reused), so every variant reads the same
files, from the page cache (the machine has run a batch; a first read from disk is slower for all).
Each variant loads in a fresh subprocess (its imports and CUDA start not counted), in turn, for
--rounds rounds:

- ``components``: the DiT, the VAE and the text encoder one after the other, each timed (what
  ``PAN2Pipeline.from_pretrained`` does, with the seconds split);
- ``ours``: ``PAN2Pipeline.from_pretrained`` itself;
- ``diffusers``: ``WanPipeline`` with a bf16 transformer and an fp32 VAE, moved to the GPU, as
  bench_batch.py's loop loads it.

Prints seconds per variant and round and writes DIR/bench_load.json. Results of record:
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
VARIANTS = ("components", "ours", "diffusers")


def load_once(variant: str, ckpt: Path, device_name: str) -> dict[str, Any]:
    """In the subprocess: load ``ckpt`` one way, return the seconds."""
    import torch

    from pan2render.models.pipeline import PAN2Pipeline, PAN2PipelineConfig, load_dit, load_vae
    from pan2render.models.text import TextEncoder

    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context, not counted

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    res: dict[str, Any] = {"variant": variant}
    t0 = time.perf_counter()
    if variant == "components":
        loaded = []  # kept, so each component loads beside the ones before it, as in the pipeline
        last = t0
        for name, load in (("dit", lambda: load_dit(ckpt, device=device, dtype=dtype)),
                           ("vae", lambda: load_vae(ckpt, device=device, dtype=torch.float32)),
                           ("text_encoder", lambda: TextEncoder.from_pretrained(ckpt, device=device, dtype=dtype))):
            loaded.append(load())
            sync()
            res[f"{name}_s"] = round(time.perf_counter() - last, 2)
            last = time.perf_counter()
    elif variant == "ours":
        PAN2Pipeline.from_pretrained(ckpt, PAN2PipelineConfig(device=str(device), dtype=dtype))
    else:
        from bench_batch import load_diffusers_pipeline

        load_diffusers_pipeline(ckpt, dtype=dtype, device=device)
    sync()
    res["seconds"] = round(time.perf_counter() - t0, 2)
    if device.type == "cuda":
        res["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoint", type=Path, help="bench_batch.py's random checkpoint folder (written if missing)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny random checkpoint")
    p.add_argument("--one", nargs=3, metavar=("VARIANT", "CHECKPOINT", "DEVICE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(load_once(args.one[0], Path(args.one[1]), args.one[2])))
        return 0

    import bench_batch

    ckpt = bench_batch.checkpoint(argparse.Namespace(checkpoint=args.checkpoint, tiny=args.tiny))
    device = "cpu" if args.tiny else "cuda:0"
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "checkpoint": str(ckpt),
           "checkpoint_gib": round(sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**30, 1)}
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for variant in args.variants.split(","):
            proc = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--one", variant, str(ckpt), device],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                runs.append({"variant": variant, "round": rnd, "error": proc.stderr.strip().splitlines()[-1:]})
            else:
                runs.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "round": rnd})
            print(json.dumps(runs[-1]), flush=True)
            (args.out / "bench_load.json").write_text(json.dumps({"env": env, "runs": runs}, indent=1))
    best = {v: min((r["seconds"] for r in runs if r["variant"] == v and "seconds" in r), default=None)
            for v in args.variants.split(",")}
    print("best of rounds, s:", json.dumps(best))
    if best.get("ours") and best.get("diffusers"):
        print(f"diffusers / ours: x{best['diffusers'] / best['ours']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
