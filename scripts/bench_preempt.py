"""A long sampling preempted half-way on a warm farm: the urgent job's wait, and the stopped job's
latents against a sampling never stopped.

    python scripts/bench_preempt.py --out bench-out             # one H200, full-size random checkpoint
    python scripts/bench_preempt.py --out /tmp/bp --tiny        # CPU smoke at toy size

1. The random-weight Wan2.2-TI2V-5B checkpoint of bench_batch.py (written once, reused), `farm start`,
   one 3-step DMD job of that model (its group loaded and warmed).
2. U: a 1-job --steps (50) guided batch, never stopped: its final latents.
3. P: the same job in another folder; once its sampling passes step --stop-at (25), a 1-job 3-step
   DMD batch submitted at priority 9 with --preempt. The sampling stops at its next step boundary
   (checkpointed), the DMD job runs on the group, P's job continues from its step checkpoint.
   Figures: the step it stopped at, the seconds from the urgent submit to the stop and to the urgent
   video, the step it resumed from, P's wall time against U's.
4. With --repeat: U again, for the GPU's own run-to-run difference.
Result: P's latents against U's (max abs diff, bit-equal) beside U-again's. OUT/bench_preempt.json
(written as each phase ends) and a summary at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_batch as bb  # the checkpoint, the env for subprocesses
from bench_farm import batch_file, cli, ledger_times, submit_and_wait


def _latents(out: Path) -> Any:
    from safetensors.torch import load_file

    from pan2render.jobs.ledger import Ledger

    led = Ledger.open_readonly(out)
    try:
        (job,) = led.jobs()
    finally:
        led.close()
    return load_file(str(out / job.id / "latents.safetensors"))["latents"].float()


def _diff(a: Any, b: Any) -> dict[str, Any]:
    return {"max_abs_diff": float((a - b).abs().max()), "bit_equal": bool((a == b).all())}


def _step_of(root: Path, env: dict[str, str], job_name_dir: Path) -> int | None:
    """The step the farm reports for the one running job of the batch in ``job_name_dir``."""
    snap = json.loads(cli(["farm", "status", "--root", str(root), "--json"], env).stdout)
    for row in snap.get("running", []):
        batch = next((b for b in snap.get("batches", []) if b.get("id") == row["batch"]), None)
        if batch is not None and Path(batch["out_dir"]) == job_name_dir and row.get("step") is not None:
            return int(row["step"])
    return None


def _wait_done(out: Path, deadline_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + deadline_s
    while True:
        if (out / "ledger.sqlite").is_file():
            times = ledger_times(out)
            if times["jobs"] and all(j["done_at"] for j in times["jobs"]):
                return times
        if time.monotonic() > deadline:
            raise SystemExit(f"{out}: its job did not finish")
        time.sleep(0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--stop-at", type=int, default=25, help="submit the urgent batch once this step is done")
    p.add_argument("--repeat", action="store_true", help="sample U again: the GPU's run-to-run difference")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny checkpoint at toy size")
    args = p.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tiny": args.tiny,
                           "steps": args.steps, "stop_at": args.stop_at}

    def save() -> None:
        (out / "bench_preempt.json").write_text(json.dumps(res, indent=1, default=str))

    ckpt = bb.checkpoint(argparse.Namespace(checkpoint=args.checkpoint, tiny=args.tiny))
    env = bb.cuda_env(None)
    root, logf = out / "farm", out / "commands.log"
    cli(["farm", "start", "--root", str(root)] + (["--cpu-gpus", "1"] if args.tiny else []), env, log_to=logf)
    try:
        bb.log("warm-up: one 3-step DMD job")
        warm = batch_file(out / "warm.yaml", ckpt, n=1, steps=3, dmd=True, tiny=args.tiny, tag="warm")
        submit_and_wait(root, warm, out / "warm", env, logf)

        long = batch_file(out / "long.yaml", ckpt, n=1, steps=args.steps, dmd=False, tiny=args.tiny, tag="long")
        bb.log(f"U: {args.steps} steps, never stopped")
        t = submit_and_wait(root, long, out / "u", env, logf)
        res["u"] = {"wall_s": time.time() - t, **ledger_times(out / "u")}
        save()

        bb.log(f"P: the same job, preempted after step {args.stop_at}")
        urgent = batch_file(out / "urgent.yaml", ckpt, n=1, steps=3, dmd=True, tiny=args.tiny, tag="urgent")
        t_p = submit_and_wait(root, long, out / "p", env, logf, wait=False)
        deadline = time.monotonic() + 900
        while (step := _step_of(root, env, out / "p")) is None or step < args.stop_at:
            if time.monotonic() > deadline:
                raise SystemExit("P did not reach the step to preempt at")
            time.sleep(0.3)
        t_urgent = time.time()
        cli(["submit", str(urgent), "--out", str(out / "urgent"), "--root", str(root), "--priority", "9",
             "--preempt"], env, log_to=logf)
        urgent_times = _wait_done(out / "urgent", 900)
        p_times = _wait_done(out / "p", 1800)
        t_p_done = time.time()
        from pan2render.jobs.ledger import Ledger

        led = Ledger.open_readonly(out / "p")
        try:
            stops = [(e.at, e.detail) for e in led.events() if "preempted at step" in e.detail]
        finally:
            led.close()
        resumed = [int(m) for m in re.findall(r"from the step checkpoint at step (\d+)/",
                                               (out / "p" / "run.log").read_text())]
        u_job = res["u"]["jobs"][0]
        res["p"] = {"step_seen_before_the_urgent_submit": step, "stops": stops, "resumed_from_steps": resumed,
                    "stop_after_urgent_submit_s": stops[0][0] - t_urgent if stops else None,
                    "urgent_video_after_submit_s": urgent_times["jobs"][0]["done_at"] - t_urgent,
                    "urgent_gpu_work_s": urgent_times["jobs"][0]["sampling_s"] + urgent_times["jobs"][0]["decode_s"],
                    "urgent_encode_s": urgent_times["jobs"][0]["encode_s"],
                    "p_wall_s": t_p_done - t_p, "u_wall_s": res["u"]["wall_s"],
                    "u_sampling_s": u_job["sampling_s"], **p_times}
        res["p_vs_u"] = _diff(_latents(out / "p"), _latents(out / "u"))
        save()

        if args.repeat:
            bb.log("U again: the GPU's run-to-run difference")
            submit_and_wait(root, long, out / "u2", env, logf)
            res["u2_vs_u"] = _diff(_latents(out / "u2"), _latents(out / "u"))
            save()
    finally:
        cli(["farm", "stop", "--root", str(root)], env, log_to=logf)

    pr = res["p"]
    print(f"P stopped {pr['stops']} ({pr['stop_after_urgent_submit_s']} s after the urgent submit); the urgent "
          f"video {pr['urgent_video_after_submit_s']:.2f} s after its submit (its GPU work "
          f"{pr['urgent_gpu_work_s']:.2f} s + encode {pr['urgent_encode_s']:.2f} s); P resumed from "
          f"{pr['resumed_from_steps']}; P's wall {pr['p_wall_s']:.1f} s vs U's {pr['u_wall_s']:.1f} s")
    print(f"P vs U: {res['p_vs_u']}" + (f"; U again vs U: {res['u2_vs_u']}" if "u2_vs_u" in res else ""))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sys.exit(main())
