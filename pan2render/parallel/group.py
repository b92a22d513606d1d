"""Small helpers over a torch.distributed process group (the runner creates the group).

Everything here takes the group as given: this package never calls ``init_process_group``. The
collectives are the few the sequence-parallel DiT and the split decode need, written so that they
run on gloo (CPU tests) and NCCL (GPUs) alike: gloo has no ``all_gather_into_tensor``, so the
gather goes through ``all_gather`` with a list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["SequenceGroup", "all_gather_seq", "all_reduce_and", "all_to_all_dim0", "any_rank", "broadcast_from_first",
           "comm_device"]


@dataclass(frozen=True)
class SequenceGroup:
    """A process group with its size and this process's rank in it, resolved once."""

    group: dist.ProcessGroup | None  # None: the default (WORLD) group
    rank: int  # this process's rank in ``group``
    world_size: int  # number of ranks in ``group``

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.world_size}")

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> SequenceGroup:
        """Resolve ``group`` (None: WORLD). Needs ``torch.distributed`` initialised."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call init_process_group (the runner does it for a "
                "group of GPUs) before parallelizing a pipeline"
            )
        return cls(group=group, rank=dist.get_rank(group), world_size=dist.get_world_size(group))

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.group))

    def global_rank(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (what point-to-point calls take)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


def all_to_all_dim0(x: Tensor, group: SequenceGroup) -> Tensor:
    """Chunk i of ``x`` along dim 0 goes to rank i; returns the chunks received, source-rank major.

    x ``[N, ...]`` with N = world size, contiguous -> ``[N, ...]`` where out[j] came from rank j.
    """
    if x.shape[0] != group.world_size:
        raise ValueError(f"all_to_all_dim0: dim 0 is {x.shape[0]}, expected the world size {group.world_size}")
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group.group)
    return out


def all_gather_seq(x: Tensor, group: SequenceGroup, *, dim: int) -> Tensor:
    """Concatenate every rank's ``x`` (same shape everywhere) along ``dim``, in rank order."""
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    return torch.cat(parts, dim=dim)


def all_reduce_and(flag: bool, group: SequenceGroup, *, device: torch.device) -> tuple[bool, list[bool]]:
    """Whether ``flag`` holds on every rank, and each rank's flag (rank order).

    One all-gather of a 1-element tensor (on ``device``: NCCL needs CUDA tensors), so every rank
    learns which ranks said no and can name them in the one log line.
    """
    mine = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    parts = [torch.empty_like(mine) for _ in range(group.world_size)]
    dist.all_gather(parts, mine, group=group.group)
    flags = [bool(p.item()) for p in parts]
    return all(flags), flags


def comm_device(group: SequenceGroup, device: torch.device) -> torch.device:
    """Where the small tensors of a collective over ``group`` live for work on ``device``: the CUDA
    device on NCCL (which takes CUDA tensors only), the CPU on gloo."""
    if group.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device()) if device.type != "cuda" else device
    return torch.device("cpu")


def any_rank(flag: bool, group: SequenceGroup, *, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank: one all-reduce (max) of a 1-element tensor on ``device``."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.group)
    return bool(t.item())


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what broadcast_from_first moves
_HEADER = 8  # int64 slots: [dtype index, ndim, *shape]


def broadcast_from_first(x: Tensor | None, group: SequenceGroup, *, device: torch.device) -> Tensor:
    """Rank 0's ``x`` on every rank (the others pass None: its dtype and shape travel first, in a
    small header). Collective: every rank of the group calls it. ``device``: where the received
    tensor lives (NCCL needs CUDA)."""
    if group.rank == 0:
        if x is None or x.dtype not in _DTYPES or x.dim() > _HEADER - 2:
            raise ValueError(f"broadcast_from_first: rank 0 must give a tensor of <= {_HEADER - 2} dims "
                             f"in one of {_DTYPES}")
        values = [_DTYPES.index(x.dtype), x.dim(), *x.shape]
        head = torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64, device=device)
    else:
        head = torch.empty(_HEADER, dtype=torch.int64, device=device)
    src = group.global_rank(0)
    dist.broadcast(head, src, group=group.group)
    dtype_index, ndim, *rest = head.tolist()
    out = x.contiguous() if group.rank == 0 else torch.empty(rest[:ndim], dtype=_DTYPES[dtype_index], device=device)
    dist.broadcast(out, src, group=group.group)
    return out
