"""A long video's cost: a chained job of N segments (default 3) through ``pan2-render run`` against N
times one segment, plus colour matching, plus its encode; and, with --interpolate, the
interpolation stage's seconds per frame at the same size.

    python scripts/bench_segments.py --out bench-seg                          # GPU host: pan2-720p, 3 segments
    python scripts/bench_segments.py --out bench-seg --steps 20 --interpolate # fewer steps, + interpolation
    python scripts/bench_segments.py --out /tmp/bs --pipeline tiny --device cpu --interpolate   # CPU smoke

1. The checkpoint is ``bench_batch.py``'s (its helpers, loaded from that file): a full-size
   random-weight Wan2.2-TI2V-5B written once into --checkpoint (default
   ``$PAN2_RENDER_CACHE/bench/wan22-ti2v-5b-random``) and reused; ``--pipeline tiny`` the same
   writer at the tiny model's size, on the CPU.
2. One batch, one ``python -m pan2render.runner.cli run`` (one load), the jobs one after another
   (``after:``: no job's encode overlaps another's sampling): ``chain``, a story of --segments
   prompts; ``one``, the same job as a single segment (the story's first prompt, the same seed:
   the latents of the chain's segment 1, which the script checks); with --interpolate ``smooth``,
   one segment at 2 steps (interpolation does not depend on them) with ``interpolate: 2`` and
   random IFNet weights (``make_random_ifnet.py``).
3. From the ledger and the segments' records (DIR/<job>/segments/<k>/segment.json):
   ``measured`` = the chain's wall from its first sampling (after its group's load and its
   prompts' encode, which is the text encoder's, not the chain's) to its video; ``predicted`` = N x (one's
   sampling + decode) + colour match + the chain's encode. Colour matching has no stage row (each
   segment's decode runs it): it is timed here, after the run, on the device,
   as the chain runs it: each segment's statistics, and segments 2..N matched, on frames of the
   job's size. ``ratio`` = measured / predicted. The breakdown shows where a ratio above 1 goes
   (the video's decode joins the frames the segments' decodes kept: it decodes nothing again).
Results: OUT/bench_segments.json, and a table at the end. docs/performance.md, "Long videos",
says how to read them.
"""

from __future__ import annotations

import argparse
import json
import runpy
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
sys.path.insert(0, str(REPO))  # the checkout's pan2render, not whichever one is installed

BENCH_BATCH = runpy.run_path(str(SCRIPTS / "bench_batch.py"))  # its checkpoint writer, env and log
log = BENCH_BATCH["log"]
PROMPTS: list[str] = BENCH_BATCH["PROMPTS"]
PRESETS = {"full": "pan2-720p", "tiny": "tiny-preview"}


def write_batch(path: Path, ckpt: Path, args: argparse.Namespace, weights: Path | None) -> None:
    defaults: dict[str, Any] = {"negative_prompt": BENCH_BATCH["NEGATIVE"], "preview_every": 0}
    defaults.update({k: v for k, v in (("steps", args.steps), ("height", args.height), ("width", args.width),
                                       ("frames", args.frames)) if v is not None})
    jobs: list[dict[str, Any]] = [
        {"name": "chain", "prompts": PROMPTS[:args.segments], "seed": 0},
        {"name": "one", "prompt": PROMPTS[0], "seed": 0, "after": ["chain"]},
    ]
    if weights is not None:
        jobs.append({"name": "smooth", "prompt": PROMPTS[1], "seed": 1, "steps": 2, "interpolate": 2,
                     "interpolation_weights": str(weights), "after": ["one"]})
    doc = {"model": str(ckpt), "preset": PRESETS[args.pipeline], "defaults": defaults, "jobs": jobs}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def run_batch(args: argparse.Namespace, ckpt: Path, out: Path, weights: Path | None) -> tuple[int, Path]:
    batch, render = out / "batch.yaml", out / "render"
    shutil.rmtree(render, ignore_errors=True)
    write_batch(batch, ckpt, args, weights)
    cmd = [sys.executable, "-m", "pan2render.runner.cli", "run", str(batch), "--out", str(render), "--no-progress"]
    if args.device == "cpu":
        cmd += ["--cpu-gpus", "1"]
    log(f"pan2-render: {' '.join(cmd)}")
    t0 = time.monotonic()
    with open(out / "pan2_render.log", "w") as logf:
        # One GPU: on a larger host Ray would otherwise give each job its own.
        env = BENCH_BATCH["cuda_env"]("0" if args.device == "cuda" else None)
        rc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, text=True).returncode
    log(f"pan2-render exited {rc} after {time.monotonic() - t0:.1f} s (log: {out / 'pan2_render.log'})")
    return rc, render


