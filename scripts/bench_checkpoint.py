#!/usr/bin/env python3
"""Benchmark step checkpoints on one GPU: what a checkpoint costs on the GPU's path, and that a
sampling preempted half-way resumes, from its checkpoint's bytes alone, to the latents of one never
stopped.

Model: the full-size random-weight PAN2 DiT (Wan2.2-TI2V-5B config, bf16, the loader's fp32 modules
in fp32; built as scripts/bench_parallel.py builds it) inside a `PAN2Pipeline` (fused DiT kernels
and the attention backend the pipeline picks, FlashAttention-4 where it runs), the VAE on the meta
device (sampling reads only its config), at 704x1248x121 (latent 48x31x44x78, 26,598 tokens),
random text embeddings [512, 4096], guidance 2.5, UniPC (the sampler with the most state: its
history of two x0 and its last sample). ``--stub`` replaces the DiT by a cheap deterministic
function of the latents: a checkpoint's sizes and seconds do not depend on the model, only the
step time (hence the fractions) does.

Runs, each section written into --out as soon as it is done:
1. uninterrupted: --steps steps with the hooks off; the seconds per step (steps 2..N, from the
   pipeline's progress calls, which come after its per-step sync); the final latents kept.
2. preempted: the same request with a checkpoint due at every step boundary (checkpoint_every_s
   tiny) and should_stop saying stop at boundary --stop-at. Per checkpoint: ``capture_s``, the
   state's device -> host copy and assembly (from the progress call to the hook: the GPU has no
   work queued meanwhile, so this is what blocks the GPU lane), ``pack_s`` (safetensors bytes +
   sha256 digest: on the CPU, blocking only if packed on the GPU lane's thread; the runner can do
   it beside the next step), ``unpack_s`` (check + unpack, on resume); sizes. Also the same
   tensors copied to pageable vs pinned host memory (min of 5), and the first --stop-at steps'
   time against run 1's (the overhead of a checkpoint per step, measured in the loop).
3. resumed: a new sampling from the stop's packed bytes only (the state dropped, the CUDA cache
   emptied), hooks off, to step N: max abs diff of its latents vs run 1's, and bit-equality.
4. with --repeat: run 1 again, for the GPU's own run-to-run difference to compare 3's against.

Runs 2 and 3 together are one sampling: the default is two 50-step guided samplings (~1.7 s a
step on one H200) after the model's build and FlashAttention-4's compile; --repeat adds a third.

GPU host:  python scripts/bench_checkpoint.py --out $OUT/bench_checkpoint.json --repeat            (~5 min)
           python scripts/bench_checkpoint.py --out $OUT/bench_checkpoint.json --steps 20 --repeat (~2.5 min)
CPU smoke: python scripts/bench_checkpoint.py --tiny --out /tmp/bench_checkpoint.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_parallel import build_dit

from pan2render.kernels.attention import start_attention_import
from pan2render.models.dit import PAN2DiT, PAN2DiTConfig
from pan2render.models.pipeline import PAN2Pipeline, PAN2PipelineConfig
from pan2render.models.sampler_state import SamplerState, SamplingPreempted, pack_sampler_state, unpack_sampler_state
from pan2render.models.samplers import SchedulerConfig
from pan2render.models.strategies import SeparateGuidance, VelocityFn
from pan2render.models.tiny import cache_root
from pan2render.models.vae import WanVAE, WanVAEConfig

FULL = dict(height=704, width=1248, frames=121)
TINY = dict(height=64, width=64, frames=17)
TINY_DIT = dict(num_attention_heads=4, attention_head_dim=12, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)
TINY_VAE = dict(base_dim=8, decoder_base_dim=8, num_res_blocks=1)
SPEC = "0" * 64  # stands for the job's spec hash


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class StubVelocity(SeparateGuidance):
    """A deterministic, nearly free stand-in for the DiT (``--stub``): the checkpoint path is the
    same, the step is ~a millisecond."""

    def prepare(self, cond: torch.Tensor, uncond: torch.Tensor | None, guidance: float) -> VelocityFn:
        return lambda x, t: torch.tanh(x) * (0.5 + t.float().mean() / 1000)


def build_pipeline(args: argparse.Namespace, device: torch.device) -> PAN2Pipeline:
    dit_config = PAN2DiTConfig(**TINY_DIT) if args.tiny else PAN2DiTConfig()
    vae_config = WanVAEConfig(**TINY_VAE) if args.tiny else WanVAEConfig()
    config = PAN2PipelineConfig(device=str(device))
    with torch.device("meta"):
        vae = WanVAE(vae_config)  # sampling reads only its config
        stub_dit = PAN2DiT(dit_config) if args.stub else None
    if stub_dit is None:
        start_attention_import(device, config.dtype, head_dim=dit_config.attention_head_dim,
                               compile_cache=cache_root() / "flash-attn-4")
        dit = build_dit(dit_config, device, config.dtype)
    else:
        dit = stub_dit
    pipe = PAN2Pipeline(dit=dit, vae=vae, text_encoder=None, scheduler_config=SchedulerConfig(), config=config,
                        model_id="bench-random-weights")
    if stub_dit is not None:
        return pipe.with_strategies(denoiser=StubVelocity(dit))
    pipe.warm_up_attention()
    return pipe


class Stamps:
    """The pipeline's progress calls, timed (each comes after the step's sync)."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}

    def __call__(self, done: int, total: int) -> None:
        self.at[done] = time.perf_counter()

    def per_step(self, first: int, last: int) -> float:
        return (self.at[last] - self.at[first]) / (last - first)


