"""Sequence-parallel groups: applied to a plain pipeline from outside.

- `parallelize_dit` (ulysses.py): Ulysses sequence parallelism for the PAN2 DiT; `UlyssesDenoiser`,
  the denoiser that runs every forward through it over the whole group;
- `GuidanceSplit` / `GuidanceSplitDenoiser` (guidance.py): in an even group, a guided step's two
  branches on the two halves of the group, each half Ulysses-parallel over its own ranks;
- `pipelined_decode` (decode.py): ``vae_decode_kernel_parallel``, one VAE decode split over the
  group, the frames on rank 0; `SplitDecoder`, the frame decoder around it; `agree_fast_decode`,
  the group's decode path (the fast decoder only if every rank can run it);
- `parallelize_pipeline` (pipeline.py): a `PAN2Pipeline` built from these strategies (what the
  runner calls once per actor after ``init_process_group``).

Imports go one way: this package builds on `pan2render.models`, never the reverse.
"""

from __future__ import annotations

from .decode import SplitDecoder, agree_fast_decode, group_agreement, pipelined_decode
from .group import SequenceGroup
from .guidance import GuidanceSplit, GuidanceSplitDenoiser, guidance_split_for
from .pipeline import parallel_denoiser, parallelize_pipeline
from .ulysses import SequenceParallelDiT, UlyssesAttention, UlyssesDenoiser, parallelize_dit

__all__ = [
    "GuidanceSplit",
    "GuidanceSplitDenoiser",
    "SequenceGroup",
    "SequenceParallelDiT",
    "SplitDecoder",
    "UlyssesAttention",
    "UlyssesDenoiser",
    "agree_fast_decode",
    "group_agreement",
    "guidance_split_for",
    "parallel_denoiser",
    "parallelize_dit",
    "parallelize_pipeline",
    "pipelined_decode",
]