def job_figures(render: Path) -> dict[str, dict[str, Any]]:
    """Per job: its stages' seconds, its wall (its GPU work's start to done), its segments' records, its video."""
    from pan2render.jobs.ledger import EventKind, JobState, Ledger, Stage

    led = Ledger.open_readonly(render)
    try:
        out: dict[str, dict[str, Any]] = {}
        for job in led.jobs():
            events = led.events(job.id)
            # Its GPU work starts once it runs, its group is loaded (the first job's load is the
            # group's) and its prompts are encoded: whichever of these the ledger logged last.
            start = [e.at for e in events if e.kind in (EventKind.GROUP_LOAD, EventKind.CONDITIONING)
                     or (e.transition and e.transition[1] is JobState.RUNNING)]
            done = [e.at for e in events if e.transition and e.transition[1] is JobState.DONE]
            st = led.stages(job.id)
            segments = sorted((render / job.id / "segments").glob("*/segment.json"), key=lambda p: int(p.parent.name))
            out[job.name] = {
                "id": job.id, "state": job.state.value, "attempts": job.attempts,
                "stages": {s.value: st[s].seconds for s in Stage if s in st},
                "wall_s": done[-1] - max(start) if start and done else None,  # its sampling's start to its video
                "segments": [json.loads(p.read_text())["seconds"] for p in segments],
                "video": json.loads((render / job.id / "params.json").read_text()).get("long_video"),
            }
        return out
    finally:
        led.close()


def same_latents(render: Path, jobs: dict[str, dict[str, Any]]) -> bool:
    """Whether the chain's segment 1 sampled the one-segment job's latents (so ``one`` times the
    same work as a segment of the chain)."""
    from safetensors.numpy import load_file

    a = load_file(render / jobs["chain"]["id"] / "segments" / "1" / "latents.safetensors")["latents"]
    b = load_file(render / jobs["one"]["id"] / "latents.safetensors")["latents"]
    return bool(a.shape == b.shape and (a == b).all())


def colour_match_s(*, segments: int, frames: int, height: int, width: int, device: str, repeats: int) -> float:
    """Seconds of the chain's colour work on ``device``: each segment's Lab statistics, then
    segments 2..N matched to segment 1 (``worker/long_video.py``), median of ``repeats``."""
    import torch

    from pan2render.media.colour import colour_stats, match_colour

    gen = torch.Generator(device=device).manual_seed(0)
    clips = [torch.randint(0, 256, (frames, height, width, 3), generator=gen, device=device, dtype=torch.uint8)
             for _ in range(segments)]  # uint8 [F, H, W, 3] each; the time does not depend on the content

    def once() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = [colour_stats(c) for c in clips]  # (the chain's segment decodes measure these)
        matched = [match_colour(c, s, stats[0]) for c, s in zip(clips[1:], stats[1:])]  # (each later segment's decode)
        del matched
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    once()  # warm-up: kernels compiled or loaded, memory pooled
    return statistics.median(once() for _ in range(repeats))


def summary(jobs: dict[str, dict[str, Any]], colour_s: float, n: int) -> dict[str, Any]:
    chain, one = jobs["chain"], jobs["one"]
    s1, d1 = one["stages"]["sampling"], one["stages"]["decode"]
    encode = chain["stages"]["encode"]
    measured = chain["wall_s"]
    predicted = n * (s1 + d1) + colour_s + encode
    segs = chain["segments"]
    parts = {"segments' sampling": sum(s["sampling"] for s in segs),
             "segments' decodes (last frames)": sum(s["decode"] for s in segs),
             "video decode (the kept segments joined)": chain["stages"]["decode"], "encode": encode}
    parts["between the calls"] = measured - sum(parts.values())
    res = {"segments": n, "one_sampling_s": s1, "one_decode_s": d1, "colour_match_s": colour_s,
           "chain_encode_s": encode, "measured_s": measured, "predicted_s": predicted,
           "ratio": measured / predicted, "chain_parts_s": parts}
    if "smooth" in jobs:
        smooth = jobs["smooth"]
        frames_out = (smooth["video"] or {}).get("frames")
        secs = smooth["stages"].get("interpolate")
        res["interpolate"] = {"seconds": secs, "frames_out": frames_out,
                              "s_per_output_frame": secs / frames_out if secs and frames_out else None}
    return res


