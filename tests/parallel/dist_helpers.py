"""Run a function on a gloo group of N local processes (torch.multiprocessing, spawn).

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
