#!/usr/bin/env python3
"""Benchmark the PAN2 DiT against diffusers' WanTransformer3DModel, in one process.

Both models are built on the GPU in bf16 from ONE random state dict (Wan2.2-TI2V-5B config by
default), at 704x1248x121 (latent 48x31x44x78 -> 26,598 tokens, 512 text tokens). Prints and writes
(--json) in this order, each section saved as soon as it is done:

0. with --attn-micro: SDPA cuDNN vs flash (and FlashAttention-4 where it runs) at the self- and
   cross-attention shapes, two layouts;
1. diffusers forward, batch 1 and 2: time (min of --reps after --warmup), activation peak memory;
1b. diffusers as an expert runs it (scripts/diffusers_peer.py: cuDNN attention through its attention
   dispatcher, compile_repeated_blocks(fullgraph=True)), a copy of the same model, batch 1: its first
   call (the compile) timed apart from the steady forward; skipped with --no-expert. On a CPU the
   blocks are compiled with diffusers' default attention (no cuDNN there), and that is recorded;
2. ours unfused with diffusers' numerics (eager ops, residual stream rounded to bf16 after every
   add, SDPA's default order) at batch 1;
3. ours fused as PAN2Pipeline runs it by default (Triton Q/K norm+RoPE, norm+modulation kernels,
   attention backend chosen by pan2render.kernels.attention, residual stream as
   PAN2PipelineConfig.dit_fp32_residual says: fp32) at batch 1 per --variants layout; the fastest
   layout again with the other residual dtype (the fp32 stream's cost in ms), then at batch 2;
   the ratios to diffusers eager and expert; with --profile the top GPU kernels of one forward;
4. a guided step (cond + uncond + combine) as two batch-1 forwards and as one batch-2 forward;
4b. per attention backend of --backends (default fa4,cudnn; one the GPU cannot run is skipped and
   said so), the chosen layout forced to it: the attention's TFLOP/s inside the model (CUDA events
   around every self- and cross-attention call of one forward, FLOPs 4*B*H*Lq*Lk*D over their
   summed time), the forward at batch 1 and the guided step (two batch-1 passes);
5. with --sample: a full --steps guided sample (guidance 2.5) through PAN2Pipeline, attention as
   the pipeline chooses it ('auto'); then, with two or more --backends, a --compare-steps guided
   sample per backend from the same seed and the final latents' relative L2 between them;
6. relative L2 error vs an fp32 reference (diffusers in strict fp32, no TF32) of every bf16 output
   above (batch 1), and the fused default's error over the unfused one's.
7. a compact table of the headline figures per backend and diffusers' (eager and expert).

Results of record: docs/performance.md.
Usage (GPU host): python scripts/bench_dit.py --out DIR [--sample]   (DIR/bench_dit.json; or --json FILE)
CPU smoke test of the script itself: python scripts/bench_dit.py --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # diffusers_peer, beside this script

from pan2render.kernels import attention as attn_mod
from pan2render.kernels import dit_fused
from pan2render.kernels.attention import describe_attention, fa4_unusable_reason, warm_up_attention
from pan2render.models.dit import ContextCache, PAN2DiT, PAN2DiTConfig
from pan2render.models.dit_ops import ROUTED_OPS, TORCH_OPS
from pan2render.models.pipeline import PAN2PipelineConfig

# diffusers keeps these in fp32 when loading the transformer in bf16 (_keep_in_fp32_modules).
KEEP_FP32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")
TINY = dict(num_attention_heads=3, attention_head_dim=20, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)
# The residual stream the pipeline runs the DiT with by default (fp32: see PAN2PipelineConfig).
FP32_RESIDUAL = PAN2PipelineConfig(device="cpu").dit_fp32_residual


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], *, device: torch.device, reps: int, warmup: int) -> tuple[float, float, Any]:
    """(min seconds, activation peak GiB above what was allocated before, last result)."""
    out = None
    for _ in range(warmup):
        out = fn()
    sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    best = math.inf
    for _ in range(reps):
        out = None
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else 0.0
    return best, peak, out


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def build_models(config: PAN2DiTConfig, device: torch.device, dtype: torch.dtype):
    """Ours and diffusers', built directly on the device in dtype, with one random state dict."""
    from diffusers import WanTransformer3DModel

    kwargs = {k: v for k, v in config.to_dict().items() if not k.startswith("_")}
    prev = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            ours = PAN2DiT(config).eval()
            ref = WanTransformer3DModel(**kwargs).eval()
    finally:
        torch.set_default_dtype(prev)
    ref.load_state_dict(ours.state_dict(), strict=True)
    for model in (ours, ref):
        model.requires_grad_(False)
        for name, p in model.named_parameters():
            if any(k in name for k in KEEP_FP32):
                p.data = p.data.float()
    return ours, ref


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The 'head' layout variant: q / k / v copied to contiguous [B, H, L, D] before the library's
    attention (which takes the token-major views as they lie)."""
    return attn_mod.attention(q.contiguous(), k.contiguous(), v.contiguous())


LAYOUTS: dict[str, Callable] = {"token": attn_mod.attention, "head": contiguous_attention}


def set_attention(model: PAN2DiT, fn: Callable) -> None:
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = fn


def use_ours(model: PAN2DiT, *, fused: bool, chosen_attention: bool, fp32_residual: bool,
             variant: str = "token", backend: str = "auto") -> None:
    """Route ``model``: eager or fused ops (the two tables PAN2PipelineConfig.dit_fused_kernels
    chooses between), default SDPA or our backend choice (``backend``: 'auto' or forced, see
    pan2render.kernels.attention), the residual stream in fp32 or in the compute dtype (diffusers'
    numerics), and a layout variant of our choice (LAYOUTS): 'token' (q/k/v token-major views, as
    the model makes them) or 'head' (copied to contiguous [B, H, L, D] first)."""
    from pan2render.models.dit_ops import attention as default_attention

    attn_mod.set_attention_backend(backend, short_kv_backend=SHORT_KV_BACKEND)
    model.set_ops(ROUTED_OPS if fused else TORCH_OPS)
    model.set_residual_dtype(torch.float32 if fp32_residual else None)
    set_attention(model, LAYOUTS[variant] if chosen_attention else default_attention)


SHORT_KV_BACKEND = "auto"  # set from the attention micro-benchmark when it runs


def attention_micro(device: torch.device, dtype: torch.dtype, *, heads: int, seq: int, head_dim: int,
                    text: int, reps: int) -> dict[str, float]:
    """TFLOP/s of SDPA backends and FlashAttention-4 at the DiT's self- ([1, H, L, D] x L) and
    cross- (x 512) shapes, with q/k/v head-major contiguous ('bhsd') or token-major views ('bshd',
    what the model makes)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: dict[str, float] = {}
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    for kv_len, kind in ((seq, "self"), (text, "cross")):
        for layout in ("bhsd", "bshd"):
            def make(n: int) -> torch.Tensor:
                if layout == "bhsd":
                    return torch.randn(1, heads, n, head_dim, device=device, dtype=dtype)
                return torch.randn(1, n, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)

            q, k, v = make(seq), make(kv_len), make(kv_len)
            for name, backend in [*backends.items(), (attn_mod.FA4, None)]:
                if backend is None:  # FlashAttention-4 through our dispatch (its [B, L, H, D] view)
                    why = fa4_unusable_reason(device, dtype, head_dim)
                    if why is not None:
                        log(f"attention micro {kind} {layout} fa4: skipped ({why})")
                        continue
                    attn_mod.set_attention_backend(attn_mod.FA4)
                    s, _, _ = timed(lambda: attn_mod.attention(q, k, v), device=device, reps=reps, warmup=1)  # noqa: F821 - bound above (ruff reads the del below as unbinding it)
                    attn_mod.set_attention_backend("auto")
                else:
                    try:
                        with sdpa_kernel([backend]):
                            s, _, _ = timed(lambda: F.scaled_dot_product_attention(q, k, v), device=device,  # noqa: F821 - bound above (ruff reads the del below as unbinding it)
                                            reps=reps, warmup=1)
                    except RuntimeError as err:  # backend cannot take these inputs
                        log(f"attention micro {kind} {layout} {name}: {str(err).splitlines()[0]}")
                        continue
                tflops = 4 * seq * kv_len * heads * head_dim / s / 1e12
                out[f"{kind}_{layout}_{name}_tflops"] = round(tflops, 1)
                log(f"attention {kind} {layout} {name}: {s * 1e3:.2f} ms, {tflops:.0f} TFLOP/s")
            del q, k, v
    return out


