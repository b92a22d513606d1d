"""Run a function on a gloo group of N local processes (torch.multiprocessing, spawn), and the tiny
PAN2 pipeline the group tests run.

Workers are module-level functions ``fn(rank, world, out_dir, *args)``; each writes what the test
checks to ``out_dir`` (torch.save), and the parent compares it with a single-process run.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pan2render.models import PAN2Pipeline, PAN2PipelineConfig
from pan2render.models.dit import PAN2DiT, PAN2DiTConfig
from pan2render.models.samplers import SchedulerConfig
from pan2render.models.tiny import SCHEDULER_CONFIG, TINY_VAE_CONFIG
from pan2render.models.vae import WanVAE, WanVAEConfig

HEADS = 8  # 4 heads per rank at N=2, 2 at N=4 (the worker attends them in 4 / 2 overlap groups)


def tiny_pipeline(**config: object) -> PAN2Pipeline:
    """A tiny PAN2 with 8 heads, so groups of 2, 4 and 8 split them evenly."""
    torch.manual_seed(0)  # the same weights in every process
    dit = PAN2DiT(PAN2DiTConfig(num_attention_heads=HEADS, attention_head_dim=12, text_dim=32, freq_dim=32,
                                ffn_dim=64, num_layers=2)).eval()
    vae = WanVAE(WanVAEConfig.from_dict(TINY_VAE_CONFIG)).eval()
    return PAN2Pipeline(dit=dit, vae=vae, text_encoder=None,
                        scheduler_config=SchedulerConfig.from_dict(SCHEDULER_CONFIG),
                        config=PAN2PipelineConfig(device="cpu", dtype=torch.float32, **config), model_id="sp-test")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], out_dir: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)  # N processes share the CI's 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        fn(rank, world, Path(out_dir), *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_group(world: int, fn: Callable[..., None], out_dir: Path, *args: Any) -> list[Any]:
    """Run ``fn`` on ranks 0..world-1; returns each rank's ``out_dir/rank{r}.pt`` (None if absent)."""
    os.environ.setdefault("PAN2_RENDER_CACHE", str(out_dir / "cache"))
    mp.spawn(_entry, args=(world, _free_port(), fn, str(out_dir), args), nprocs=world, join=True)
    results = []
    for r in range(world):
        path = out_dir / f"rank{r}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return results


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
