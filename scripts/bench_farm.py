"""The farm's latency and throughput on a warm farm: what a user waits for after `submit`.

    python scripts/bench_farm.py --out bench-out                 # one H200, full-size random checkpoint
    python scripts/bench_farm.py --out /tmp/bf --tiny            # CPU smoke at toy size

1. The random-weight Wan2.2-TI2V-5B checkpoint of bench_batch.py (written once, reused).
2. `pan2-render farm start`, then one 3-step DMD job of that model (so the farm "has already served
   a batch of that model": its group is loaded and warmed).
3. (a) A 1-job 3-step DMD batch: its video's time after `submit` against its GPU work (sampling +
   decode, from its ledger) + its encode. Target: <= GPU work + encode + 2 s.
4. (b) A 4-job 20-step guided batch: first video after `submit` against the first job's GPU work +
   encode + 2 s; steady state per job against a job's GPU work (target <= 1.03x).
5. (c) Two batches: a 3-job (--c-jobs) 20-step batch, then, once its first job samples, a 1-job batch at a
   higher priority: where the second's job starts (the first group that frees up, no load between),
   and the GPU's busy fraction (NVML) from the first video to the last across both (target >= 0.97).
6. The same 1-job DMD batch through a standalone `run --no-farm` (Ray, imports, load, warm-up of its
   own): first video after the command, for the ratio the farm buys.
Results: OUT/bench_farm.json (written as each phase ends) and a table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_batch as bb  # the checkpoint, the GPU sampler, the env for subprocesses

CLI = [sys.executable, "-m", "pan2render.runner.cli"]


def cli(args: list[str], env: dict[str, str], *, log_to: Path | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=1800)
    if log_to is not None:
        with open(log_to, "a") as f:
            f.write(f"$ pan2-render {' '.join(args)} -> {done.returncode}\n{done.stdout}{done.stderr}\n")
    if done.returncode not in (0, 1):
        raise SystemExit(f"pan2-render {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def batch_file(path: Path, ckpt: Path, *, n: int, steps: int, dmd: bool, tiny: bool, tag: str) -> Path:
    if dmd:
        fields: dict[str, Any] = {"sampler": "dmd", "guidance": 1.0, "timesteps": [1000, 757, 522]}
    else:
        fields = {"steps": steps, "guidance": 2.5}
    size = {"height": 64, "width": 64, "frames": 17} if tiny else {"height": 704, "width": 1248, "frames": 121}
    jobs = [{"name": f"{tag}{i}", "prompt": f"{bb.PROMPTS[i % len(bb.PROMPTS)]} ({tag})", "seed": i} for i in range(n)]
    doc = {"model": str(ckpt), "preset": "tiny-preview" if tiny else "pan2-720p",
           "defaults": {"negative_prompt": bb.NEGATIVE, **size, **fields}, "jobs": jobs}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def ledger_times(out: Path) -> dict[str, Any]:
    """Per job: started/done wall times and stage seconds; the group loads the batch saw."""
    from pan2render.jobs.ledger import Ledger

    led = Ledger.open_readonly(out)
    try:
        jobs = []
        for j in led.jobs():
            st = {str(k.value if hasattr(k, "value") else k): r.seconds for k, r in led.stages(j.id).items()}
            ev = led.events(j.id)
            jobs.append({"job": j.name, "state": j.state.value,
                         "started": [e.at for e in ev if e.started],
                         "done_at": next((e.at for e in ev if e.label == "running->done"), None),
                         "sampling_s": st.get("sampling"), "decode_s": st.get("decode"), "encode_s": st.get("encode")})
        loads = [e.detail for e in led.events() if e.label == "group-load"]
    finally:
        led.close()
    return {"jobs": jobs, "loads": loads}


def submit_and_wait(root: Path, batch: Path, out: Path, env: dict[str, str], logf: Path, *,
                    priority: int = 0, wait: bool = True) -> float:
    t = time.time()
    cli(["submit", str(batch), "--out", str(out), "--root", str(root), "--priority", str(priority),
         *(["--wait"] if wait else [])], env, log_to=logf)
    return t


def first_video(times: dict[str, Any], submitted: float) -> dict[str, Any]:
    jobs = sorted((j for j in times["jobs"] if j["done_at"]), key=lambda j: j["done_at"])
    first = jobs[0]
    gpu = first["sampling_s"] + first["decode_s"]
    return {"first_video_after_submit_s": first["done_at"] - submitted, "first_job_gpu_work_s": gpu,
            "first_job_encode_s": first["encode_s"], "target_s": gpu + first["encode_s"] + 2.0,
            "loads_in_batch": len(times["loads"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--c-jobs", type=int, default=3, help="jobs of (c)'s first, lower-priority batch (default 3)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny checkpoint at toy size")
    args = p.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tiny": args.tiny}

    def save() -> None:
        (out / "bench_farm.json").write_text(json.dumps(res, indent=1, default=str))

    ckpt = bb.checkpoint(argparse.Namespace(checkpoint=args.checkpoint, tiny=args.tiny))
    env = bb.cuda_env(None)
    root, logf = out / "farm", out / "commands.log"
    start = ["farm", "start", "--root", str(root)] + (["--cpu-gpus", "1"] if args.tiny else [])
    t = time.monotonic()
    cli(start, env, log_to=logf)
    res["farm_start_s"] = time.monotonic() - t
    sampler = bb.GpuSampler([0]).start()
    try:
        bb.log("warm-up: one 3-step DMD job, so the farm has served this model")
        warm = batch_file(out / "warm.yaml", ckpt, n=1, steps=3, dmd=True, tiny=args.tiny, tag="warm")
        t = submit_and_wait(root, warm, out / "warm", env, logf)
        res["warm_up"] = {"after_submit_s": time.time() - t, **ledger_times(out / "warm")}
        save()

        bb.log("(a) 1 job, 3-step DMD, on the warm farm")
        a = batch_file(out / "a.yaml", ckpt, n=1, steps=3, dmd=True, tiny=args.tiny, tag="a")
        t = submit_and_wait(root, a, out / "a", env, logf)
        res["a_dmd_1job"] = first_video(ledger_times(out / "a"), t)
        save()

        bb.log(f"(b) 4 jobs, {args.steps} guided steps")
        b = batch_file(out / "b.yaml", ckpt, n=4, steps=args.steps, dmd=False, tiny=args.tiny, tag="b")
        t = submit_and_wait(root, b, out / "b", env, logf)
        times = ledger_times(out / "b")
        done = sorted(j["done_at"] for j in times["jobs"] if j["done_at"])
        gpu = sorted(j["sampling_s"] + j["decode_s"] for j in times["jobs"][1:])
        res["b_guided_4jobs"] = {**first_video(times, t), "steady_s_per_job": (done[-1] - done[0]) / (len(done) - 1),
                                 "gpu_work_s_per_job": gpu[len(gpu) // 2]}
        res["b_guided_4jobs"]["steady_over_gpu_work"] = (res["b_guided_4jobs"]["steady_s_per_job"]
                                                        / res["b_guided_4jobs"]["gpu_work_s_per_job"])
        save()

        bb.log(f"(c) a {args.c_jobs}-job batch, then a 1-job batch at a higher priority once the first samples")
        c1 = batch_file(out / "c1.yaml", ckpt, n=args.c_jobs, steps=args.steps, dmd=False, tiny=args.tiny, tag="low")
        c2 = batch_file(out / "c2.yaml", ckpt, n=1, steps=args.steps, dmd=False, tiny=args.tiny, tag="high")
        submit_and_wait(root, c1, out / "c1", env, logf, wait=False)
        deadline = time.monotonic() + 600
        while not (out / "c1" / "ledger.sqlite").is_file() or not any(
                j["started"] for j in ledger_times(out / "c1")["jobs"]):
            if time.monotonic() > deadline:
                raise SystemExit("the first batch of (c) did not start")
            time.sleep(0.2)
        time.sleep(2.0)  # its first job is sampling now
        t_high = submit_and_wait(root, c2, out / "c2", env, logf, priority=5)
        while any(j["done_at"] is None for j in ledger_times(out / "c1")["jobs"]):
            time.sleep(0.5)
        low, high = ledger_times(out / "c1"), ledger_times(out / "c2")
        starts = sorted([(s, j["job"]) for side in (low, high) for j in side["jobs"] for s in j["started"]])
        after = [name for s, name in starts if s > t_high]
        dones = sorted(j["done_at"] for side in (low, high) for j in side["jobs"])
        to_monotonic = time.monotonic() - time.time()
        busy = sampler.summary(dones[0] + to_monotonic, dones[-1] + to_monotonic, [0])
        res["c_priority"] = {"starts_after_the_high_submit": after, "high_first": bool(after) and after[0] == "high0",
                             "loads_in_high_batch": len(high["loads"]), "busy_first_to_last_video": busy}
        save()
    finally:
        sampler.stop()
        cli(["farm", "stop", "--root", str(root)], env, log_to=logf)

    bb.log("standalone: the 1-job DMD batch through run --no-farm")
    t = time.time()
    cli(["run", str(a), "--out", str(out / "standalone"), "--no-farm", "--no-progress"]
        + (["--cpu-gpus", "1"] if args.tiny else []), env, log_to=logf)
    res["standalone_dmd_1job"] = first_video(ledger_times(out / "standalone"), t)
    res["standalone_over_farm_first_video"] = (res["standalone_dmd_1job"]["first_video_after_submit_s"]
                                               / res["a_dmd_1job"]["first_video_after_submit_s"])
    save()
    a_, b_ = res["a_dmd_1job"], res["b_guided_4jobs"]
    print(f"(a) 1-job DMD: first video {a_['first_video_after_submit_s']:.2f} s after submit, target "
          f"{a_['target_s']:.2f} s (GPU work {a_['first_job_gpu_work_s']:.2f} + encode "
          f"{a_['first_job_encode_s']:.2f} + 2)")
    print(f"(b) 4x{args.steps}: first video {b_['first_video_after_submit_s']:.2f} s, target {b_['target_s']:.2f} s; "
          f"steady {b_['steady_s_per_job']:.2f} s/job = {b_['steady_over_gpu_work']:.3f}x GPU work")
    print(f"(c) after the high-priority submit the starts were {res['c_priority']['starts_after_the_high_submit']}; "
          f"busy {res['c_priority']['busy_first_to_last_video']}")
    print(f"standalone run: first video {res['standalone_dmd_1job']['first_video_after_submit_s']:.2f} s "
          f"({res['standalone_over_farm_first_video']:.1f}x the warm farm's)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sys.exit(main())
