"""Sequence-parallel groups: applied to a plain pipeline from outside.

- `parallelize_dit` (ulysses.py): Ulysses sequence parallelism for the PAN2 DiT;
- `pipelined_decode` / `decode_on_group` (decode.py): ``vae_decode_kernel_parallel``, one VAE
  decode split over the group, the frames on rank 0;
- `GuidanceSplit` (guidance.py): in an even group, a guided step's two branches on the two halves
  of the group, each half Ulysses-parallel over its own ranks;
- `parallelize_pipeline`: all three, for `PAN2Pipeline.parallelize(group)` (what the runner calls
  once per actor after ``init_process_group``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from .decode import agree_fast_decode, decode_on_group, pipelined_decode
from .group import SequenceGroup
from .guidance import GuidanceSplit, guidance_split_for
from .ulysses import SequenceParallelDiT, UlyssesAttention, parallelize_dit

__all__ = [
    "GuidanceSplit",
    "SequenceGroup",
    "SequenceParallelDiT",
    "UlyssesAttention",
    "agree_fast_decode",
    "decode_on_group",
    "parallelize_dit",
    "parallelize_pipeline",
    "pipelined_decode",
]

log = logging.getLogger(__name__)


def parallelize_pipeline(pipe: Any, group: dist.ProcessGroup | SequenceGroup | None) -> Any:
    """Make a `PAN2Pipeline` sequence-parallel over ``group`` (in place; returns it).

    After this, every rank calls ``pipe.sample(...)`` with identical arguments and gets the same
    full latents (guided steps over the two halves of an even group when
    ``config.guidance_parallel``, else and for unguided steps Ulysses over the whole group);
    ``pipe.decode(latents)`` returns the frames on rank 0 and None on the other
    ranks when ``config.vae_decode_kernel_parallel`` is on (every rank decodes the whole video
    itself when it is off). A group of one leaves the pipeline as it is.
    """
    seq = group if isinstance(group, SequenceGroup) else SequenceGroup.of(group)
    if seq.world_size == 1:
        return pipe
    if pipe.process_group is not None:
        raise ValueError("this pipeline is already parallelized; build a new one for another group")
    plain = pipe.dit
    pipe.dit = parallelize_dit(plain, seq)
    pipe.guidance_split = guidance_split_for(plain, seq, enabled=pipe.config.guidance_parallel)
    pipe.process_group = seq
    if seq.rank == 0:
        split = pipe.guidance_split
        guided = (f"guided steps one branch per half ({split.half_size} rank(s) each)" if split is not None
                  else "guided steps Ulysses over the whole group")
        log.info("%s: parallel over %d ranks: %s, unguided steps Ulysses over the whole group, decode %s, "
                 "attention %s", pipe.model_id, seq.world_size, guided,
                 "split by layers" if pipe.config.vae_decode_kernel_parallel else "on every rank",
                 pipe.attention_backend)
    return pipe
