"""What a scraper costs a farm's sampling: step seconds while a client scrapes /metrics every 0.1 s
against the same batches unscraped, on the CPU with the fake pipeline.

    python scripts/bench_metrics.py                      # defaults: docs/performance.md, "Metrics"
    python scripts/bench_metrics.py --step-seconds 0     # no stand-in for GPU time: the worst case
    python scripts/bench_metrics.py --pipeline real      # GPU host: the embedded tiny model's real steps

One farm (`farm start`, in-process workers: the sampling runs in the farm's own process, beside its
API thread, which is the worst place for a scraper to be), warmed by --history small batches (ended
folders the metrics keep track of). Then --rounds rounds, each a pair in alternating order: a batch
rendered unscraped and the same batch (new seeds) rendered while a thread GETs /metrics every
--scrape-every seconds. A job's seconds per step are its sampling seconds over its steps, from its
ledger. Prints each round's medians and ratio, the median of the rounds' ratios (scraped /
unscraped: the pairing keeps a shared machine's drifting load out of it), and the scrapes' latency.

The fake pipeline's steps are a tensor op on the latents and a sleep of --step-seconds, a stand-in
for GPU work during which the driver's Python does not run (0: every step is Python and torch on
the CPU, contending with the scrapes for the interpreter). --pipeline real renders with the embedded tiny model's own
pipeline on whatever device the farm finds (a GPU where there is one): its steps are short and
launch-bound, so the Python that launches them is what a scraper could slow.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout: pan2render need not be installed

from pan2render.client import FarmClient, find_farm
from pan2render.jobs.ledger import Ledger
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

CLI = [sys.executable, "-m", "pan2render.runner.cli"]


def batch_text(*, jobs: int, steps: int, size: tuple[int, int, int], seed0: int, tag: str) -> str:
    width, height, frames = size
    return yaml.safe_dump({"model": "tiny", "preset": "tiny-preview",
                           "defaults": {"steps": steps, "width": width, "height": height, "frames": frames},
                           "jobs": [{"name": f"{tag}{i}", "prompt": f"bench {tag} {i}", "seed": seed0 + i}
                                    for i in range(jobs)]})


def render(farm: FarmClient, text: str, out: Path, base: Path) -> None:
    b = farm.submit_text(text, out=out, base=base)
    while farm.batch(b["id"])["exit_code"] is None:
        time.sleep(0.1)


def step_seconds(out: Path) -> list[float]:
    led = Ledger.open_readonly(out)
    try:
        return [t.stage_seconds["sampling"] / t.steps for t in led.tallies() if "sampling" in t.stage_seconds]
    finally:
        led.close()


class Scraper:
    """GET /metrics every ``every_s`` on a thread, until stopped; keeps each scrape's seconds."""

    def __init__(self, url: str, every_s: float):
        self.url, self.every_s = url + "/metrics", every_s
        self.seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=30) as resp:
                resp.read()
            self.seconds.append(time.perf_counter() - t0)
            self._stop.wait(max(0.0, self.every_s - (time.perf_counter() - t0)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=6, help="jobs per batch")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--size", default="256x256x33", help="WxHxFRAMES of every job")
    p.add_argument("--pipeline", choices=("fake", "real"), default="fake",
                   help="fake: the runner's stand-in pipeline; real: the tiny model's own (on the GPU if one)")
    p.add_argument("--step-seconds", type=float, default=0.02, help="the fake step's stand-in for GPU time")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--history", type=int, default=20, help="small batches rendered first (ended folders)")
    p.add_argument("--scrape-every", type=float, default=0.1)
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    w, h, f = (int(x) for x in args.size.split("x"))
    work = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    env = {**os.environ, "PAN2_RENDER_FARM": str(work / "farm"), "PAN2_RENDER_CACHE": str(work / "cache"),
           "PAN2_RENDER_EXECUTOR": "local",
           # the checkout first, and what the caller's PYTHONPATH holds (a GPU host's unpacked wheels) after it
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if args.pipeline == "fake":
        env |= {"PAN2_RENDER_PIPELINE": FAKE_FACTORY, "PAN2_FAKE_STEP_SECONDS": str(args.step_seconds)}
    started = subprocess.run([*CLI, "farm", "start", "--inputs-root", str(work), "--outputs-root", str(work)],
                             env=env, capture_output=True, text=True, timeout=300)
    if started.returncode != 0:
        raise SystemExit(f"farm start failed:\n{started.stdout}{started.stderr}")
    farm = find_farm(work / "farm")
    assert farm is not None
    sides: dict[str, list[float]] = {"unscraped": [], "scraped": []}
    ratios: list[float] = []
    scrapes: list[float] = []
    try:
        for i in range(args.history):
            render(farm, batch_text(jobs=1, steps=2, size=(64, 64, 17), seed0=i, tag="h"), work / f"history{i}", work)
        steps_are = f"fake step sleep {args.step_seconds} s" if args.pipeline == "fake" else "the tiny model's pipeline"
        print(f"{args.history} small batches rendered first; then {args.rounds} rounds of {args.jobs} jobs x "
              f"{args.steps} steps at {args.size}, {steps_are}", flush=True)
        for r in range(args.rounds):
            medians = {}
            # Each round a pair, its order alternating, so that a drift of the machine's load weighs on both.
            for side in ("unscraped", "scraped") if r % 2 == 0 else ("scraped", "unscraped"):
                out = work / f"{side}{r}"
                text = batch_text(jobs=args.jobs, steps=args.steps, size=(w, h, f), seed0=1000 * (r + 1), tag=side[0])
                if side == "scraped":
                    with Scraper(farm.url, args.scrape_every) as s:
                        render(farm, text, out, work)
                    scrapes += s.seconds
                else:
                    render(farm, text, out, work)
                steps = step_seconds(out)
                sides[side] += steps
                medians[side] = statistics.median(steps)
            ratios.append(medians["scraped"] / medians["unscraped"])
            print(f"round {r + 1}: median step unscraped {medians['unscraped'] * 1e3:.2f} ms, scraped "
                  f"{medians['scraped'] * 1e3:.2f} ms, ratio {ratios[-1]:.3f}", flush=True)
    finally:
        subprocess.run([*CLI, "farm", "stop"], env=env, capture_output=True, timeout=120, check=False)
        shutil.rmtree(work, ignore_errors=True)
    figures: dict[str, Any] = {side: {"jobs": len(v), "median_step_s": statistics.median(v), "mean_step_s":
                                      statistics.fmean(v)} for side, v in sides.items()}
    ratio = statistics.median(ratios)
    scrapes.sort()
    figures.update(ratio=ratio, round_ratios=ratios, scrapes=len(scrapes), scrape_p50_s=scrapes[len(scrapes) // 2],
                   scrape_p99_s=scrapes[min(len(scrapes) - 1, int(len(scrapes) * 0.99))], args=vars(args) | {
                       "json": None if args.json is None else str(args.json)})
    for side in ("unscraped", "scraped"):
        s = figures[side]
        print(f"{side:9}: {s['jobs']} jobs, step median {s['median_step_s'] * 1e3:.3f} ms, mean "
              f"{s['mean_step_s'] * 1e3:.3f} ms")
    print(f"ratio scraped / unscraped (median of the rounds' median steps): {ratio:.3f} (rounds: "
          f"{', '.join(f'{x:.3f}' for x in ratios)}); {len(scrapes)} scrapes, p50 {figures['scrape_p50_s'] * 1e3:.1f} "
          f"ms, p99 {figures['scrape_p99_s'] * 1e3:.1f} ms")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
