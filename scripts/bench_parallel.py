#!/usr/bin/env python3
"""Benchmark sequence-parallel groups: a guided sampling step and the VAE decode, on one
GPU and on a group of N (default 2), in ONE run, printing the ratios and the memory per rank.

- DiT: the full-size random-weight PAN2 DiT (Wan2.2-TI2V-5B config) built directly on each GPU in
  bf16 (time embedder, modulation tables and norms kept in fp32, as the loader does), at
  704x1248x121 (latent 48x31x44x78 -> 26,598 tokens, 512 text tokens). A guided step = the
  conditional and the unconditional forward + the guidance combine + a flow update, through the
  pipeline's own denoisers (text K/V prepared once per job). Fused DiT kernels and the chosen
  attention backend are used where `pan2render.kernels` provides them (else the eager ops), the
  same on one GPU and in the group. Three layouts: one GPU (`make_denoiser`, rank 0 alone while the
  others wait); the group with both branches Ulysses-parallel over all ranks (`parallelize_dit` +
  `make_denoiser`); on even groups the guidance split (`GuidanceSplit`: one branch per half of the
  group), which is what `PAN2Pipeline` runs there by default. ``step_speedup`` is the default's.
- Decode: the full-size random-weight Wan2.2 VAE, raw latents 48x31x44x78 -> 121x704x1248 uint8.
  The ranks first agree on the fast decoder (`agree_fast_decode`); one GPU runs the shipped
  single-GPU decoder (`FastWanDecoder.decode`, or `WanVAE.decode` in bf16 on the reference path),
  the group runs the split decode (`split_decode`, what `pipelined_decode` runs) through a timing
  wrapper of the decoder's unit interface (`TimedDecoder`: busy seconds per rank, seconds per
  unit). The cut is the plan's cost model, and again from the units' seconds measured on one GPU.
  Both warm up on 3 latent frames (cuDNN autotuning) first.

Timings: the min of --reps, each between barriers, the group's time = the slowest rank. Memory:
`torch.cuda.max_memory_allocated` per rank and phase (weights included).

GPU host:   torchrun is not needed: python scripts/bench_parallel.py --json $OUT/parallel.json
CPU smoke:  python scripts/bench_parallel.py --tiny   (gloo, tiny sizes; checks the script only)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pan2render.kernels.vae_decode import fast_decoder_for
from pan2render.models.dit import PAN2DiT, PAN2DiTConfig
from pan2render.models.pipeline import DIT_KEEP_IN_FP32, make_denoiser
from pan2render.models.vae import WanVAE, WanVAEConfig
from pan2render.parallel import (
    GuidanceSplit,
    GuidanceSplitDenoiser,
    agree_fast_decode,
    parallelize_dit,
    parallelize_pipeline,
)
from pan2render.parallel.decode import split_decode
from pan2render.parallel.group import SequenceGroup
from pan2render.vae_plan import DecodeUnit, UnitDecoder

FULL = dict(frames=31, height=44, width=78, text=512)  # latent sizes of 704x1248x121
TINY = dict(frames=3, height=6, width=10, text=16)
TINY_DIT = dict(num_attention_heads=4, attention_head_dim=12, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)
TINY_VAE = dict(base_dim=8, decoder_base_dim=8, num_res_blocks=1)


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def timed(fn: Callable[[], Any], *, device: torch.device, reps: int, group: bool) -> tuple[float, Any]:
    """Min seconds over ``reps`` (each between barriers when ``group``); the slowest rank's time."""
    best, out = math.inf, None
    for _ in range(reps):
        out = None
        if group:
            dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        elapsed = time.perf_counter() - t0
        if group:
            t = torch.tensor([elapsed], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            elapsed = float(t.item())
        best = min(best, elapsed)
    return best, out


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peaks(device: torch.device, world: int) -> list[float]:
    """Peak GiB allocated on every rank since the last reset (all-gathered, rank order)."""
    mine = torch.tensor([torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0],
                        dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return [gib(float(p.item())) for p in parts]


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


# ---- DiT -----------------------------------------------------------------------------------------


def random_module(make: Callable[[], torch.nn.Module], device: torch.device, dtype: torch.dtype, *,
                  seed: int) -> torch.nn.Module:
    """``make()`` with random weights created directly on the device in dtype, in eval mode and
    without gradients (seeded: the same on every rank)."""
    prev = torch.get_default_dtype()
    torch.manual_seed(seed)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            module = make().eval()
    finally:
        torch.set_default_dtype(prev)
    return module.requires_grad_(False)


def build_dit(config: PAN2DiTConfig, device: torch.device, dtype: torch.dtype) -> PAN2DiT:
    """The random-weight DiT, with the loader's fp32 modules (`DIT_KEEP_IN_FP32`) in fp32."""
    model = random_module(lambda: PAN2DiT(config), device, dtype, seed=0)
    for name, p in model.named_parameters():
        if any(k in name for k in DIT_KEEP_IN_FP32):
            p.data = p.data.float()
    return model


def use_fast_paths(model: PAN2DiT, attention: str = "auto") -> str:
    """Fused DiT ops + the chosen attention backend where pan2render.kernels has them (``attention``:
    'auto', the pipeline's choice: FlashAttention-4 where it runs, else SDPA; or one forced), its
    first-call compile done here as at model load."""
    from pan2render.models.dit_ops import ROUTED_OPS

    used = []
    try:  # the pipeline's default numerics (fp32 residual stream), as PAN2Pipeline applies them
        from pan2render.models.pipeline import PAN2PipelineConfig

        if getattr(PAN2PipelineConfig(), "dit_fp32_residual", False):
            model.set_residual_dtype(torch.float32)
            used.append("fp32 residual stream")
    except Exception as e:
        used.append(f"compute-dtype residual stream ({type(e).__name__}: {e})")
    try:
        model.set_ops(ROUTED_OPS)  # the table PAN2PipelineConfig.dit_fused_kernels=True gives
        used.append("fused DiT kernels")
    except Exception as e:  # bench what exists, say what did not
        used.append(f"eager ops ({type(e).__name__}: {e})")
    try:
        from pan2render.kernels import attention as attn_mod

        attn_mod.set_attention_backend(attention)
        param = model.blocks[0].attn1.to_q.weight  # the compute dtype (norms and embedders may be fp32)
        head_dim = model.config.attention_head_dim
        attn_mod.warm_up_attention(param.device, param.dtype, heads=model.config.num_attention_heads,
                                   head_dim=head_dim)
        for block in model.blocks:
            block.attn1.attention_fn = attn_mod.attention
            block.attn2.attention_fn = attn_mod.attention
        used.append(f"attention {attention}: {attn_mod.describe_attention(param.device, param.dtype, head_dim)}")
    except Exception as e:
        used.append(f"SDPA default order ({type(e).__name__}: {e})")
    return ", ".join(used)


def profile_step(fn: Callable[[], Any], device: torch.device, rank: int, what: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - t0
    if rank != 0:
        return
    events = prof.key_averages()
    gpu = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
    print(f"--- profile of one {what} on rank 0: wall {wall:.3f} s (profiled), GPU self time {gpu:.3f} s")
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            print(events.table(sort_by=key, row_limit=22, max_name_column_width=70))
            break
        except Exception as e:  # the key's name changed across torch versions
            print(f"(sort by {key} failed: {e})")


def bench_dit(rank: int, world: int, device: torch.device, args: argparse.Namespace, res: dict) -> None:
    size = TINY if args.tiny else FULL
    config = PAN2DiTConfig(**TINY_DIT) if args.tiny else PAN2DiTConfig()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    t0 = time.perf_counter()
    model = build_dit(config, device, dtype)
    res["dit_paths"] = use_fast_paths(model, args.attention)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, config.in_channels, size["frames"], size["height"], size["width"], generator=gen)
    x = x.to(device, dtype)
    cond = torch.randn(1, size["text"], config.text_dim, generator=gen).to(device, dtype)
    uncond = torch.randn(1, size["text"], config.text_dim, generator=gen).to(device, dtype)
    t = torch.tensor([900.0], device=device)
    tokens = size["frames"] * (size["height"] // 2) * (size["width"] // 2)
    log(rank, f"DiT built on every GPU in {time.perf_counter() - t0:.1f} s; {tokens} tokens; {res['dit_paths']}")

    def step(denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """One guided sampling step through a pipeline denoiser (text K/V prepared when it was made)."""
        def run() -> torch.Tensor:
            with torch.inference_mode():
                velocity = denoise(x, t)
                return x.float() - 0.02 * velocity.float()  # the sampler's update (Euler-sized)
        return run

    single = None
    if rank == 0:  # one GPU: rank 0 alone, the others wait at the barrier
        with torch.inference_mode():
            one = make_denoiser(model, cond, uncond, args.guidance)  # PAN2Pipeline's single-GPU denoiser
        step(one)()  # warm-up (Triton / cuDNN builds)
        peak_reset(device)
        secs, single = timed(step(one), device=device, reps=args.reps, group=False)
        res["step_1gpu_s"] = round(secs, 3)
        res["step_1gpu_peak_gib"] = gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0
        if args.profile:
            profile_step(step(one), device, rank, "1-GPU step")
        log(rank, f"guided step, 1 GPU: {secs:.3f} s, peak {res['step_1gpu_peak_gib']} GiB")
        del one
    dist.barrier()
    group = SequenceGroup.of(None)

    def group_step(name: str, what: str, denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        step(denoise)()  # warm-up (NCCL communicators, the shard's shapes)
        peak_reset(device)
        secs, grouped = timed(step(denoise), device=device, reps=args.reps, group=True)
        res[f"step_{name}_s"] = round(secs, 3)
        res[f"step_{name}_peak_gib"] = peaks(device, world)
        if rank == 0:
            res[f"step_{name}_speedup"] = round(res["step_1gpu_s"] / secs, 3)
            res[f"step_{name}_vs_1gpu_rel_l2"] = rel_l2(grouped, single)  # noqa: F821 - bound above (ruff reads the del below as unbinding it)
            log(rank, f"guided step, group of {world}, {what}: {secs:.3f} s -> {res[f'step_{name}_speedup']}x; "
                      f"peak per rank {res[f'step_{name}_peak_gib']} GiB; rel L2 vs 1 GPU "
                      f"{res[f'step_{name}_vs_1gpu_rel_l2']:.2e}")
        if args.profile:  # where a group step's time goes (rank 0), kernels by self GPU time
            profile_step(step(denoise), device, rank, f"group step ({what})")

    # Both branches Ulysses-parallel over the whole group (guidance_parallel=False, and what odd
    # groups and unguided steps use).
    sp = parallelize_dit(model, group)
    with torch.inference_mode():
        whole = make_denoiser(sp, cond, uncond, args.guidance)
    group_step("ulysses", "Ulysses over the whole group", whole)
    del whole, sp
    # The pipeline's default in an even group (guidance_parallel=True): one branch per half.
    if world % 2 == 0:
        split = GuidanceSplit(model, group)
        with torch.inference_mode():
            halves = split.denoiser(cond, uncond, args.guidance)
        group_step("split", f"guidance split ({split.half_size} rank(s) per branch)", halves)
        del halves, split
    res["step_group_layout"] = "split" if world % 2 == 0 else "ulysses"  # what PAN2Pipeline runs here
    if rank == 0:
        res["step_speedup"] = res[f"step_{res['step_group_layout']}_speedup"]
    if args.sample_steps:
        bench_sample(model, cond, uncond, rank, world, device, args, res)
    del model, single
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_sample(model: PAN2DiT, cond: torch.Tensor, uncond: torch.Tensor, rank: int, world: int,
                 device: torch.device, args: argparse.Namespace, res: dict) -> None:
    """A whole ``PAN2Pipeline.sample`` (UniPC, --sample-steps steps) on one GPU, then on the group
    through ``parallelize_pipeline`` exactly as the runner does it: the pipeline-level ratio."""
    from pan2render.models.pipeline import PAN2Pipeline, PAN2PipelineConfig
    from pan2render.models.samplers import SchedulerConfig

    size = TINY if args.tiny else FULL
    # sample() reads only the VAE's z_dim (no image conditioning here): a tiny VAE with z_dim 48.
    vae = WanVAE(WanVAEConfig(**TINY_VAE)).eval()
    pipe = PAN2Pipeline(dit=model, vae=vae, text_encoder=None, scheduler_config=SchedulerConfig(),
                        config=PAN2PipelineConfig(device=str(device), dtype=cond.dtype), model_id="bench")
    request = dict(prompt_embeds=cond[0], negative_prompt_embeds=uncond[0], height=size["height"] * 16,
                   width=size["width"] * 16, frames=(size["frames"] - 1) * 4 + 1, steps=args.sample_steps,
                   guidance=args.guidance, seed=0)
    one = None
    if rank == 0:
        secs, one = timed(lambda: pipe.sample(**request), device=device, reps=1, group=False)
        res["sample_1gpu_s"] = round(secs, 2)
        log(rank, f"PAN2Pipeline.sample, {args.sample_steps} guided steps, 1 GPU: {secs:.2f} s")
    dist.barrier()
    pipe = parallelize_pipeline(pipe, SequenceGroup.of(None))
    secs, latents = timed(lambda: pipe.sample(**request), device=device, reps=1, group=True)
    res["sample_group_s"] = round(secs, 2)
    if rank == 0:
        res["sample_speedup"] = round(res["sample_1gpu_s"] / secs, 3)
        res["sample_group_vs_1gpu_rel_l2"] = rel_l2(latents, one)
        how = "guidance split" if isinstance(pipe.denoiser, GuidanceSplitDenoiser) else "Ulysses"
        log(rank, f"PAN2Pipeline.sample, {args.sample_steps} guided steps, group of {world} ({how}): {secs:.2f} s -> "
                  f"{res['sample_speedup']}x; latents rel L2 vs 1 GPU {res['sample_group_vs_1gpu_rel_l2']:.2e}")


# ---- decode ----------------------------------------------------------------------------------------


def _mark(device: torch.device) -> Any:
    """A point in time on ``device``'s stream: a recorded CUDA event, or the host clock on CPU."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed(a: Any, b: Any) -> float:
    """Seconds between two `_mark` points (synchronises on CUDA events)."""
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1e3


class TimedDecoder:
    """A decoder seen through its unit interface (``vae_plan.UnitDecoder``) with marks on the GPU
    stream: per chunk, from this rank's first unit to its settled state (and the frames written on
    rank 0), so waits for transfers are excluded; with ``per_unit``, around every unit. ``costs``
    (one per plan unit) replaces the plan's cost model in the split's cut."""

    def __init__(self, decoder: UnitDecoder, device: torch.device, *, per_unit: bool = False,
                 costs: list[float] | None = None) -> None:
        self.decoder, self.device, self.per_unit, self.costs = decoder, device, per_unit, costs
        self.busy: list[tuple[Any, Any]] = []  # (start, end) per chunk and span
        self.units: list[DecodeUnit] = []  # this rank's units, in order
        self.unit_marks: list[tuple[DecodeUnit, bool, Any, Any]] = []  # (unit, first chunk, start, end)

    def start_decode(self, z: torch.Tensor) -> _TimedRun:
        return _TimedRun(self, self.decoder.start_decode(z))

    def busy_s(self) -> float:
        return sum(_elapsed(a, b) for a, b in self.busy)

    def unit_s(self) -> list[float]:
        """Seconds per unit of this rank summed over the steady-state chunks (the first is 1 frame)."""
        return [sum(_elapsed(a, b) for u, first, a, b in self.unit_marks if u == unit and not first)
                for unit in self.units]


class _TimedRun:
    def __init__(self, owner: TimedDecoder, run: Any) -> None:
        self._owner, self._run = owner, run
        self.plan = run.plan if owner.costs is None else run.plan.with_costs(owner.costs)
        self.latent_frames = run.latent_frames
        self.state_dtype = run.state_dtype
        self._open: Any = None

    def __enter__(self) -> _TimedRun:
        self._run.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._run.__exit__(*exc)

    def latent_input(self, t: int) -> Any:
        return self._run.latent_input(t)

    def run_unit(self, unit: DecodeUnit, state: Any, *, first: bool) -> Any:
        owner = self._owner
        if self._open is None:
            self._open = _mark(owner.device)
        if unit not in owner.units:
            owner.units.append(unit)
        if not owner.per_unit:
            return self._run.run_unit(unit, state, first=first)
        a = _mark(owner.device)
        state = self._run.run_unit(unit, state, first=first)
        owner.unit_marks.append((unit, first, a, _mark(owner.device)))
        return state

    def settle(self, state: Any) -> Any:
        state = self._run.settle(state)
        self._owner.busy.append((self._open, _mark(self._owner.device)))
        self._open = None
        return state

    def new_output(self, out_dtype: torch.dtype) -> torch.Tensor:
        return self._run.new_output(out_dtype)

    def write(self, state: Any, out: torch.Tensor, start: int) -> int:
        a = _mark(self._owner.device)
        frames = self._run.write(state, out, start)
        self._owner.busy.append((a, _mark(self._owner.device)))
        return frames


def bench_decode(rank: int, world: int, device: torch.device, args: argparse.Namespace, res: dict) -> None:
    size = TINY if args.tiny else FULL
    config = WanVAEConfig(**TINY_VAE) if args.tiny else WanVAEConfig()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    vae = random_module(lambda: WanVAE(config), device, dtype, seed=2)
    z = torch.randn(1, config.z_dim, size["frames"], size["height"], size["width"],
                    generator=torch.Generator().manual_seed(3)).to(device)
    group = SequenceGroup.of(None)
    fast, reason = agree_fast_decode(vae, group, device=device, enabled=not args.reference_decode_only)
    res["decode_path"] = "fast" if fast else f"reference bf16 ({reason})"
    log(rank, f"decode path agreed by all ranks: {res['decode_path']}")
    paths = [fast] + ([False] if fast and args.also_reference_decode else [])
    for use_fast in paths:
        key = "fast" if use_fast else "reference"

        def single_fn(latents: torch.Tensor, use_fast: bool = use_fast) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                if use_fast:
                    return fast_decoder_for(vae, device).decode(latents, out_dtype=torch.uint8)
                with torch.inference_mode():
                    video = vae.decode(latents.to(dtype))
                return ((video[0].float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0)
            return run

        decoder: UnitDecoder = fast_decoder_for(vae, device) if use_fast else vae  # what pipelined_decode picks

        def group_fn(latents: torch.Tensor) -> Callable[[], torch.Tensor | None]:
            return lambda: split_decode(decoder, latents, group, out_dtype=torch.uint8)

        warm = z[:, :, : min(3, z.shape[2])]
        one = None
        if rank == 0:
            single_fn(warm)()
            peak_reset(device)
            secs, one = timed(single_fn(z), device=device, reps=args.decode_reps, group=False)
            res[f"decode_{key}_1gpu_s"] = round(secs, 3)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            res[f"decode_{key}_1gpu_peak_gib"] = gib(peak)
            log(rank, f"decode ({key}), 1 GPU: {secs:.3f} s, peak {res[f'decode_{key}_1gpu_peak_gib']} GiB")
        # Profile the split units on rank 0 alone (steady-state seconds per unit), for a measured cut.
        measured: list[Any] = [None]
        if rank == 0:
            prof = TimedDecoder(decoder, device, per_unit=True)
            solo = SequenceGroup(group=None, rank=0, world_size=1)
            secs, _ = timed(lambda: split_decode(prof, z, solo, out_dtype=torch.uint8), device=device,
                            reps=1, group=False)
            unit_s = prof.unit_s()
            measured = [unit_s]
            res[f"decode_{key}_units_1gpu_s"] = round(secs, 3)
            res[f"decode_{key}_unit_s"] = {u.name: round(t, 4) for u, t in zip(prof.units, unit_s)}
            log(rank, f"decode ({key}), the split's units run on 1 GPU: {secs:.3f} s; per unit (31 frames): "
                      f"{res[f'decode_{key}_unit_s']}")
        dist.broadcast_object_list(measured, src=0)
        cuts = {"model": None} if measured[0] is None else {"model": None, "measured": measured[0]}
        frames = None
        for cut, costs in cuts.items():
            group_fn(warm)()
            peak_reset(device)
            stats: list[TimedDecoder] = []

            def run(costs: Any = costs, stats: list = stats) -> Any:
                stats[:] = [TimedDecoder(decoder, device, costs=costs)]  # the last rep's marks
                return split_decode(stats[0], z, group, out_dtype=torch.uint8)

            secs, frames = timed(run, device=device, reps=args.decode_reps, group=True)
            name = f"decode_{key}_group_{cut}_cut"
            busy = [None] * world
            dist.all_gather_object(busy, {"units": [u.name for u in stats[0].units],
                                          "busy_s": round(stats[0].busy_s(), 3)})
            res[f"{name}_s"] = round(secs, 3)
            res[f"{name}_peak_gib"] = peaks(device, world)
            res[f"{name}_per_rank"] = busy
            if rank == 0:
                res[f"{name}_speedup"] = round(res[f"decode_{key}_1gpu_s"] / secs, 3)
                diff = (frames.int() - one.int()).abs()
                res[f"{name}_vs_1gpu_max_abs_uint8"] = int(diff.max())
                res[f"{name}_vs_1gpu_mean_abs_uint8"] = float(diff.float().mean())
                log(rank, f"decode ({key}), group of {world}, {cut} cut: {secs:.3f} s -> "
                          f"{res[f'{name}_speedup']}x; peak per rank {res[f'{name}_peak_gib']} GiB; busy per "
                          f"rank (last rep) {busy}; uint8 vs 1 GPU: max abs {int(diff.max())}, mean "
                          f"{float(diff.float().mean()):.4f}; frames {tuple(frames.shape)}")
        del one, frames
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ---- processes -----------------------------------------------------------------------------------


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    res: dict[str, Any] = {"world": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                           "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    try:
        if not args.skip_dit:
            bench_dit(rank, world, device, args, res)
        if not args.skip_decode:
            bench_decode(rank, world, device, args, res)
    except Exception:  # keep what was measured
        res["error"] = traceback.format_exc()
        print(f"rank {rank}: {res['error']}", flush=True)
        raise
    finally:
        if rank == 0:
            print(json.dumps(res, indent=1), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(res, indent=1))
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="group size (GPUs); default 2")
    p.add_argument("--reps", type=int, default=3, help="timed guided steps (min is reported)")
    p.add_argument("--decode-reps", type=int, default=2, help="timed decodes (min is reported)")
    p.add_argument("--guidance", type=float, default=2.5)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny models (gloo)")
    p.add_argument("--skip-dit", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--reference-decode-only", action="store_true", help="do not use the fast decoder")
    p.add_argument("--also-reference-decode", action="store_true",
                   help="when the fast decoder runs, also time the reference bf16 decode (1 GPU vs group)")
    p.add_argument("--profile", action="store_true", help="profile one 1-GPU and one group guided step")
    p.add_argument("--sample-steps", type=int, default=0,
                   help="also time a whole PAN2Pipeline.sample of this many guided steps, 1 GPU vs the group")
    p.add_argument("--attention", default="auto",
                   help="attention backend: 'auto' (the pipeline's choice: FlashAttention-4 where it runs) or one "
                        "forced: fa4, cudnn, flash, efficient, math")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--out", type=Path, default=None, help="folder for the figures (bench_parallel.json)")
    args = p.parse_args()
    try:
        from pan2render.kernels.attention import AttentionConfig

        AttentionConfig(backend=args.attention)
    except ValueError as err:
        p.error(f"--attention: {err}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        args.json = args.json or str(args.out / "bench_parallel.json")
    if not args.tiny and (not torch.cuda.is_available() or torch.cuda.device_count() < args.world):
        print(f"needs {args.world} CUDA GPUs (found {torch.cuda.device_count()}); use --tiny on CPU")
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the shared hosts
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world, port, args), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
