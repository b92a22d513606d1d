"""How far `validate`'s estimate is from the time a job then takes, on this machine's GPU.

    python scripts/bench_estimates.py --out est-out                # one GPU, the full-size random checkpoint
    python scripts/bench_estimates.py --out /tmp/est --tiny        # CPU smoke at toy size

Renders jobs of one size (the first of --sizes) through ``pan2-render run``, then for each other
size: the estimate from that ledger alone (runner/views/estimates.py: the cost model fitted to it), the
estimate from the reference table alone (no ledger), and the measured seconds of the same jobs
rendered afterwards (median over --jobs jobs, stages summed). The checkpoint is bench_batch.py's
random-weight Wan2.2-TI2V-5B folder (written once, reused). Results: OUT/bench_estimates.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_batch  # the random checkpoint builder, beside this script

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import Ledger
from pan2render.runner.views.estimates import CPU, CUDA, History, plan

FULL_SIZES = ("480x832x33", "704x1248x121", "480x832x81")
TINY_SIZES = ("32x32x5", "64x64x17", "96x96x25")


def batch_file(path: Path, *, model: str, size: str, jobs: int, steps: int) -> Path:
    height, width, frames = (int(v) for v in size.split("x"))
    lines = [f"model: {model}", "preset: pan2-720p", "defaults:", f"  height: {height}", f"  width: {width}",
             f"  frames: {frames}", f"  steps: {steps}", "jobs:"]
    lines += [f"  - {{name: j{i}, prompt: \"clip {i} of a quiet harbour at dusk\", seed: {i}}}" for i in range(jobs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def render(batch: Path, out: Path, extra: list[str]) -> float:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pan2render.runner.cli", "run", str(batch), "--out", str(out),
                           "--no-progress", "--no-farm", *extra], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run {batch} failed ({done.returncode}): {done.stderr[-2000:]}")
    return time.monotonic() - t0


def measured(out: Path) -> float:
    ledger = Ledger.open_readonly(out)
    try:
        return statistics.median(sum(r.seconds or 0.0 for r in ledger.stages(j.id).values()) for j in ledger.jobs())
    finally:
        ledger.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="the tiny model on logical CPU GPUs (a smoke run)")
    p.add_argument("--checkpoint", type=Path, help="the random checkpoint folder (bench_batch.py's default)")
    p.add_argument("--sizes", nargs="+", help="HxWxF; the first is rendered first and estimated from")
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = "tiny" if args.tiny else str(bench_batch.checkpoint(args))
    sizes = args.sizes or list(TINY_SIZES if args.tiny else FULL_SIZES)
    device, extra = (CPU, ["--cpu-gpus", "1"]) if args.tiny else (CUDA, [])
    first = args.out / f"r-{sizes[0]}"
    render(batch_file(args.out / f"b-{sizes[0]}.yaml", model=model, size=sizes[0], jobs=args.jobs,
                      steps=args.steps), first, extra)
    rows = [{"size": sizes[0], "measured_s": measured(first), "role": "the ledger estimated from"}]
    history = History.from_folders([first])
    for size in sizes[1:]:
        batch = batch_file(args.out / f"b-{size}.yaml", model=model, size=size, jobs=args.jobs, steps=args.steps)
        jobs = load_batch(batch, check_model=False).jobs
        from_ledger = plan(jobs, gpus=1, device=device, history=history).estimates[0].gpu_seconds
        from_table = plan(jobs, gpus=1, device=device, history=History()).estimates[0].gpu_seconds
        out = args.out / f"r-{size}"
        render(batch, out, extra)
        real = measured(out)
        rows.append({"size": size, "measured_s": real, "estimate_from_ledger_s": from_ledger,
                     "ratio_ledger": from_ledger / real, "estimate_from_table_s": from_table,
                     "ratio_table": from_table / real})
        (args.out / "bench_estimates.json").write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1))
    for r in rows:
        print(json.dumps(r))
    (args.out / "bench_estimates.json").write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