def table(res: dict[str, Any]) -> str:
    s = res["summary"]
    lines = [f"{res['args']['pipeline']} checkpoint on {res['args']['device']}, {res['size']}, "
             f"{s['segments']} segments, same latents in segment 1 and the one-segment job: {res['same_latents']}",
             f"one segment: sampling {s['one_sampling_s']:.2f} s + decode {s['one_decode_s']:.2f} s",
             f"predicted  {s['predicted_s']:9.2f} s  = {s['segments']} x one segment + colour match "
             f"{s['colour_match_s']:.3f} s + encode {s['chain_encode_s']:.2f} s",
             f"measured   {s['measured_s']:9.2f} s  (the chain's wall, its first sampling to its video)",
             f"ratio      {s['ratio']:9.4f}"]
    lines += [f"  {k:46} {v:9.2f} s" for k, v in s["chain_parts_s"].items()]
    if (i := s.get("interpolate")) and i["s_per_output_frame"] is not None:
        lines.append(f"interpolate x2: {i['seconds']:.2f} s for {i['frames_out']} frames = "
                     f"{i['s_per_output_frame'] * 1000:.2f} ms per output frame")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="results folder (JSON, log, the render)")
    p.add_argument("--checkpoint", type=Path, help="the random checkpoint folder (written once, then reused)")
    p.add_argument("--pipeline", choices=sorted(PRESETS), default="full",
                   help="full: Wan2.2-TI2V-5B's size (preset pan2-720p); tiny: the tiny model's (tiny-preview)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--segments", type=int, default=3)
    p.add_argument("--steps", type=int, help="default: the preset's")
    p.add_argument("--height", type=int, help="default: the preset's")
    p.add_argument("--width", type=int, help="default: the preset's")
    p.add_argument("--frames", type=int, help="per segment; default: the preset's")
    p.add_argument("--interpolate", action="store_true", help="add a job interpolated x2 (random IFNet weights)")
    p.add_argument("--colour-repeats", type=int, default=5)
    args = p.parse_args()
    if not 2 <= args.segments <= len(PROMPTS):
        p.error(f"--segments must be 2..{len(PROMPTS)} (one prompt each)")
    if args.pipeline == "full" and args.device == "cpu":
        p.error("--pipeline full needs --device cuda (a 5B model on the CPU takes hours a step)")

    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    ckpt = BENCH_BATCH["checkpoint"](argparse.Namespace(tiny=args.pipeline == "tiny", checkpoint=args.checkpoint))
    weights = None
    if args.interpolate:
        weights = out / "ifnet-random.safetensors"
        runpy.run_path(str(SCRIPTS / "make_random_ifnet.py"))["save_random_ifnet"](weights)
    rc, render = run_batch(args, ckpt, out, weights)
    res: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "checkpoint": str(ckpt), "rc": rc}
    results = out / "bench_segments.json"
    if rc != 0:
        results.write_text(json.dumps(res, indent=1))
        log(f"the run failed: see {out / 'pan2_render.log'}")
        return 1
    jobs = job_figures(render)
    spec = json.loads((render / jobs["one"]["id"] / "params.json").read_text())["spec"]
    res.update(jobs=jobs, same_latents=same_latents(render, jobs),
               size=f"{spec['width']}x{spec['height']}x{spec['frames']}, {spec['steps']} steps")
    colour = colour_match_s(segments=args.segments, frames=spec["frames"], height=spec["height"],
                            width=spec["width"], device=args.device, repeats=args.colour_repeats)
    res["summary"] = summary(jobs, colour, args.segments)
    results.write_text(json.dumps(res, indent=1))
    print(table(res), flush=True)
    log(f"results: {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
