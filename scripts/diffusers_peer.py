"""diffusers as the benchmarks' peer, run the way an expert runs it (bench_dit.py, bench_batch.py).

"Expert" is the strongest stock configuration of diffusers' WanTransformer3DModel, from diffusers'
own API and nothing of ours:

- ``model.set_attention_backend("_native_cudnn")``: every attention through PyTorch's SDPA with
  the cuDNN kernel forced (diffusers' default lets SDPA pick, which on an H200 takes flash);
- ``model.compile_repeated_blocks(fullgraph=True)``: torch.compile on each ``WanTransformerBlock``
  (the class in the model's ``_repeated_blocks``), one graph per block with no breaks allowed. The
  blocks share their code, so the compile is paid once, at the first call.

On a CPU (the scripts' --tiny smoke runs) cuDNN attention does not exist: the blocks are still
compiled, with diffusers' default attention, and the reason is logged and recorded.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

EXPERT_ATTENTION = "_native_cudnn"  # diffusers' AttentionBackendName._NATIVE_CUDNN
EXPERT_COMPILE = "compile_repeated_blocks(fullgraph=True)"


def expert_attention(device: Any) -> tuple[str | None, str | None]:
    """(the attention backend an expert sets on ``device``, or None for diffusers' default; why not)."""
    import torch

    if device.type != "cuda":
        return None, f"cuDNN attention needs a CUDA device, this one is {device.type}: diffusers' default attention"
    if not torch.backends.cudnn.is_available():
        return None, "torch was built without cuDNN: diffusers' default attention"
    return EXPERT_ATTENTION, None


def make_expert(model: Any, device: Any) -> dict[str, Any]:
    """Configure the diffusers ``model`` (a WanTransformer3DModel) in place as an expert runs it.

    Returns what was set, for the results. Nothing compiles here: torch.compile does its work at the
    model's first call, so the caller times that call apart from the steady ones."""
    from diffusers import attention_backend

    backend, why = expert_attention(device)
    if backend is not None:
        # set_attention_backend also makes the backend diffusers' process-wide default, which would
        # move any other diffusers model of this process (the eager peer) onto cuDNN as well; the
        # context manager puts the default back when it exits. This model keeps cuDNN: its
        # processors hold the backend themselves.
        with attention_backend():
            model.set_attention_backend(backend)
    model.compile_repeated_blocks(fullgraph=True)
    return {"attention": backend or "default", "attention_note": why, "compile": EXPERT_COMPILE}


def time_expert_forward(ref: Any, inputs: tuple, *, device: Any, timed: Callable, log: Callable) -> tuple[dict, Any]:
    """The forward of diffusers' model ``ref`` (batch 1) as an expert runs it, on a copy, so that
    ``ref`` stays eager. ``timed(fn)`` times the steady forward as the caller times every other one
    and returns (seconds, activation peak GiB, output). The first call (torch.compile's work and
    cuDNN's plans) is timed on its own.

    Returns (the figures under their result names, the output). Only one shape is timed: a second
    would be a second compile, which a pipeline at batch 1 never pays."""
    import torch

    expert = copy.deepcopy(ref)
    setup = make_expert(expert, device)
    log(f"diffusers expert: attention {setup['attention']}, {setup['compile']}"
        + (f" ({setup['attention_note']})" if setup["attention_note"] else ""))

    def forward() -> Any:
        return expert(*inputs, return_dict=False)[0]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    t0 = time.perf_counter()
    forward()
    sync()
    first = time.perf_counter() - t0
    seconds, peak, out = timed(forward)
    log(f"diffusers expert b1: first call (compile) {first:.1f} s, then {seconds:.3f} s, "
        f"activation peak {peak:.1f} GiB")
    torch.compiler.reset()  # the compiled blocks are not called again; the copy goes with this frame
    return {"diffusers_expert": setup, "diffusers_expert_first_call_s": round(first, 2),
            "diffusers_expert_b1_s": round(seconds, 4), "diffusers_expert_b1_peak_gib": round(peak, 2)}, out