def profile_forward(fn: Callable[[], Any], *, device: torch.device) -> None:
    """One forward under torch.profiler: the kernels that take the time, biggest first."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        try:
            print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60), flush=True)
            return
        except (AttributeError, KeyError, ValueError):
            continue


class TimedAttention:
    """An ``attention_fn`` that times every call of the backend it wraps (CUDA events on the GPU,
    the wall clock on the CPU) and counts its FLOPs, self-attention (Lq == Lk) and cross apart."""

    def __init__(self, inner: Callable, device: torch.device) -> None:
        self.inner, self.device = inner, device
        self.calls: list[tuple[str, float, Any, Any]] = []  # (kind, flops, start, end)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, heads, lq, dim = q.shape
        flops = 4.0 * batch * heads * lq * k.shape[-2] * dim
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.inner(q, k, v)
            end.record()
        else:
            start = time.perf_counter()
            out = self.inner(q, k, v)
            end = time.perf_counter()
        self.calls.append(("self" if k.shape[-2] == lq else "cross", flops, start, end))
        return out

    def tflops(self) -> dict[str, float]:
        """{kind: TFLOP/s over its calls, kind_ms: their summed time per forward call}."""
        sync(self.device)
        out: dict[str, float] = {}
        for kind in ("self", "cross"):
            calls = [c for c in self.calls if c[0] == kind]
            if not calls:
                continue
            if self.device.type == "cuda":
                seconds = sum(start.elapsed_time(end) for _, _, start, end in calls) / 1e3
            else:
                seconds = sum(end - start for _, _, start, end in calls)
            out[f"{kind}_tflops"] = round(sum(c[1] for c in calls) / seconds / 1e12, 1)
            out[f"{kind}_ms"] = round(seconds * 1e3, 2)
        return out


def summary_table(results: dict[str, Any], backends: list[str]) -> str:
    """The headline figures, one column per attention backend that ran plus diffusers' eager and
    expert (diffusers_peer.py) forwards."""
    cols = [b for b in backends if f"{b}_b1_s" in results]
    rows = [
        ("self-attention in model, TFLOP/s", "{}_attn_self_tflops", ()),
        ("cross-attention in model, TFLOP/s", "{}_attn_cross_tflops", ()),
        ("DiT forward b1, s", "{}_b1_s", ("diffusers_b1_s", "diffusers_expert_b1_s")),
        ("guided step (2 x b1), s", "{}_guided_step_s", ()),
        ("rel L2 vs strict fp32 (b1)", "rel_l2_ours_{}", ("rel_l2_diffusers", "rel_l2_diffusers_expert")),
    ]
    head = f"{'figure':<36}" + "".join(f"{c:>14}" for c in cols) + f"{'diffusers':>14}{'diff. expert':>14}"
    lines = [head, "-" * len(head)]

    def cell(value: Any) -> str:
        if value is None:
            return f"{'-':>14}"
        return f"{value:>14.3e}" if isinstance(value, float) and abs(value) < 1e-2 else f"{value:>14}"

    for label, key, ref_keys in rows:
        lines.append(f"{label:<36}" + "".join(cell(results.get(key.format(c))) for c in cols)
                     + "".join(cell(results.get(k)) for k in ref_keys or (None, None)))
    if "ours_fused_b1_s" in results:
        expert = (f"x{results['ratio_b1_expert']} vs diffusers expert (its first call, the compile: "
                  f"{results['diffusers_expert_first_call_s']} s)" if "ratio_b1_expert" in results
                  else f"diffusers expert not timed ({results.get('diffusers_expert_error', 'off')})")
        lines.append(f"ours fused b1 {results['ours_fused_b1_s']} s: x{results['ratio_b1']} vs diffusers eager, "
                     + expert)
    if "sample_s" in results:
        lines.append(f"{results['sample_steps']}-step guided sample ({results['sample_attention']}): "
                     f"{results['sample_s']} s")
    for key, value in results.items():
        if key.startswith("latents_rel_l2_"):
            lines.append(f"final latents rel L2 {key.removeprefix('latents_rel_l2_').replace('_', ' ')}, "
                         f"{results['compare_steps']}-step sample: {value:.3e}")
    return "\n".join(lines)


def cat_cache(a: ContextCache, b: ContextCache) -> ContextCache:
    kv = tuple((torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in zip(a.keys_values, b.keys_values))
    return ContextCache(keys_values=kv, dtype=a.dtype)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--height", type=int, default=704)
    p.add_argument("--width", type=int, default=1248)
    p.add_argument("--frames", type=int, default=121)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--variants", default="token,head",
                   help="fused layouts to time at batch 1 (token: q/k/v as the model makes them; head: copied "
                        "to contiguous [B, H, L, D] before the attention); the fastest runs the residual-dtype "
                        "comparison and the batch-2, guided and sample sections")
    p.add_argument("--no-b2", action="store_true", help="skip the batch-2 forwards")
    p.add_argument("--no-unfused", action="store_true", help="skip our unfused forward")
    p.add_argument("--no-expert", action="store_true",
                   help="skip diffusers as an expert runs it (cuDNN attention, compiled blocks; the compile "
                        "takes minutes at full size)")
    p.add_argument("--no-batched-guidance", action="store_true", help="time only two batch-1 guided passes")
    p.add_argument("--attn-micro", action="store_true", help="SDPA backends x layouts at the DiT shapes")
    p.add_argument("--sample", action="store_true", help="also a full guided sample through PAN2Pipeline")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--guidance", type=float, default=2.5)
    p.add_argument("--no-fp32", action="store_true", help="skip the fp32 reference (saves ~15 s)")
    p.add_argument("--profile", action="store_true", help="print the top GPU kernels of one fused forward")
    p.add_argument("--backends", default="fa4,cudnn",
                   help="attention backends timed in the model, one after the other (section 4b), and compared "
                        "in a --compare-steps sample; 'none' skips both")
    p.add_argument("--compare-steps", type=int, default=10,
                   help="steps of the per-backend guided sample whose final latents are compared (0: skip)")
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks the script, not speed")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="folder for the results (bench_dit.json)")
    args = p.parse_args()
    with contextlib.ExitStack() as stack:
        return run(p, args, stack)


def sample_only_vae(config: Any) -> Any:
    """What ``PAN2Pipeline.sample`` reads of a VAE (its latent channels and the size rules of its
    compression) without building one: decoding is not part of these figures."""
    from pan2render.sampling import WAN22

    return types.SimpleNamespace(config=types.SimpleNamespace(
        z_dim=config.in_channels, scale_factor_spatial=WAN22.vae_spatial, scale_factor_temporal=WAN22.vae_temporal))


def run(p: argparse.ArgumentParser, args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        args.json = args.json or args.out / "bench_dit.json"
    backends = [] if args.backends == "none" else [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in (attn_mod.FA4, *attn_mod.BACKENDS)]
    if bad:
        p.error(f"--backends {args.backends!r}: {bad} unknown; use 'none' or names from "
                f"{[attn_mod.FA4, *attn_mod.BACKENDS]}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = PAN2DiTConfig(**TINY) if args.tiny else PAN2DiTConfig()
    if args.tiny:
        args.height, args.width, args.frames = 64, 96, 9
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            stack.enter_context(dit_fused.interpret_on_cpu())  # the fused kernels, interpreted
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(LAYOUTS)
    if unknown or not variants:
        p.error(f"--variants {args.variants!r}: use token, head or token,head")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                               "torch": torch.__version__, "shape": [args.frames, args.height, args.width]}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None

    def save() -> None:
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=1))

    t0 = time.perf_counter()
    ours, ref = build_models(config, device, dtype)
    sync(device)
    results["build_s"] = round(time.perf_counter() - t0, 2)
    params = sum(p.numel() for p in ours.parameters())
    log(f"built ours + diffusers ({params / 1e9:.2f} B params each) in {results['build_s']} s on {device}")
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    t0 = time.perf_counter()
    warm_up_attention(device, dtype, heads=heads, head_dim=head_dim)  # FA4's compile, as at model load
    results["attention_warmup_s"] = round(time.perf_counter() - t0, 2)
    results["attention_backend"] = describe_attention(device, dtype, head_dim)
    log(f"attention 'auto': {results['attention_backend']} (warm-up {results['attention_warmup_s']} s)")

    latent = (config.in_channels, (args.frames - 1) // 4 + 1, args.height // 16, args.width // 16)
    g = torch.Generator().manual_seed(1)
    x2 = torch.randn(2, *latent, generator=g).to(device, dtype)
    ctx2 = torch.randn(2, 512, config.text_dim, generator=g).to(device, dtype)
    t2 = torch.tensor([500.0, 500.0], device=device)
    x1, ctx1, t1 = x2[:1], ctx2[:1], t2[:1]
    tokens = math.prod(ours.token_grid(x1.shape))
    results["tokens"] = tokens
    log(f"latent {list(x1.shape)} -> {tokens} tokens")
    reps, warmup = args.reps, args.warmup
    outs: dict[str, torch.Tensor] = {}

    with torch.no_grad():
        if args.attn_micro and device.type == "cuda":
            micro = attention_micro(device, dtype, heads=config.num_attention_heads, seq=tokens,
                                    head_dim=config.attention_head_dim, text=512, reps=reps + 2)
            results["attention_micro"] = micro
            if micro.get("cross_bshd_flash_tflops", 0) > micro.get("cross_bshd_cudnn_tflops", 0):
                global SHORT_KV_BACKEND
                SHORT_KV_BACKEND = "flash"
            results["short_kv_backend"] = SHORT_KV_BACKEND
            save()

        # 1. diffusers, its default attention (SDPA's default order: flash first).
        batches = {1: (x1, t1, ctx1)} if args.no_b2 else {1: (x1, t1, ctx1), 2: (x2, t2, ctx2)}
        for b, (x, t, c) in batches.items():
            s, peak, out = timed(lambda: ref(x, t, c, return_dict=False)[0], device=device, reps=reps, warmup=warmup)
            results[f"diffusers_b{b}_s"], results[f"diffusers_b{b}_peak_gib"] = round(s, 4), round(peak, 2)
            if b == 1:
                outs["diffusers"] = out
            log(f"diffusers b{b}: {s:.3f} s, activation peak {peak:.1f} GiB")
            del out
        save()

        # 1b. diffusers as an expert runs it; a failure (a graph break under fullgraph, say) is
        #     recorded and the rest of the benchmark goes on.
        if not args.no_expert:
            from diffusers_peer import time_expert_forward

            def timed_as_the_rest(fn: Callable[[], Any]) -> tuple[float, float, Any]:
                return timed(fn, device=device, reps=reps, warmup=warmup)

            try:
                expert, outs["diffusers_expert"] = time_expert_forward(
                    ref, (x1, t1, ctx1), device=device, timed=timed_as_the_rest, log=log)
                results.update(expert)
                log(f"diffusers expert b1: x{results['diffusers_b1_s'] / expert['diffusers_expert_b1_s']:.3f} "
                    "vs diffusers eager")
            except Exception as err:
                results["diffusers_expert_error"] = f"{type(err).__name__}: {err}".splitlines()[0]
                log(f"diffusers expert: failed, {results['diffusers_expert_error']}")
            save()

        # 2. ours unfused with diffusers' numerics (eager ops, bf16 residual stream, default SDPA
        #    order), batch 1; the text K/V cached as in sampling.
        cache1 = ours.prepare_context(ctx1)
        if not args.no_unfused:
            use_ours(ours, fused=False, chosen_attention=False, fp32_residual=False)
            s, peak, out = timed(lambda: ours(x1, t1, cache1), device=device, reps=max(1, reps - 1), warmup=warmup)
            outs["ours_unfused"] = out
            results["ours_unfused_b1_s"], results["ours_unfused_b1_peak_gib"] = round(s, 4), round(peak, 2)
            log(f"ours unfused b1: {s:.3f} s, peak {peak:.1f} GiB")
            del out
            save()

        # 3. ours fused + chosen attention backend + the pipeline's residual stream, per layout.
        results["fp32_residual"] = FP32_RESIDUAL
        for variant in variants:
            use_ours(ours, fused=True, chosen_attention=True, fp32_residual=FP32_RESIDUAL, variant=variant)
            dit_fused.reset_fused_kernel_counts()
            s, peak, out = timed(lambda: ours(x1, t1, cache1), device=device, reps=reps, warmup=warmup)
            outs[f"ours_fused_{variant}"] = out
            results[f"ours_fused_{variant}_b1_s"] = round(s, 4)
            results[f"ours_fused_{variant}_b1_peak_gib"] = round(peak, 2)
            launches = {k: v // (reps + warmup) for k, v in dit_fused.fused_kernel_counts().items()}
            vs_expert = (f", x{results['diffusers_expert_b1_s'] / s:.3f} vs diffusers expert"
                         if "diffusers_expert_b1_s" in results else "")
            log(f"ours fused [{variant}] b1: {s:.3f} s, peak {peak:.1f} GiB, "
                f"x{results['diffusers_b1_s'] / s:.3f} vs diffusers eager{vs_expert}; launches/forward {launches}")
            results["fused_kernel_launches_b1"] = launches
            del out
        best = min(variants, key=lambda v: results[f"ours_fused_{v}_b1_s"])
        results["layout_chosen"] = best
        # The fp32 residual stream's cost: the best layout again with the other residual dtype.
        use_ours(ours, fused=True, chosen_attention=True, fp32_residual=not FP32_RESIDUAL, variant=best)
        s_other, peak, out = timed(lambda: ours(x1, t1, cache1), device=device, reps=reps, warmup=warmup)
        other = "bf16res" if FP32_RESIDUAL else "fp32res"
        outs[f"ours_fused_{best}_{other}"] = out
        results[f"ours_fused_{best}_{other}_b1_s"] = round(s_other, 4)
        s_fp32, s_bf16 = ((results[f"ours_fused_{best}_b1_s"], s_other) if FP32_RESIDUAL
                          else (s_other, results[f"ours_fused_{best}_b1_s"]))
        results["fp32_residual_cost_ms"] = round((s_fp32 - s_bf16) * 1e3, 1)
        log(f"ours fused [{best}] residual stream fp32 {s_fp32:.3f} s vs {str(dtype)[6:]} {s_bf16:.3f} s: "
            f"{results['fp32_residual_cost_ms']:+.1f} ms per forward for the fp32 stream")
        del out
        use_ours(ours, fused=True, chosen_attention=True, fp32_residual=FP32_RESIDUAL, variant=best)
        results["ours_fused_b1_s"] = results[f"ours_fused_{best}_b1_s"]
        results["ratio_b1"] = round(results["diffusers_b1_s"] / results["ours_fused_b1_s"], 3)
        if "diffusers_expert_b1_s" in results:  # same orientation: diffusers' seconds over ours
            results["ratio_b1_expert"] = round(results["diffusers_expert_b1_s"] / results["ours_fused_b1_s"], 3)
        results["attention_order"] = [b.name for b in attn_mod.attention_backends(
            torch.empty(1, config.num_attention_heads, tokens, config.attention_head_dim, device=device, dtype=dtype))]
        log(f"chosen layout {best}: {results['ours_fused_b1_s']} s, x{results['ratio_b1']} vs diffusers eager, "
            f"x{results.get('ratio_b1_expert', '-')} vs expert; "
            f"attention order {results['attention_order']}")
        if args.profile:
            profile_forward(lambda: ours(x1, t1, cache1), device=device)
        if not args.no_b2:
            cache2 = ours.prepare_context(ctx2)
            s, peak, out = timed(lambda: ours(x2, t2, cache2), device=device, reps=reps, warmup=warmup)
            results["ours_fused_b2_s"], results["ours_fused_b2_peak_gib"] = round(s, 4), round(peak, 2)
            results["ratio_b2"] = round(results["diffusers_b2_s"] / s, 3)
            log(f"ours fused b2: {s:.3f} s, peak {peak:.1f} GiB, x{results['ratio_b2']} vs diffusers")
            del out, cache2
        save()

        # 4. Guided step: cond + uncond (+ the guidance combine), text K/V prepared once per job.
        cache_u = ours.prepare_context(ctx2[1:])
        w = args.guidance

        def step_two() -> torch.Tensor:
            c = ours(x1, t1, cache1)
            u = ours(x1, t1, cache_u)
            return u + w * (c - u)

        steps = [("two_b1", step_two)]
        if not args.no_batched_guidance:
            cache_cu = cat_cache(cache1, cache_u)

            def step_batched() -> torch.Tensor:
                c, u = ours(torch.cat([x1, x1]), torch.cat([t1, t1]), cache_cu).chunk(2)
                return u + w * (c - u)

            steps.append(("batched_b2", step_batched))
        for name, fn in steps:
            s, peak, _ = timed(fn, device=device, reps=max(1, reps - 1), warmup=1)
            results[f"guided_step_{name}_s"], results[f"guided_step_{name}_peak_gib"] = round(s, 4), round(peak, 2)
            log(f"guided step {name}: {s:.3f} s, peak {peak:.1f} GiB")
        save()

        # 4b. Per attention backend, the chosen layout: attention inside the model, forward b1 and
        #     the guided step (two batch-1 passes), outputs kept for the error vs fp32.
        for backend in backends:
            why = fa4_unusable_reason(device, dtype, head_dim) if backend == attn_mod.FA4 else None
            if why is not None and device.type == "cuda":
                results[f"{backend}_skipped"] = why
                log(f"backend {backend}: skipped ({why})")
                continue
            use_ours(ours, fused=True, chosen_attention=True, fp32_residual=FP32_RESIDUAL, variant=best,
                     backend=backend)
            results[f"{backend}_runs_as"] = describe_attention(device, dtype, head_dim)
            s, _, out = timed(lambda: ours(x1, t1, cache1), device=device, reps=reps, warmup=warmup)
            outs[f"ours_{backend}"] = out
            del out
            timer = TimedAttention(LAYOUTS[best], device)
            set_attention(ours, timer)
            ours(x1, t1, cache1)
            for key, value in timer.tflops().items():
                results[f"{backend}_attn_{key}"] = value
            set_attention(ours, LAYOUTS[best])
            g_s, g_peak, _ = timed(step_two, device=device, reps=max(1, reps - 1), warmup=1)
            results[f"{backend}_b1_s"], results[f"{backend}_guided_step_s"] = round(s, 4), round(g_s, 4)
            log(f"backend {backend} ({results[f'{backend}_runs_as']}): b1 {s:.3f} s, guided step {g_s:.3f} s, "
                f"attention in model: self {results.get(f'{backend}_attn_self_tflops')} TFLOP/s "
                f"({results.get(f'{backend}_attn_self_ms')} ms/forward), cross "
                f"{results.get(f'{backend}_attn_cross_tflops')} TFLOP/s")
            save()
        use_ours(ours, fused=True, chosen_attention=True, fp32_residual=FP32_RESIDUAL, variant=best)

    # 5. Full guided sample through PAN2Pipeline (random weights).
    if args.sample:
        from pan2render.models.pipeline import PAN2Pipeline, PAN2PipelineConfig
        from pan2render.models.samplers import SchedulerConfig

        vae_stub = sample_only_vae(config)
        pipe = PAN2Pipeline(dit=ours, vae=vae_stub, text_encoder=None, scheduler_config=SchedulerConfig(),
                            config=PAN2PipelineConfig(device=str(device), dtype=dtype), model_id="bench-random")
        sync(device)
        t0 = time.perf_counter()
        pipe.sample(prompt_embeds=ctx1[0], negative_prompt_embeds=ctx2[1], height=args.height, width=args.width,
                    frames=args.frames, steps=args.steps, guidance=args.guidance, seed=0)
        sync(device)
        results["sample_s"] = round(time.perf_counter() - t0, 2)
        results["sample_steps"] = args.steps
        results["sample_attention"] = pipe.attention_backend
        log(f"guided sample, {args.steps} steps, guidance {args.guidance}, layout {best}, fp32 residual "
            f"{pipe.config.dit_fp32_residual}, attention {pipe.attention_backend}: {results['sample_s']} s")
        save()

    # 5b. The same short guided sample per backend, same seed: how far the final latents drift.
    ran = [b for b in backends if f"{b}_b1_s" in results]
    if args.compare_steps > 0 and len(ran) > 1:
        from pan2render.models.pipeline import PAN2Pipeline, PAN2PipelineConfig
        from pan2render.models.samplers import SchedulerConfig

        vae_stub = sample_only_vae(config)
        pipe = PAN2Pipeline(dit=ours, vae=vae_stub, text_encoder=None, scheduler_config=SchedulerConfig(),
                            config=PAN2PipelineConfig(device=str(device), dtype=dtype), model_id="bench-random")
        latents: dict[str, torch.Tensor] = {}
        results["compare_steps"] = args.compare_steps
        for backend in ran:
            attn_mod.set_attention_backend(backend)
            latents[backend] = pipe.sample(prompt_embeds=ctx1[0], negative_prompt_embeds=ctx2[1], height=args.height,
                                           width=args.width, frames=args.frames, steps=args.compare_steps,
                                           guidance=args.guidance, seed=0).float()
        attn_mod.set_attention_backend("auto")
        for other in ran[1:]:
            key = f"latents_rel_l2_{ran[0]}_vs_{other}"
            results[key] = round(rel_l2(latents[ran[0]], latents[other]), 6)
            log(f"{args.compare_steps}-step guided sample, final latents {ran[0]} vs {other}: "
                f"rel L2 {results[key]:.3e}")
        del latents
        save()

    # 6. fp32 reference (strict: no TF32), batch 1: diffusers' model upcast in place.
    if not args.no_fp32:
        matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        ref.float()
        t0 = time.perf_counter()
        with torch.no_grad():
            want = ref(x1.float(), t1, ctx1.float(), return_dict=False)[0]
        sync(device)
        results["fp32_reference_s"] = round(time.perf_counter() - t0, 2)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
        for name, out in outs.items():
            results[f"rel_l2_{name}"] = round(rel_l2(out, want), 5)
        if "ours_unfused" in outs:  # the fused default vs diffusers' numerics (bound: <= 1e-2)
            results["fused_vs_unfused_error_ratio"] = round(
                results[f"rel_l2_ours_fused_{best}"] / max(results["rel_l2_ours_unfused"], 1e-12), 3)
            log(f"rel L2: diffusers bf16 {results['rel_l2_diffusers']:.3e}, ours unfused (diffusers' "
                f"numerics) {results['rel_l2_ours_unfused']:.3e}, ours fused default [{best}] "
                f"{results[f'rel_l2_ours_fused_{best}']:.3e} (x{results['fused_vs_unfused_error_ratio']})")
        log("rel L2 vs fp32 reference: " + ", ".join(f"{k} {results[f'rel_l2_{k}']:.3e}" for k in outs)
            + f" (fp32 forward {results['fp32_reference_s']} s)")
        save()

    print(json.dumps(results, indent=1))
    print(summary_table(results, backends), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
