#!/usr/bin/env python3
"""Benchmark the fast Wan2.2 VAE decoder against diffusers, all in one run.

Builds diffusers' ``AutoencoderKLWan`` (Wan2.2-TI2V-5B config) with PyTorch's default random init,
loads the same state dict into ours (``WanVAE``; the fast decoder reads it), and decodes one random
raw latent with:

- diffusers in bf16 (the stock path),
- ours (``FastWanDecoder``), uint8 ``[F, H, W, 3]`` output (what the pipeline asks for) and bf16
  ``[1, 3, F, H, W]`` output (for PSNR),
- the strict fp32 reference: diffusers in fp32 with TF32 off (convs and matmuls).

Prints per run: wall time (after a warm-up on a short clip with the same per-pass shapes, so
cuDNN's autotuning is not timed), peak memory (``max_memory_allocated`` during the call with only
that model resident: "total" includes its weights, "work" is above the pre-call allocation; both
include the output), PSNR against the strict reference, and the speed ratio vs diffusers bf16.

PSNR is ``10 log10(2^2 / MSE)`` over the [-1, 1] video (peak-to-peak 2, i.e. the PSNR of the
[0, 1] image); uint8 outputs are compared with the strict reference put through the same uint8
formula, peak 255. Seed 0 runs at the full size; further seeds (other weights and latents) run at
``--second-seed-latent-frames`` latent frames to spare the ~71 s strict decode (0 = full size).

Example (one H200, ~3 min): ``python scripts/bench_vae_decode.py --seeds 0 1``
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

WAN22_VAE = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
    attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0, is_residual=True,
    in_channels=12, out_channels=12, patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
    latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
)  # fmt: skip
TINY_VAE = dict(WAN22_VAE, base_dim=8, decoder_base_dim=16, z_dim=4, latents_mean=[0.0] * 4,
                latents_std=[1.0] * 4)  # --tiny: a CPU smoke run of this script
GIB = 1024**3
DEVICE = "cuda"
VAE_CFG: dict[str, Any] = WAN22_VAE


@dataclass
class Row:
    seed: int
    run: str
    clip: str
    seconds: float
    peak_total_gib: float
    peak_work_gib: float
    psnr_db: float | None = None
    speedup_vs_diffusers: float | None = None


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float, float, float]:
    """(output, seconds, peak total GiB, peak above the pre-call allocation GiB)."""
    gc.collect()
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        _sync()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    out = fn()
    _sync()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return out, dt, peak / GIB, (peak - base) / GIB


def psnr(a: torch.Tensor, ref: torch.Tensor, *, peak: float) -> float:
    """PSNR of ``a`` against ``ref`` (same shape), accumulated in fp64 chunk by chunk on the GPU."""
    if a.shape != ref.shape:
        raise ValueError(f"shape {tuple(a.shape)} != reference {tuple(ref.shape)}")
    dev = ref.device
    sse, n = 0.0, 0
    a_f, r_f = a.reshape(-1), ref.reshape(-1)
    step = 1 << 26
    for i in range(0, a_f.numel(), step):
        d = a_f[i : i + step].to(dev, torch.float64) - r_f[i : i + step].to(torch.float64)
        sse += float((d * d).sum())
        n += d.numel()
    mse = sse / n
    return float("inf") if mse == 0 else 10.0 * math.log10(peak * peak / mse)


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """[1, 3, F, H, W] in [-1, 1] -> uint8 [F, H, W, 3] (the pipeline's formula)."""
    return ((video[0].float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0)


def profile(fn: Callable[[], torch.Tensor]) -> None:
    """Top ops by GPU time, then every conv shape with its GPU time and TFLOP/s, then the ops that
    launched a pre-Hopper (sm80) cuDNN kernel, with their input shapes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with torch_profile(activities=acts, record_shapes=True) as prof:
        fn()
        _sync()
    key = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70), flush=True)
    if DEVICE != "cuda":
        return
    convs: dict[tuple, list[float]] = {}
    slow: dict[tuple, list[float]] = {}
    for ev in prof.events():
        if ev.name not in ("aten::cudnn_convolution", "aten::convolution_overrideable"):
            continue
        shapes = tuple(tuple(s) for s in ev.input_shapes[:2])
        gpu_us = sum(k.duration for k in ev.kernels)
        entry = convs.setdefault(shapes, [0, 0.0])
        entry[0] += 1
        entry[1] += gpu_us
        for k in ev.kernels:
            if "sm80" in k.name or "indexed" in k.name:
                e2 = slow.setdefault(shapes + (k.name[:90],), [0, 0.0])
                e2[0] += 1
                e2[1] += k.duration
    print("conv shapes (input [N, C, (T,) H, W], weight): calls, GPU ms, TFLOP/s", flush=True)
    total = 0.0
    for shapes, (calls, us) in sorted(convs.items(), key=lambda kv: -kv[1][1]):
        x, wt = shapes
        if len(x) == 5:
            out_pos = x[0] * (x[2] - wt[2] + 1) * x[3] * x[4]
        else:
            out_pos = x[0] * (x[2] + 2 - wt[2] + 1) * (x[3] + 2 - wt[3] + 1)
        flops = 2 * out_pos * math.prod(wt) * calls
        total += us
        print(f"  {x} x {wt}: {calls} calls, {us / 1e3:.1f} ms, {flops / (us * 1e-6) / 1e12:.0f} TFLOP/s", flush=True)
    print(f"  all convs: {total / 1e3:.1f} ms GPU", flush=True)
    for shapes, (calls, us) in slow.items():
        print(f"sm80/indexed kernel from conv {shapes[:2]}: {shapes[2]}: {calls} calls, {us / 1e3:.1f} ms", flush=True)


def tile_sweep(reps: int = 20) -> None:
    """GB/s of the row kernels (norm, phase combine) at the decoder's big shapes for each
    (elements per program, warps) tile: the data for ``vae_ops.ROW_TILES``."""
    from pan2render.kernels import vae_ops

    saved = dict(vae_ops.ROW_TILES)
    dt = torch.bfloat16
    cases = []
    for c, (t, h, w) in ((256, (4, 352, 624)), (512, (4, 352, 624)), (512, (4, 176, 312)), (1024, (2, 88, 156))):
        x = torch.randn(t, h, w, c, device=DEVICE, dtype=dt)
        buf = torch.empty(t + 2, h, w, c, device=DEVICE, dtype=dt)
        hist = torch.empty(2, h, w, c, device=DEVICE, dtype=dt)
        g = torch.rand(c, device=DEVICE) + 0.5
        b = torch.randn(c, device=DEVICE)
        res = torch.randn_like(x)

        def norm(x=x, buf=buf, hist=hist, g=g, b=b, t=t, h=h, w=w, res=res):
            vae_ops.rms_norm_act(x, g, bias=b, silu=True, out=buf[2:], hist=hist, hist_start=(t - 2) * h * w,
                                 residual=res)

        cases.append(("norm", f"C={c} {t}x{h}x{w} +res", norm, 5 * x.numel() * 2))  # x, res in; x, buf, (hist) out
    for cin, cout, (n, h, w) in ((512, 512, (4, 176, 312)), (1024, 1024, (2, 88, 156))):
        o = torch.randn(n, h + 1, w + 1, 4 * cout, device=DEVICE, dtype=dt)
        xs = torch.randn(n, h, w, cin, device=DEVICE, dtype=dt)
        idx = torch.randint(0, cin, (1, 2, 2, cout), device=DEVICE, dtype=torch.int32)
        bias = torch.randn(cout, device=DEVICE)

        def comb(o=o, xs=xs, idx=idx, bias=bias):
            vae_ops.upsample_phase_combine(o, bias, xs, idx, r=1)

        cases.append(("combine", f"{cin}->{cout} {n}x{h}x{w}", comb, 2 * o.numel() * 2 + xs.numel() * 2))
    for kernel, label, fn, nbytes in cases:
        line = []
        for elems in (2048, 4096, 8192, 16384):
            for warps in (4, 8):
                vae_ops.ROW_TILES[kernel] = (elems, warps)
                fn()
                torch.cuda.synchronize()
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(reps):
                    fn()
                t1.record()
                torch.cuda.synchronize()
                ms = t0.elapsed_time(t1) / reps
                line.append(f"{elems}/{warps}w {nbytes / ms / 1e6:.0f}")
        vae_ops.ROW_TILES.update(saved)
        print(f"tile sweep {kernel} {label} (GB/s by elems/warps): " + ", ".join(line), flush=True)


def build_state(seed: int) -> dict[str, torch.Tensor]:
    """A Wan2.2 VAE state dict with PyTorch's default init (on the GPU: fast), kept on the CPU."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = AutoencoderKLWan(**VAE_CFG)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    del model
    return state


def diffusers_vae(state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        model = AutoencoderKLWan(**VAE_CFG)
    model.load_state_dict(state, assign=True)
    return model.to(DEVICE, dtype).eval()


def ours_decoder(state: dict[str, torch.Tensor]) -> tuple[Any, str]:
    """FastWanDecoder on the GPU from our WanVAE (same state dict); diffusers' if ours is missing."""
    from pan2render.kernels.vae_decode import FastWanDecoder

    try:
        from pan2render.models.vae import WanVAE, WanVAEConfig

        fields = {k: v for k, v in VAE_CFG.items() if k != "dropout"}
        with torch.device("meta"):
            vae = WanVAE(WanVAEConfig(**fields))
        vae.load_state_dict(state, assign=True)
        source = "pan2render WanVAE"
    except ImportError:
        from diffusers import AutoencoderKLWan

        with torch.device("meta"):
            vae = AutoencoderKLWan(**VAE_CFG)
        vae.load_state_dict(state, assign=True)
        source = "diffusers AutoencoderKLWan (pan2render.models.vae not importable)"
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # CPU: the --tiny smoke run
    return FastWanDecoder.from_vae(vae, device=DEVICE, dtype=dtype), source


def diffusers_decode(model: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.decode(z.to(next(model.parameters()).dtype)).sample


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latent-frames", type=int, default=31, help="T (31 -> 121 frames)")
    ap.add_argument("--latent-height", type=int, default=44, help="h (44 -> 704 px)")
    ap.add_argument("--latent-width", type=int, default=78, help="w (78 -> 1248 px)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--second-seed-latent-frames", type=int, default=6,
                    help="latent frames for seeds after the first (0 = full clip)")
    ap.add_argument("--skip-diffusers", action="store_true")
    ap.add_argument("--skip-strict", action="store_true")
    ap.add_argument("--strict-latent-frames", type=int, default=0,
                    help="decode the strict reference (and PSNR) on this many latent frames only (0 = same clip)")
    ap.add_argument("--json", type=str, default="", help="write the rows here")
    ap.add_argument("--profile", action="store_true",
                    help="also profile ours with torch.profiler: top kernels by GPU time")
    ap.add_argument("--benchmark-limit", type=int, default=None,
                    help="torch.backends.cudnn.benchmark_limit for this process (cuDNN engines tried per conv "
                         "shape; 0 = all); default: torch's. Applies per process: cuDNN caches its choice")
    ap.add_argument("--tile-sweep", action="store_true", help="time the row kernels' tiles (vae_ops.ROW_TILES)")
    ap.add_argument("--tiles", type=str, default="",
                    help="override vae_ops.ROW_TILES for this run, e.g. norm=8192x8,combine=4096x4")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny random VAE (runs on CPU too): checks this script, not the speed")
    args = ap.parse_args(argv)
    global DEVICE, VAE_CFG
    if args.tiny:
        VAE_CFG = TINY_VAE
    if not torch.cuda.is_available():
        if not args.tiny:
            print("bench_vae_decode: needs a CUDA GPU (or --tiny); skipping")
            return 0
        DEVICE = "cpu"

    import diffusers
    import triton

    from pan2render.kernels import vae_ops

    for item in filter(None, args.tiles.split(",")):
        name, spec = item.split("=")
        elems, warps = spec.split("x")
        vae_ops.ROW_TILES[name] = (int(elems), int(warps))
    if args.tile_sweep and DEVICE == "cuda":
        tile_sweep()
    if args.benchmark_limit is not None:
        torch.backends.cudnn.benchmark_limit = args.benchmark_limit
    torch.backends.cudnn.benchmark = False  # diffusers' default; ours turns it on inside its call
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "diffusers": diffusers.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "row_tiles": dict(vae_ops.ROW_TILES),
        "cudnn_benchmark_limit": torch.backends.cudnn.benchmark_limit,
    }
    print("env:", json.dumps(env), flush=True)
    rows: list[Row] = []
    for si, seed in enumerate(args.seeds):
        n = args.latent_frames if si == 0 or args.second_seed_latent_frames == 0 else args.second_seed_latent_frames
        h, w = args.latent_height, args.latent_width
        clip = f"{16 * h}x{16 * w}x{1 + 4 * (n - 1)}"
        state = build_state(seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        z = torch.randn(1, VAE_CFG["z_dim"], n, h, w, generator=gen).to(DEVICE)
        warm = z[:, :, :3]  # pass shapes for the warm-ups
        outs: dict[str, torch.Tensor] = {}
        t_diff = None

        if not args.skip_diffusers:
            model = diffusers_vae(state, torch.bfloat16)
            diffusers_decode(model, warm)
            out, dt, pk, pw = timed(lambda: diffusers_decode(model, z))  # noqa: F821 - bound above (ruff reads the del below as unbinding it)
            outs["diffusers bf16"] = out.cpu()
            del out, model
            t_diff = dt
            rows.append(Row(seed, "diffusers bf16", clip, dt, pk, pw))
            print(f"[seed {seed}] diffusers bf16 {clip}: {dt:.3f} s, peak {pk:.2f} GiB", flush=True)

        dec, source = ours_decoder(state)
        print(f"[seed {seed}] ours built from {source}", flush=True)
        dec.decode(z[:, :, :2], out_dtype=torch.uint8)  # cuDNN autotune (first chunk and steady-state shapes)
        for odt in (torch.uint8, torch.bfloat16):
            name = f"ours {'uint8' if odt == torch.uint8 else 'bf16'}"
            out, dt, pk, pw = timed(lambda: dec.decode(z, out_dtype=odt))  # noqa: F821 - bound above (ruff reads the del below as unbinding it)
            outs[name] = out.cpu()
            del out
            sp = t_diff / dt if t_diff else None
            rows.append(Row(seed, name, clip, dt, pk, pw, speedup_vs_diffusers=sp))
            print(f"[seed {seed}] {name} {clip}: {dt:.3f} s, peak {pk:.2f} GiB (work {pw:.2f})"
                  + (f", {sp:.2f}x diffusers" if sp else ""), flush=True)
        if args.profile and si == 0:
            profile(lambda: dec.decode(z, out_dtype=torch.uint8))  # noqa: F821 - bound above (ruff reads the del below as unbinding it)
        del dec

        if not args.skip_strict:
            ns = args.strict_latent_frames or n
            tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
            model = diffusers_vae(state, torch.float32)
            zs = z[:, :, :ns]
            ref, dt, pk, pw = timed(lambda: diffusers_decode(model, zs))
            del model
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
            fs = ref.shape[2]
            rows.append(Row(seed, "strict fp32 (no TF32)", f"{16 * h}x{16 * w}x{fs}", dt, pk, pw))
            print(f"[seed {seed}] strict fp32 {fs} frames: {dt:.3f} s", flush=True)
            ref_u8 = None
            for row in rows:
                if row.seed != seed or row.run not in outs:
                    continue
                o = outs[row.run]
                if o.dtype == torch.uint8:
                    if ref_u8 is None:
                        ref_u8 = to_uint8_frames(ref).float()
                    row.psnr_db = psnr(o[:fs].float(), ref_u8, peak=255.0)
                else:
                    row.psnr_db = psnr(o[:, :, :fs], ref, peak=2.0)
                print(f"[seed {seed}] PSNR {row.run}: {row.psnr_db:.2f} dB (first {fs} frames)", flush=True)
            del ref, ref_u8
        del outs, z, state
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    print(f"\n{'seed':>4} {'run':<38} {'clip':<15} {'time s':>8} {'peak GiB':>9} {'work GiB':>9} "
          f"{'PSNR dB':>8} {'x diff':>7}")
    for r in rows:
        ps = f"{r.psnr_db:8.2f}" if r.psnr_db is not None else f"{'-':>8}"
        sp = f"{r.speedup_vs_diffusers:7.2f}" if r.speedup_vs_diffusers else f"{'-':>7}"
        print(f"{r.seed:>4} {r.run:<38} {r.clip:<15} {r.seconds:8.3f} {r.peak_total_gib:9.2f} "
              f"{r.peak_work_gib:9.2f} {ps} {sp}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
