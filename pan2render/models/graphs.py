"""The DiT forward replayed from a CUDA graph: the same kernels without the host's launch gaps.

A 704x1248x121 forward is ~420 kernel launches and ~0.78 s on an H200, and part of the wall time
is the GPU waiting for the host (Python, the attention library's dispatch, Triton's launcher).
A CUDA graph records the launches once and replays them with no host work in between.
`CUDAGraphDiT` wraps a `PAN2DiT` with the `DiTModule` contract of `strategies.py`, so a denoiser
calls it exactly like the model:

- The first call at a shape runs eagerly (it compiles and autotunes whatever is lazy: Triton,
  the attention library, cuBLAS's heuristics); a later call at that shape with a text context
  not seen before captures a graph, and calls after that replay it. A job's two contexts (its
  conditional and unconditional text) get a graph each, captured on their first step; a new
  job's contexts get new graphs, the old ones are dropped (at most ``max_graphs`` are kept).
- A graph reads its inputs from fixed buffers: each call copies the latents and the timestep in
  (~10 MB), replays, and returns a copy of the graph's output buffer (so an output held by the
  caller is never overwritten by a later replay).
- What the graph captures must not sync with the host: per-sample timesteps ``[B]`` are
  embedded without one (`PAN2DiT.embed_timesteps`); per-token timesteps ``[B, L]`` (first-frame
  conditioning) go through ``torch.unique``, which does sync, so those calls run eagerly.
- Memory: the graphs share one pool, which keeps the forward's activation peak (~2 GiB at
  704x1248x121 in bf16) reserved between steps instead of returning it to PyTorch's cache.
- If a capture fails (an op that cannot be captured), the wrapper logs why once and runs every
  later call eagerly: the same results, only without the gain.

Replaying a graph runs the same kernels on the same inputs as the eager call, so the outputs are
bit-identical (checked by a GPU test and by ``scripts/bench_dit.py``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from .dit import ContextCache, PAN2DiT

log = logging.getLogger(__name__)

__all__ = ["CUDAGraphDiT", "local_dit"]


def local_dit(model: PAN2DiT, *, graphs: bool) -> PAN2DiT | CUDAGraphDiT:
    """What a denoiser running ``model`` on this process alone should call: the model replayed
    from CUDA graphs when ``graphs`` and its weights are on a CUDA device, else the model itself."""
    on_cuda = next(model.parameters()).is_cuda
    return CUDAGraphDiT(model) if graphs and on_cuda else model


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x: Tensor  # input buffers the graph reads
    timestep: Tensor
    out: Tensor  # the output buffer it writes
    context: ContextCache  # held so its K/V memory (read by the graph) stays alive


class CUDAGraphDiT:
    """``PAN2DiT`` forwards replayed from CUDA graphs where they can be (see the module doc)."""

    def __init__(self, model: PAN2DiT, *, max_graphs: int = 2) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs}: must be >= 1")
        self.model = model
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen_shapes: set[tuple] = set()
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self.disabled_because: str | None = None
        self.captures = 0  # graphs captured so far (for tests and benches)

    @property
    def config(self):  # the wrapped model's, for code that reads the DiT's geometry
        return self.model.config

    def prepare_context(self, context: Tensor) -> ContextCache:
        return self.model.prepare_context(context)

    def __call__(self, x: Tensor, timestep: Tensor, context: Tensor | ContextCache) -> Tensor:
        if not self._graphable(x, timestep, context):
            return self.model(x, timestep, context)
        shape = (tuple(x.shape), x.dtype, x.device, tuple(timestep.shape), timestep.dtype)
        if shape not in self._seen_shapes:
            out = self.model(x, timestep, context)  # first call at this shape: compiles, autotuning
            self._seen_shapes.add(shape)
            return out
        key = (shape, id(context))
        entry = self._graphs.get(key)  # the entry holds the context, so its id is not reused meanwhile
        if entry is None:
            entry = self._capture(key, x, timestep, context)
            if entry is None:
                return self.model(x, timestep, context)
        else:
            self._graphs.move_to_end(key)
        entry.x.copy_(x)
        entry.timestep.copy_(timestep)
        entry.graph.replay()
        return entry.out.clone()

    def _graphable(self, x: Tensor, timestep: Tensor, context: Tensor | ContextCache) -> bool:
        return (self.disabled_because is None and x.is_cuda and isinstance(context, ContextCache)
                and timestep.ndim == 1 and not torch.is_grad_enabled()
                and not torch.cuda.is_current_stream_capturing())

    def _capture(self, key: tuple, x: Tensor, timestep: Tensor, context: ContextCache) -> _Graph | None:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)  # the oldest: a finished job's context
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=x.device)
        static_x, static_t = x.clone(), timestep.clone()
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than the torch.cuda.graph context manager, which empties
        # PyTorch's allocator cache on every capture (the decode would then allocate afresh).
        # "thread_local": the worker's other threads may touch CUDA while this one captures.
        self._stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out = self.model(static_x, static_t, context)
                finally:
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - any op that cannot be captured: run eagerly from now on
            self.disabled_because = f"{type(e).__name__}: {e}"
            self._graphs.clear()
            log.warning("DiT CUDA graphs off for this process, forwards run eagerly: capture failed (%s)",
                        self.disabled_because)
            return None
        finally:
            torch.cuda.current_stream().wait_stream(self._stream)
        self.captures += 1
        entry = _Graph(graph=graph, x=static_x, timestep=static_t, out=out, context=context)
        self._graphs[key] = entry
        return entry
