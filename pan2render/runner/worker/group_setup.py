"""How a group's workers form their torch.distributed group: rank 0 picks where they meet, then
every rank joins there (``RenderWorker``'s set-up calls)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from pan2render.runner.protocol.messages import RendezvousReply
from pan2render.runner.worker import scratch


def rendezvous(device: str) -> RendezvousReply:
    """Where the group's ranks meet: a file of rank 0's own on its node (a group's ranks share a
    node), so the rendezvous opens no port anyone on the network could reach."""
    return RendezvousReply(init_method=f"file://{scratch.group_store()}",
                           backend="nccl" if device == "cuda" else "gloo")


def join_group(*, init_method: str, backend: str, rank: int, world_size: int, device: str, timeout_s: float) -> Any:
    """Join the group where rank 0 said; its default process group once every rank joined."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU as device 0
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    # A first collective proves every rank joined before any job is placed on the group.
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    assert int(probe.item()) == world_size, f"all_reduce gave {probe.item()}"
    return dist.group.WORLD
