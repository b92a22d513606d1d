"""Batch throughput: ``pan2-render run`` on N jobs vs diffusers' own loop, same checkpoint, one run.

    python scripts/bench_batch.py --out bench-out                   # one H200: (a) then (b)
    python scripts/bench_batch.py --out bench-out --diffusers-device cuda:1   # (a) on GPU 0 and
                                                                    # (b) on GPU 1 at the same time
    python scripts/bench_batch.py --out bench-out --gpus 2 --skip-diffusers   # a group of 2
    python scripts/bench_batch.py --out bench-out --n 3 --steps 8 --diffusers-mode expert --diffusers-timeout 300
                                                                    # only the expert peer, bounded
    python scripts/bench_batch.py --out /tmp/bb --tiny              # CPU smoke at toy size

1. A full-size random-weight Wan2.2-TI2V-5B checkpoint in the diffusers layout (DiT and VAE fp32,
   umT5-XXL bf16, sharded as a release is; built on the GPU, no per-parameter CPU init), written
   once into --checkpoint (default ``$PAN2_RENDER_CACHE/bench/wan22-ti2v-5b-random``) and reused.
2. (a) ``python -m pan2render.runner.cli.main run`` on a batch of N jobs (distinct prompts and seeds).
   From its ledger: per-stage seconds per job, first-video time, steady-state seconds per job
   ((t_last_done - t_first_done) / (N - 1)); from NVML (or nvidia-smi), sampled on a thread: GPU
   busy fraction and peak memory.
3. (b) diffusers' loop, one subprocess per --diffusers-mode variant (a crash or a --diffusers-timeout
   in one keeps (a)'s and the other's figures): WanPipeline with a bf16 transformer and an fp32 VAE
   (as its example runs it), one pipeline, N calls, each video encoded with PyAV at the same
   settings (``encode_mp4``: crf 18, the same x264 preset). ``eager`` runs it as it comes;
   ``expert`` first sets the transformer up as an expert runs it (scripts/diffusers_peer.py: cuDNN
   attention, compile_repeated_blocks(fullgraph=True); on a CPU diffusers' default attention, since
   cuDNN attention needs CUDA), so its first call pays the compile: the first generate is reported
   apart from the later ones, and steady s/job leaves the first job out. Each variant writes
   OUT/diffusers_<variant>.json after its load and after every job.
Every phase logs with a timestamp; the results go to OUT/bench_batch.json as each phase ends, and a
table is printed at the end with the ratios of each diffusers variant's seconds to pan2-render's
(steady s/job and whole command; above 1: pan2-render is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout: pan2render need not be installed
sys.path.insert(0, str(Path(__file__).resolve().parent))  # diffusers_peer, beside this script

GIB = 1024**3
DIFFUSERS_MODES = {"eager": ["eager"], "expert": ["expert"], "both": ["eager", "expert"]}
PROMPTS = [
    "A red fox trots through fresh snow at dawn, breath steaming in the cold air.",
    "Fishing boats rock gently in a harbour at dusk, lanterns reflecting on the water.",
    "A hummingbird hovers at a purple flower, wings a blur, in slow motion.",
    "Rain streams down a café window at night while traffic lights blur behind it.",
    "A paper boat drifts down a gutter stream after a summer storm.",
    "Waves crash against black volcanic rocks under a stormy sky.",
    "A steam locomotive crosses a stone viaduct in the mountains in autumn.",
    "Lanterns rise into the night sky over a crowded river festival.",
]
NEGATIVE = "blurry, low quality, distorted"

# Wan2.2-TI2V-5B's released configs (diffusers / transformers names).
DIT_CONFIG = dict(
    patch_size=[1, 2, 2], num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
    text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
    pos_embed_seq_len=None,
)  # fmt: skip
VAE_CONFIG = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0, is_residual=True, in_channels=12, out_channels=12,
    patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
    latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
)  # fmt: skip
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", dropout_rate=0.0, layer_norm_epsilon=1e-6,
                tie_word_embeddings=False)
# --tiny: the same writer at toy size on the CPU (the tiny model's configs, shards forced).
TINY_UMT5 = dict(UMT5_XXL, vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 relative_attention_num_buckets=8, relative_attention_max_distance=32)


@dataclass(frozen=True)
class CheckpointSpec:
    dit: dict[str, Any]
    vae: dict[str, Any]
    text: dict[str, Any]
    device: str
    shard: str  # max_shard_size of save_pretrained


FULL_CHECKPOINT = CheckpointSpec(DIT_CONFIG, VAE_CONFIG, UMT5_XXL, "cuda", "5GB")
T0 = time.monotonic()


def log(msg: str) -> None:
    now = datetime.now(timezone.utc).strftime("%H:%M:%S")
    print(f"[{now} +{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------ checkpoint
def tiny_checkpoint_spec() -> CheckpointSpec:
    from pan2render.models.tiny import TINY_DIT_CONFIG, TINY_VAE_CONFIG

    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("_")}  # noqa: E731
    return CheckpointSpec(strip(TINY_DIT_CONFIG), strip(TINY_VAE_CONFIG), TINY_UMT5, "cpu", "20KB")


def write_checkpoint(root: Path, spec: CheckpointSpec) -> None:
    """Random-weight Wan2.2-TI2V-5B in the diffusers layout, built on the device and saved sharded."""
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from pan2render.models.tiny import MODEL_INDEX, SCHEDULER_CONFIG, build_tokenizer

    staging = root.with_name(f".{root.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    torch.manual_seed(0)
    for name, make, dtype in (
        ("transformer", lambda: WanTransformer3DModel(**spec.dit), torch.float32),
        ("vae", lambda: AutoencoderKLWan(**spec.vae), torch.float32),
    ):
        t = time.monotonic()
        with torch.device(spec.device):  # default init runs on the GPU: seconds, not minutes
            model = make().to(dtype)
        model.save_pretrained(str(staging / name), max_shard_size=spec.shard, safe_serialization=True)
        log(f"  {name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, "
            f"{time.monotonic() - t:.0f} s")
        del model
    t = time.monotonic()
    tok = build_tokenizer(spec.text["vocab_size"])
    tok.save_pretrained(str(staging / "tokenizer"))
    config = UMT5Config(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=False,
                        use_cache=False, **spec.text)
    with torch.device(spec.device):
        encoder = UMT5EncoderModel(config).to(torch.bfloat16 if spec.device == "cuda" else torch.float32)
    encoder.save_pretrained(str(staging / "text_encoder"), max_shard_size=spec.shard, safe_serialization=True)
    log(f"  text_encoder: {sum(p.numel() for p in encoder.parameters()) / 1e9:.2f} B params, "
        f"{time.monotonic() - t:.0f} s")
    del encoder
    (staging / "scheduler").mkdir()
    (staging / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2))
    (staging / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    shutil.rmtree(root, ignore_errors=True)
    os.rename(staging, root)
    if spec.device == "cuda":
        # The models were freed but PyTorch's allocator keeps their blocks (~37 GiB) reserved in this
        # process for as long as it lives, and NVML's peak memory of every later phase would count them.
        torch.cuda.empty_cache()


def checkpoint(args: argparse.Namespace) -> Path:
    from pan2render.models.tiny import cache_root

    name = "tiny-random" if args.tiny else "wan22-ti2v-5b-random"
    root = Path(args.checkpoint or cache_root() / "bench" / name).expanduser().resolve()
    if (root / "model_index.json").is_file():
        log(f"checkpoint: reusing {root}")
        return root
    log(f"checkpoint: writing a random-weight {name} into {root} (once)")
    write_checkpoint(root, tiny_checkpoint_spec() if args.tiny else FULL_CHECKPOINT)
    log(f"checkpoint: written ({sum(f.stat().st_size for f in root.rglob('*') if f.is_file()) / GIB:.1f} GiB)")
    return root


# ------------------------------------------------------------------------------------ GPU sampler
@dataclass
class GpuSampler:
    """Utilisation and memory of the given GPUs every ``period_s``, on a thread (NVML, else
    nvidia-smi). ``samples``: (monotonic time, device index, utilisation %, memory used bytes)."""

    devices: list[int]
    period_s: float = 0.1
    samples: list[tuple[float, int, float, float]] = field(default_factory=list)
    source: str = "none"

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "GpuSampler":
        read = self._nvml() or self._smi()
        if read is None:
            log("gpu sampler: neither NVML nor nvidia-smi answers; no busy fraction / peak memory")
            return self

        def loop() -> None:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    for dev, util, mem in read():
                        self.samples.append((t, dev, util, mem))
                except Exception as e:  # a sampler must never stop the benchmark
                    log(f"gpu sampler: {type(e).__name__}: {e}; stopping")
                    return
                self._stop.wait(self.period_s)

        self._thread = threading.Thread(target=loop, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def _nvml(self) -> Any:
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            handles = {d: pynvml.nvmlDeviceGetHandleByIndex(d) for d in self.devices}
        except Exception:
            return None
        self.source = "nvml"
        return lambda: [(d, float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
                         float(pynvml.nvmlDeviceGetMemoryInfo(h).used)) for d, h in handles.items()]

    def _smi(self) -> Any:
        if shutil.which("nvidia-smi") is None:
            return None
        self.source = "nvidia-smi"
        ids = ",".join(map(str, self.devices))

        def read() -> list[tuple[int, float, float]]:
            out = subprocess.run(["nvidia-smi", f"--id={ids}", "--query-gpu=index,utilization.gpu,memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
            rows = [line.split(",") for line in out.stdout.strip().splitlines()]
            return [(int(r[0]), float(r[1]), float(r[2]) * 1024**2) for r in rows]

        return read

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def summary(self, t0: float, t1: float, devices: list[int]) -> dict[str, Any]:
        """Mean utilisation (busy fraction) and peak memory of ``devices`` within [t0, t1]."""
        rows = [s for s in self.samples if t0 <= s[0] <= t1 and s[1] in devices]
        if not rows:
            return {"busy_fraction": None, "peak_mem_gib": None, "samples": 0, "source": self.source}
        return {"busy_fraction": sum(r[2] for r in rows) / len(rows) / 100.0,
                "peak_mem_gib": max(r[3] for r in rows) / GIB, "samples": len(rows), "source": self.source}


# ------------------------------------------------------------------------------------ (a) pan2-render
def job_fields(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--job-field {pair!r}: expected KEY=YAML, e.g. sampler=euler")
        out[key] = yaml.safe_load(value)
    return out


def write_batch(path: Path, ckpt: Path, args: argparse.Namespace) -> None:
    defaults = {"negative_prompt": NEGATIVE, "steps": args.steps, "guidance": args.guidance,
                "height": args.height, "width": args.width, "frames": args.frames, "gpus": args.gpus,
                **job_fields(args.job_field)}
    jobs = [{"name": f"job{i}", "prompt": PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})"),
             "seed": i} for i in range(args.n)]
    doc = {"model": str(ckpt), "preset": "tiny-preview" if args.tiny else "pan2-720p", "defaults": defaults,
           "jobs": jobs}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def cuda_env(visible: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def run_pan2(args: argparse.Namespace, ckpt: Path, out: Path, visible: str | None) -> dict[str, Any]:
    batch = out / "batch.yaml"
    render = out / "render"
    shutil.rmtree(render, ignore_errors=True)
    write_batch(batch, ckpt, args)
    cmd = [sys.executable, "-m", "pan2render.runner.cli", "run", str(batch), "--out", str(render), "--no-progress"]
    if args.tiny:
        cmd += ["--cpu-gpus", str(args.gpus)]
    log(f"(a) pan2-render: {' '.join(cmd)}  (CUDA_VISIBLE_DEVICES={visible or 'all'})")
    start_wall = time.time()
    t0 = time.monotonic()
    with open(out / "pan2_render.log", "w") as logf:
        proc = subprocess.Popen(cmd, env=cuda_env(visible), stdout=logf, stderr=subprocess.STDOUT, text=True)
        rc = proc.wait()
    t1 = time.monotonic()
    log(f"(a) pan2-render exited {rc} after {t1 - t0:.1f} s (log: {out / 'pan2_render.log'})")
    res: dict[str, Any] = {"rc": rc, "command_s": t1 - t0, "t0": t0, "t1": t1}
    res.update(ledger_figures(render, start_wall=start_wall, n=args.n))
    return res


def ledger_figures(render: Path, *, start_wall: float, n: int) -> dict[str, Any]:
    from pan2render.jobs.ledger import JobState, Ledger, Stage

    if not (render / "ledger.sqlite").is_file():
        return {"error": "no ledger written"}
    led = Ledger.open_readonly(render)
    try:
        jobs = led.jobs()
        per_job, done_at = [], []
        for j in jobs:
            st = led.stages(j.id)
            row = {"job": j.name, "state": j.state.value}
            row.update({s.value: st[s].seconds for s in Stage})
            finish = [e.at for e in led.events(j.id) if e.label == "running->done"]
            encode = [e.detail for e in led.events(j.id) if e.label == "encode"]
            row["done_after_s"] = (finish[-1] - start_wall) if finish else None
            row["encode_detail"] = encode[-1] if encode else None
            per_job.append(row)
            if j.state is JobState.DONE and finish:
                done_at.append(finish[-1] - start_wall)
        loads = [e.detail for e in led.events() if e.label == "group-load"]
    finally:
        led.close()
    done_at.sort()
    res: dict[str, Any] = {"jobs": per_job, "loads": loads, "done": len(done_at)}
    if done_at:
        res["first_video_s"] = done_at[0]
        res["last_video_s"] = done_at[-1]
    if len(done_at) >= 2:
        res["steady_s_per_job"] = (done_at[-1] - done_at[0]) / (len(done_at) - 1)
    # Steady-state GPU work of a job: sampling + decode, median over all but the first job.
    gpu = sorted(r["sampling"] + r["decode"] for r in per_job[1:] if r["sampling"] and r["decode"])
    if gpu:
        res["gpu_work_s_per_job"] = gpu[len(gpu) // 2]
    return res


# ------------------------------------------------------------------------------------ (b) diffusers
def diffusers_main(args: argparse.Namespace) -> int:
    """The diffusers loop of one variant (``--diffusers-mode`` eager or expert), run as a subprocess
    of this script; writes OUT/diffusers_<variant>.json after the load and after every job, so a
    crash or a timeout keeps what was done."""
    import numpy as np
    import torch

    from pan2render.media.video import encode_mp4

    variant = args.diffusers_mode
    out = Path(args.out)
    device = torch.device(args.diffusers_device if not args.tiny else "cpu")
    res: dict[str, Any] = {"variant": variant, "device": str(device), "jobs": []}
    result_file = out / f"diffusers_{variant}.json"

    def save() -> None:
        result_file.write_text(json.dumps(res, indent=1))

    start = time.monotonic()
    ckpt = Path(args.checkpoint)
    dtype = torch.bfloat16 if not args.tiny else torch.float32
    pipe = load_diffusers_pipeline(ckpt, dtype=dtype, device=device)
    res["load_s"] = time.monotonic() - start
    log(f"(b) diffusers {variant}: pipeline loaded on {device} in {res['load_s']:.1f} s")
    if variant == "expert":
        from diffusers_peer import make_expert

        res["expert"] = make_expert(pipe.transformer, device)
        log(f"(b) diffusers expert: attention {res['expert']['attention']}, {res['expert']['compile']}"
            + (f" ({res['expert']['attention_note']})" if res["expert"]["attention_note"] else "")
            + "; the compile runs in the first job's generate")
    save()
    videos = out / f"diffusers_{variant}_videos"
    videos.mkdir(exist_ok=True)
    preset = job_fields(args.job_field).get("encode_preset")
    for i in range(args.n):
        t = time.monotonic()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        frames = pipe(prompt=PROMPTS[i % len(PROMPTS)], negative_prompt=NEGATIVE, height=args.height,
                      width=args.width, num_frames=args.frames, num_inference_steps=args.steps,
                      guidance_scale=args.guidance, generator=torch.Generator("cpu").manual_seed(i),
                      output_type="np").frames[0]  # float [F, H, W, 3] in [0, 1]
        gen_s = time.monotonic() - t
        video = (np.asarray(frames) * 255.0).round().clip(0, 255).astype(np.uint8)
        t2 = time.monotonic()
        kwargs = {"preset": preset} if preset else {}
        encode_mp4(video, videos / f"job{i}.mp4", fps=24 if not args.tiny else 8, crf=18, **kwargs)
        res["jobs"].append({"job": f"job{i}", "generate_s": gen_s, "encode_s": time.monotonic() - t2,
                            "done_after_s": time.monotonic() - start})
        log(f"(b) diffusers {variant} job{i}: generate {gen_s:.1f} s, encode {time.monotonic() - t2:.1f} s")
        if device.type == "cuda":
            res["torch_peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        save()
    return 0


def load_diffusers_pipeline(ckpt: Path, *, dtype: Any, device: Any) -> Any:
    """WanPipeline as diffusers' example runs it: the transformer in ``dtype``, the VAE in fp32."""
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(str(ckpt), subfolder="vae", torch_dtype=torch.float32)
    transformer = load_diffusers_transformer(ckpt, dtype=dtype, device=device)
    pipe = WanPipeline.from_pretrained(str(ckpt), vae=vae, transformer=transformer, torch_dtype=dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_diffusers_transformer(ckpt: Path, *, dtype: Any, device: Any) -> Any:
    """diffusers' own from_pretrained; where it refuses (a bf16 model keeps some modules in fp32,
    which diffusers only does through accelerate), the same by hand: the model from its config on
    the device, the shards' tensors loaded, its fp32 modules (``_keep_in_fp32_modules``) kept fp32."""
    import torch
    from diffusers import WanTransformer3DModel

    from pan2render.models.loading import read_state_dict

    try:
        return WanTransformer3DModel.from_pretrained(str(ckpt), subfolder="transformer", torch_dtype=dtype)
    except ValueError as e:
        if "low_cpu_mem_usage" not in str(e):
            raise
        log(f"(b) diffusers refuses ({e}); loading the transformer by hand")
    folder = ckpt / "transformer"
    with torch.device(device):
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(str(folder))).to(dtype)
    state, _ = read_state_dict(folder, device=device)
    model.load_state_dict(state, strict=True)
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, param in model.named_parameters():
        if any(k in name for k in keep):
            param.data = param.data.float()
    return model.eval()