def run_uninterrupted(pipe: PAN2Pipeline, request: dict[str, Any]) -> tuple[torch.Tensor, Stamps]:
    stamps = Stamps()
    latents = pipe.sample(**request, progress=stamps)
    return latents, stamps


def run_preempted(pipe: PAN2Pipeline, request: dict[str, Any], stop_at: int
                  ) -> tuple[bytes, Stamps, dict[str, list[float]], SamplerState]:
    """Checkpoint at every boundary and stop at ``stop_at``: the stop's bytes, stamps, per-checkpoint seconds."""
    stamps, seconds = Stamps(), {"capture_s": [], "pack_s": [], "unpack_s": []}
    packed: list[bytes] = []

    def on_checkpoint(state: SamplerState) -> None:
        entered = time.perf_counter()
        seconds["capture_s"].append(entered - stamps.at[state.step])
        data = pack_sampler_state(state, spec_hash=SPEC)
        packed_at = time.perf_counter()
        seconds["pack_s"].append(packed_at - entered)
        unpack_sampler_state(data, spec_hash=SPEC, model_id=pipe.model_id)
        seconds["unpack_s"].append(time.perf_counter() - packed_at)
        packed[:] = [data]

    boundaries: list[int] = []

    def should_stop() -> bool:
        boundaries.append(1)
        return len(boundaries) == stop_at

    try:
        pipe.sample(**request, progress=stamps, checkpoint_every_s=1e-9, on_checkpoint=on_checkpoint,
                    should_stop=should_stop)
    except SamplingPreempted as stopped:
        state = stopped.state
    else:
        raise RuntimeError(f"the sampling did not stop at boundary {stop_at}")
    return packed[0], stamps, seconds, state


