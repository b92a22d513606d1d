"""GPU smoke check of the integrated pipeline (run on a CUDA host; prints a short table).

1. The embedded tiny model end to end on CUDA through ``PAN2Pipeline`` (fused DiT kernels and the
   fast VAE decoder switched on): shapes, that the fused kernels ran, that the result is finite, and
   the fused-vs-eager difference on the same request.
2. The full-size Wan2.2 VAE decode (704x1248x121) through ``PAN2Pipeline.decode`` with
   ``vae_decode_kernel`` on and off: time and peak memory above the pre-call allocation (weights
   excluded, output included), so the pipeline's figure can be set beside
   ``scripts/bench_vae_decode.py``'s.

    python scripts/gpu_smoke.py [--skip-full]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def tiny_end_to_end() -> None:
    from pan2render.kernels import dit_fused
    from pan2render.models import PAN2Pipeline, PAN2PipelineConfig

    os.environ.setdefault("PAN2_RENDER_CACHE", tempfile.mkdtemp())
    req = dict(prompt="a red fox in the snow", height=64, width=96, frames=17, steps=8, guidance=2.5, seed=3)
    # Each pipeline applies its own dit_fused_kernels setting to its DiT.
    fused = PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cuda"))
    dit_fused.reset_fused_kernel_counts()
    lat_fused = fused.sample(**req)
    counts = dit_fused.fused_kernel_counts()
    frames = fused.decode(lat_fused)
    eager = PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cuda", dit_fused_kernels=False))
    lat_eager = eager.sample(**req)
    rel = float((lat_fused - lat_eager).abs().max() / lat_eager.abs().max())
    print(f"tiny on CUDA: latents {list(lat_fused.shape)} finite={bool(torch.isfinite(lat_fused).all())}, "
          f"frames {list(frames.shape)} {frames.dtype}, fused-vs-eager max rel {rel:.2e}")
    print(f"fused kernel launches during the fused sample (bf16): {counts}")


def full_size_decode() -> None:
    from pan2render.models import PAN2PipelineConfig
    from pan2render.models.pipeline import PAN2Pipeline
    from pan2render.models.samplers import SchedulerConfig
    from pan2render.models.vae import WanVAE, WanVAEConfig

    with torch.device("cuda"):
        vae = WanVAE(WanVAEConfig()).eval().requires_grad_(False)
    latents = torch.randn(48, 31, 44, 78, generator=torch.Generator().manual_seed(0))
    for fast in (True, False):
        pipe = PAN2Pipeline(dit=None, vae=vae, text_encoder=None, scheduler_config=SchedulerConfig(),
                            config=PAN2PipelineConfig(device="cuda", vae_decode_kernel=fast), model_id="smoke")
        pipe.decode(latents[:, :3])  # warm-up: builds the fast decoder, cuDNN autotuning
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        frames = pipe.decode(latents)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"full-size decode through PAN2Pipeline.decode, vae_decode_kernel={fast}: {seconds:.3f} s, "
              f"peak above pre-call {peak:.2f} GiB, frames {list(frames.shape)} (host copy included)")
        del frames, pipe
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-full", action="store_true")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    tiny_end_to_end()
    if not args.skip_full:
        full_size_decode()


if __name__ == "__main__":
    main()