def run_diffusers(args: argparse.Namespace, ckpt: Path, out: Path, visible: str | None,
                  device_inside: str, variant: str) -> dict[str, Any]:
    """One variant of diffusers' loop in a subprocess; its figures, whatever it got to write."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", "diffusers", "--diffusers-mode", variant,
           "--out", str(out),
           "--checkpoint", str(ckpt), "--n", str(args.n), "--steps", str(args.steps), "--guidance", str(args.guidance),
           "--height", str(args.height), "--width", str(args.width), "--frames", str(args.frames),
           "--diffusers-device", device_inside, *sum((["--job-field", f] for f in args.job_field), [])]
    if args.tiny:
        cmd.append("--tiny")
    log(f"(b) diffusers {variant} loop: subprocess on {device_inside} (CUDA_VISIBLE_DEVICES={visible or 'all'})")
    result_file, log_file = out / f"diffusers_{variant}.json", out / f"diffusers_{variant}.log"
    result_file.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(log_file, "w") as logf:
        try:
            rc: int | str = subprocess.run(cmd, env=cuda_env(visible), stdout=logf, stderr=subprocess.STDOUT,
                                           text=True, timeout=args.diffusers_timeout or None).returncode
        except subprocess.TimeoutExpired:  # subprocess.run has killed it; its jobs so far are on file
            rc = "timeout"
    t1 = time.monotonic()
    log(f"(b) diffusers {variant} loop exited {rc} after {t1 - t0:.1f} s (log: {log_file})")
    res: dict[str, Any] = {"rc": rc, "command_s": t1 - t0, "t0": t0, "t1": t1}
    if result_file.is_file():
        res.update(json.loads(result_file.read_text()))
        done = [j["done_after_s"] for j in res["jobs"]]
        if done and rc == 0:
            # The command's own start-up (imports) is part of its wall, as it is of pan2-render's.
            res["last_video_s"] = t1 - t0
            res["first_video_s"] = done[0] + (t1 - t0 - done[-1])
        if len(done) >= 2:
            res["steady_s_per_job"] = (done[-1] - done[0]) / (len(done) - 1)
        gen = [j["generate_s"] for j in res["jobs"]]
        if len(gen) >= 2:
            # The expert's first call compiles; what it costs over a later call is the compile's
            # (and the first call's other warm-ups, which the eager loop shows alone).
            later = sorted(gen[1:])[len(gen[1:]) // 2]
            res.update(first_generate_s=gen[0], later_generate_median_s=later, first_generate_extra_s=gen[0] - later)
    return res


# ------------------------------------------------------------------------------------ report
def table(res: dict[str, Any]) -> str:
    a, b, e = res.get("pan2", {}), res.get("diffusers", {}), res.get("diffusers_expert", {})
    lines = [f"batch: {res['args']['n']} x {res['args']['width']}x{res['args']['height']}x{res['args']['frames']}, "
             f"{res['args']['steps']} steps, guidance {res['args']['guidance']}, gpus {res['args']['gpus']}, "
             f"job fields {res['args']['job_field'] or '-'}",
             f"{'job':8} {'cond':>6} {'sample':>8} {'decode':>7} {'encode':>7} {'done at':>8}"]
    for r in a.get("jobs", []):
        lines.append(f"{r['job']:8} {_f(r['conditioning'])} {_f(r['sampling'], 8)} {_f(r['decode'], 7)} "
                     f"{_f(r['encode'], 7)} {_f(r['done_after_s'], 8)}")

    def row(name: str, key: str) -> str:
        return f"{name:34} {_f(a.get(key), 9)} {_f(b.get(key), 10)} {_f(e.get(key), 10)}"

    def ratio(name: str, key: str) -> str:
        return f"{name:34} {'':9} {_f(res.get(key), 10, 3)} {_f(res.get(key + '_expert'), 10, 3)}"

    lines += [f"{'':34} {'pan2':>9} {'diffusers':>10} {'expert':>10}",
              row("command wall (start -> last mp4) s", "last_video_s"),
              row("first video s", "first_video_s"),
              row("steady state s/job", "steady_s_per_job"),
              row("first generate (expert: compile) s", "first_generate_s"),
              row("later generates, median s", "later_generate_median_s"),
              f"{'GPU work (sampling+decode) s/job':34} {_f(a.get('gpu_work_s_per_job'), 9)}",
              f"{'steady / GPU work':34} {_f(res.get('steady_over_gpu_work'), 9, 3)}",
              f"{'GPU busy fraction (whole command)':34} {_f(a.get('gpu', {}).get('busy_fraction'), 9, 3)} "
              f"{_f(b.get('gpu', {}).get('busy_fraction'), 10, 3)} {_f(e.get('gpu', {}).get('busy_fraction'), 10, 3)}",
              f"{'GPU busy fraction (first->last mp4)':34} {_f(a.get('gpu_steady', {}).get('busy_fraction'), 9, 3)}",
              f"{'peak GPU memory GiB':34} {_f(a.get('gpu', {}).get('peak_mem_gib'), 9)} "
              f"{_f(b.get('gpu', {}).get('peak_mem_gib'), 10)} {_f(e.get('gpu', {}).get('peak_mem_gib'), 10)}",
              ratio("diffusers steady / pan2 steady", "steady_ratio_vs_diffusers"),
              ratio("diffusers wall / pan2 wall", "speedup_vs_diffusers")
              + ("   (run at the same time, other GPU)" if res.get("concurrent") else "")]
    for name, r in (("diffusers", b), ("expert", e)):
        if r and r.get("rc") != 0:
            lines.append(f"{name}: exited {r.get('rc')} after {len(r.get('jobs', []))} of {res['args']['n']} jobs")
    for load in a.get("loads", []):
        lines.append(f"load: {load}")
    return "\n".join(lines)


def _f(v: Any, width: int = 6, digits: int = 1) -> str:
    return f"{v:{width}.{digits}f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="results folder (JSON, logs, videos)")
    p.add_argument("--checkpoint", type=Path, help="the random checkpoint folder (written once, then reused)")
    p.add_argument("--n", type=int, default=4, help="jobs in the batch (default 4)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=2.5)
    p.add_argument("--height", type=int, default=704)
    p.add_argument("--width", type=int, default=1248)
    p.add_argument("--frames", type=int, default=121)
    p.add_argument("--gpus", type=int, choices=(1, 2), default=1, help="group size of the batch's jobs")
    p.add_argument("--job-field", action="append", default=[], metavar="KEY=YAML",
                   help="a field for the batch's defaults, verbatim (repeatable), e.g. sampler=euler")
    p.add_argument("--skip-diffusers", action="store_true")
    p.add_argument("--diffusers-mode", choices=sorted(DIFFUSERS_MODES), default="both",
                   help="diffusers' loop as it comes (eager), as an expert runs it (expert: cuDNN attention, "
                        "compiled blocks), or both, one after the other (default)")
    p.add_argument("--diffusers-timeout", type=float, default=0,
                   help="seconds each diffusers variant may run before it is killed (0: no limit)")
    p.add_argument("--diffusers-device", default="cuda:0",
                   help="GPU of the diffusers loop; another than cuda:0 runs it at the same time as (a)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: the embedded tiny model, toy size")
    p.add_argument("--phase", choices=("all", "diffusers"), default="all", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.n < 1 or args.steps < 1:
        p.error("--n and --steps must be >= 1")
    if args.tiny:
        args.height, args.width, args.frames = min(args.height, 64), min(args.width, 64), min(args.frames, 17)
        args.steps = min(args.steps, 4)
    if args.phase == "diffusers":
        if args.diffusers_mode not in ("eager", "expert"):
            p.error("--phase diffusers runs one variant: --diffusers-mode eager or expert")
        return diffusers_main(args)

    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    dev_index = int(args.diffusers_device.split(":")[1]) if ":" in args.diffusers_device else 0
    concurrent = not args.skip_diffusers and not args.tiny and dev_index != 0
    if concurrent and args.gpus != 1:
        p.error("--diffusers-device other than cuda:0 runs diffusers beside a 1-GPU batch; with --gpus 2 "
                "run them one after the other (--diffusers-device cuda:0)")
    res: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "concurrent": concurrent, "host": os.uname().nodename,
                           "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    results = out / "bench_batch.json"

    lock = threading.Lock()  # with --diffusers-device cuda:1 the diffusers variants record from a thread

    def save(**phase: Any) -> None:
        with lock:
            res.update(phase)
            results.write_text(json.dumps(res, indent=1, default=str))

    variants = [] if args.skip_diffusers else DIFFUSERS_MODES[args.diffusers_mode]

    def run_variants(visible: str | None, device_inside: str) -> None:
        # eager's figures stay under "diffusers", as before the expert variant existed
        for variant in variants:
            key = "diffusers" if variant == "eager" else "diffusers_expert"
            save(**{key: run_diffusers(args, ckpt, out, visible=visible, device_inside=device_inside,
                                       variant=variant)})

    ckpt = checkpoint(args)
    res["checkpoint"] = str(ckpt)
    save()
    ours_gpus = list(range(args.gpus))
    sampler = GpuSampler(devices=sorted({*ours_gpus, dev_index})).start() if not args.tiny else None
    try:
        if concurrent:
            th = threading.Thread(target=run_variants, args=(str(dev_index), "cuda:0"))
            th.start()
            save(pan2=run_pan2(args, ckpt, out, visible="0"))
            th.join()
        else:
            # Only the batch's own GPUs: on a larger host Ray would otherwise spread 1-GPU jobs over
            # every GPU and the figures would no longer be one group's.
            save(pan2=run_pan2(args, ckpt, out, visible=None if args.tiny else ",".join(map(str, ours_gpus))))
            run_variants(visible=None, device_inside=args.diffusers_device)
    finally:
        if sampler is not None:
            sampler.stop()
    a = res.get("pan2", {})
    peers = {suffix: res[key] for key, suffix in (("diffusers", ""), ("diffusers_expert", "_expert")) if key in res}
    if sampler is not None:
        if "t0" in a:
            a["gpu"] = sampler.summary(a["t0"], a["t1"], ours_gpus)
            if a.get("first_video_s") is not None and a.get("last_video_s") is not None:
                first = a["t0"] + a["first_video_s"]
                a["gpu_steady"] = sampler.summary(first, a["t0"] + a["last_video_s"], ours_gpus)
        for b in peers.values():
            b["gpu"] = sampler.summary(b["t0"], b["t1"], [dev_index])
    if a.get("steady_s_per_job") and a.get("gpu_work_s_per_job"):
        res["steady_over_gpu_work"] = a["steady_s_per_job"] / a["gpu_work_s_per_job"]
    # Each diffusers variant's seconds over pan2-render's: above 1, pan2-render is faster.
    for suffix, b in peers.items():
        if a.get("steady_s_per_job") and b.get("steady_s_per_job"):
            res[f"steady_ratio_vs_diffusers{suffix}"] = b["steady_s_per_job"] / a["steady_s_per_job"]
        if a.get("last_video_s") and b.get("last_video_s"):
            res[f"speedup_vs_diffusers{suffix}"] = b["last_video_s"] / a["last_video_s"]
    save()
    print(table(res), flush=True)
    log(f"results: {results}")
    return 0 if a.get("rc") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
