"""`parallelize_pipeline`: a `PAN2Pipeline` rebuilt from sequence-parallel strategies.

The pipeline itself knows no process group: it samples through its `Denoiser` and decodes through its
`FrameDecoder` (`pan2render.models.strategies`). Here the group's strategies are chosen, from the same
config switches the single-process ones come from, in this order:

1. the denoiser: Ulysses over the whole group for every forward (`UlyssesDenoiser`); on an even group
   with ``guidance_parallel``, guided steps one branch per half of the group instead
   (`GuidanceSplitDenoiser`; creating the halves' process groups is collective);
2. the frame decoder: with ``vae_decode_kernel_parallel``, one decode split over the group, the frames
   on rank 0 (`SplitDecoder`); without it every rank keeps its own whole decode.
"""

from __future__ import annotations

import functools
import logging

import torch.distributed as dist

from pan2render.models.pipeline import PAN2Pipeline
from pan2render.models.strategies import Denoiser

from .decode import SplitDecoder
from .group import SequenceGroup
from .guidance import GuidanceSplitDenoiser, guidance_split_for
from .ulysses import UlyssesDenoiser

__all__ = ["parallel_denoiser", "parallelize_pipeline"]

log = logging.getLogger(__name__)


def parallel_denoiser(pipe: PAN2Pipeline, group: SequenceGroup) -> Denoiser:
    """The group's denoiser for ``pipe``'s DiT and config (collective on an even group with the split)."""
    whole = UlyssesDenoiser(pipe.dit, group)
    split = guidance_split_for(pipe.dit, group, enabled=pipe.config.guidance_parallel)
    return whole if split is None else GuidanceSplitDenoiser(split, unguided=whole)


@functools.singledispatch
def parallelize_pipeline(pipe: object, group: dist.ProcessGroup | SequenceGroup | None) -> object:
    """A pipeline that runs sequence-parallel over ``group`` (an initialised torch.distributed group;
    None: WORLD). Called collectively, once per pipeline, on every rank of the group.

    After this, every rank calls ``sample(...)`` with identical arguments and gets the same full
    latents; ``decode(latents)`` returns the frames on rank 0 and None on the other ranks when
    ``config.vae_decode_kernel_parallel`` is on (every rank decodes the whole video itself when it is
    off). A group of one returns the pipeline as it is. Another pipeline class says how it runs on a
    group by registering its own implementation (``parallelize_pipeline.register``).
    """
    raise TypeError(f"parallelize_pipeline has no implementation for {type(pipe).__name__}; "
                    f"register one with parallelize_pipeline.register")


@parallelize_pipeline.register
def _(pipe: PAN2Pipeline, group: dist.ProcessGroup | SequenceGroup | None) -> PAN2Pipeline:
    seq = group if isinstance(group, SequenceGroup) else SequenceGroup.of(group)
    if seq.world_size == 1:
        return pipe
    if pipe.denoiser.ranks > 1:
        raise ValueError("this pipeline is already parallelized; build a new one for another group")
    config = pipe.config
    denoiser = parallel_denoiser(pipe, seq)
    decoder: SplitDecoder | None = None  # without the split, every rank keeps its own whole decode
    if config.vae_decode_kernel_parallel:
        decoder = SplitDecoder(pipe.vae, seq, kernel=config.vae_decode_kernel)
    parallel = pipe.with_strategies(denoiser=denoiser, frame_decoder=decoder)
    if seq.rank == 0:
        steps = parallel.describe()
        log.info("%s: parallel over %d ranks: guided steps %s, unguided steps %s, decode %s, attention %s",
                 pipe.model_id, seq.world_size, steps["guided_steps"], steps["unguided_steps"],
                 steps["decode"], pipe.attention_backend)
    return parallel
