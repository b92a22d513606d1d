"""Tensors packed into the artifacts' safetensors bytes on the workers, and read back there.

The format (file names, metadata keys, the digests) and its checks are ``protocol/artifacts.py``'s:
the driver checks what these write with numpy alone, so it never imports torch.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load, save

from pan2render.runner.protocol.artifacts import FAST_LANES_KEY, SEGMENT_KEY, NonFiniteError, array_digest


def pack_embedding(emb: torch.Tensor, *, key: str, text_encoder_id: str) -> bytes:
    """emb: float32 [512, text_dim] -> safetensors bytes carrying its cache key and the sha256 of
    the tensor's bytes (the cache is keyed by prompt, not content: the digest is what proves a
    cached file holds what the encoder wrote)."""
    emb = emb.detach().to("cpu", torch.float32).contiguous()
    return save({"prompt_embeds": emb}, metadata={"key": key, "text_encoder_id": text_encoder_id,
                                                  "sha256": array_digest(emb.numpy())})


def unpack_embedding(data: bytes) -> torch.Tensor:
    return load(data)["prompt_embeds"]


def pack_latents(lat: torch.Tensor, *, spec_hash: str, seed: int, steps: int, model_id: str,
                 spec: dict[str, Any] | None = None, fast_lanes: dict[str, Any] | None = None,
                 segment: dict[str, Any] | None = None) -> bytes:
    """lat: float32 [48, T, h, w]. Raises NonFiniteError before anything is written. ``spec`` (the
    job's resolved spec) travels in the metadata so ``repair`` can rebuild the job from the file;
    ``fast_lanes`` (the sampling plan's record: which steps computed) so params.json can show it;
    ``sha256`` (of the tensor's bytes) proves the data is what the sampler wrote, where no ledger
    recorded the file's digest (``repair``); ``segment``: which segment of a chained job they are."""
    lat = lat.detach().to("cpu", torch.float32).contiguous()
    if not torch.isfinite(lat).all():
        bad = int((~torch.isfinite(lat)).sum())
        raise NonFiniteError(
            f"sampling produced non-finite latents ({bad} of {lat.numel()} values NaN/Inf, shape "
            f"{list(lat.shape)}); this is deterministic for the spec: change seed, steps or guidance"
        )
    meta = {"spec_hash": spec_hash, "seed": str(seed), "steps": str(steps), "model_id": model_id,
            "sha256": array_digest(lat.numpy())}
    if spec is not None:
        meta["spec"] = json.dumps(spec, sort_keys=True)
    if fast_lanes is not None:
        meta[FAST_LANES_KEY] = json.dumps(fast_lanes, sort_keys=True)
    if segment is not None:
        meta[SEGMENT_KEY] = json.dumps(segment, sort_keys=True)
    return save({"latents": lat}, metadata=meta)


def unpack_latents(data: bytes) -> torch.Tensor:
    return load(data)["latents"]