def copy_seconds(state: SamplerState, device: torch.device, reps: int = 5) -> dict[str, float]:
    """The state's tensors copied device -> host, into pageable and into pinned memory (min of reps)."""
    if device.type != "cuda":
        return {}
    on_device = [t.to(device) for t in (state.latents, *state.sampler.tensors.values())]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in on_device]
    out = {}
    for name, copy in (("d2h_pageable_s", lambda: [t.cpu() for t in on_device]),
                       ("d2h_pinned_s", lambda: [p.copy_(t) for p, t in zip(pinned, on_device)])):
        best = float("inf")
        for _ in range(reps):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            copy()
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        out[name] = best
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON file of figures")
    p.add_argument("--steps", type=int, default=50, help="steps of the sampling (default 50)")
    p.add_argument("--stop-at", type=int, default=None, help="the boundary the preemption stops at (default steps/2)")
    p.add_argument("--guidance", type=float, default=2.5)
    p.add_argument("--sampler", default="unipc", choices=("unipc", "euler"))
    p.add_argument("--stub", action="store_true", help="a stand-in for the DiT: checkpoint costs only")
    p.add_argument("--repeat", action="store_true", help="run the uninterrupted sampling twice (run-to-run diff)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test of the script at toy sizes")
    args = p.parse_args()
    stop_at = args.stop_at or args.steps // 2
    if not 1 <= stop_at < args.steps:
        p.error(f"--stop-at {stop_at} must be a boundary of a {args.steps}-step sampling (1..{args.steps - 1})")
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU host, or --tiny for the CPU smoke test")
    res: dict[str, Any] = {}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")

    pipe = build_pipeline(args, device)
    text_dim = pipe.dit.config.text_dim
    gen = torch.Generator().manual_seed(0)
    request = dict(**(TINY if args.tiny else FULL), steps=args.steps, guidance=args.guidance, seed=1,
                   sampler=args.sampler, prompt_embeds=torch.randn(512, text_dim, generator=gen),
                   negative_prompt_embeds=torch.randn(512, text_dim, generator=gen))
    res["config"] = {
        "size": TINY if args.tiny else FULL, "steps": args.steps, "stop_at": stop_at, "guidance": args.guidance,
        "sampler": args.sampler,
        "dit": "stub" if args.stub else "full-size random weights" if not args.tiny else "tiny",
        "attention": "stub" if args.stub else pipe.attention_backend, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    save()

    log(f"1. uninterrupted: {args.steps} steps")
    full, plain = run_uninterrupted(pipe, request)
    step_s = plain.per_step(1, args.steps)
    res["uninterrupted"] = {"step_s": step_s, "sampling_s": plain.at[args.steps] - plain.at[1] + step_s}
    log(f"   {step_s:.3f} s a step")
    save()

    log(f"2. preempted: a checkpoint at every boundary, stopped at {stop_at}")
    data, stamps, seconds, state = run_preempted(pipe, request, stop_at)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    loop_overhead = (stamps.per_step(1, stop_at) - plain.per_step(1, stop_at)) if stop_at > 1 else None
    sizes = state.nbytes()
    res["checkpoint"] = {
        "latents_bytes": sizes["latents"], "sampler_state_bytes": sizes["sampler"], "file_bytes": len(data),
        **med, "capture_s_all": seconds["capture_s"], **copy_seconds(state, device),
        "blocking_s_packed_aside": med["capture_s"], "blocking_s_packed_inline": med["capture_s"] + med["pack_s"],
        "fraction_of_a_step_packed_aside": med["capture_s"] / step_s,
        "fraction_of_a_step_packed_inline": (med["capture_s"] + med["pack_s"]) / step_s,
        # At the job field's default interval the GPU lane loses this fraction of its sampling time.
        "fraction_of_sampling_at_60s_packed_aside": med["capture_s"] / 60.0,
        "loop_overhead_per_checkpoint_s": loop_overhead,
    }
    log(f"   file {len(data) / 2**20:.1f} MiB (latents {sizes['latents'] / 2**20:.1f}, sampler "
        f"{sizes['sampler'] / 2**20:.1f}); capture {med['capture_s'] * 1e3:.1f} ms, pack {med['pack_s'] * 1e3:.1f} ms, "
        f"unpack {med['unpack_s'] * 1e3:.1f} ms; {100 * med['capture_s'] / step_s:.2f}% of a step")
    save()
    del state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    log(f"3. resumed from the bytes: steps {stop_at + 1}..{args.steps}")
    resumed = pipe.sample(**request, resume_from=unpack_sampler_state(data, spec_hash=SPEC, model_id=pipe.model_id))
    res["resumed"] = {"max_abs_diff_vs_uninterrupted": float((resumed - full).abs().max()),
                      "bit_equal": bool(torch.equal(resumed, full))}
    log(f"   max abs diff vs uninterrupted {res['resumed']['max_abs_diff_vs_uninterrupted']:.3e}")
    save()

    if args.repeat:
        log("4. uninterrupted again (run-to-run)")
        again, _ = run_uninterrupted(pipe, request)
        res["run_to_run"] = {"max_abs_diff": float((again - full).abs().max()),
                             "bit_equal": bool(torch.equal(again, full))}
        log(f"   max abs diff {res['run_to_run']['max_abs_diff']:.3e}")
        save()
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
