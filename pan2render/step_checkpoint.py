"""Step checkpoints: the file a sampling stopped between two steps continues from, and its check.

A step checkpoint is one safetensors file (kept and sent as ``bytes``) holding everything the
next step reads, so that a sampling resumed from it is the same computation as one never stopped:

    latents           float32 [1, C, T, h, w]   the sample after ``step`` steps
    schedule          float32 [N + 1]           the sigmas it runs over (flow shift, DMD timesteps)
    generator         uint8 [G]                 the job's CPU noise generator (``get_state()``)
    sampler.<name>    float32 [1, C, T, h, w]   the sampler's own tensors (UniPC: its history)

and, in the metadata (strings): the format and its version, what it belongs to (`CheckpointKey`:
spec hash, model id, sampler, step count, seed, guidance, latent shape), the step it stopped after,
the sampler's small counters, and a sha256 over all of that and every tensor's bytes, so a single
flipped byte anywhere is refused.

Torch-free (numpy and safetensors only), like ``sampling.py``: the runner's driver checks a
checkpoint without importing torch; ``models.sampler_state`` packs and unpacks the torch side
through the same rules.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import numpy as np

FORMAT = "pan2render.step-checkpoint"
VERSION = 1
LATENTS, SCHEDULE, GENERATOR = "latents", "schedule", "generator"
SAMPLER_PREFIX = "sampler."  # the sampler's own tensors: "sampler.<name>"
DIGEST_KEY = "sha256"
_HEADER_LEN = 8  # safetensors: a little-endian u64 header length, then the JSON header


class StepCheckpointError(ValueError):
    """A step checkpoint that cannot continue this sampling: damaged, stale or foreign. The message
    says which and why; the sampling then starts from its first step instead."""


@dataclass(frozen=True)
class CheckpointKey:
    """What a step checkpoint must match to continue a sampling: the job and its request."""

    model_id: str  # the loaded checkpoint's id (PAN2Pipeline.model_id)
    sampler: str  # unipc, euler or dmd
    total_steps: int  # N, the schedule's length
    latent_shape: tuple[int, ...]  # [1, C, T, h, w]
    seed: int
    guidance: float
    spec_hash: str = ""  # the job's (the runner's); "" where there is none (library use): not compared


@dataclass(frozen=True)
class CheckpointHeader:
    """A step checkpoint's metadata, parsed."""

    key: CheckpointKey
    step: int  # steps done; the sampling continues with step index ``step`` (0-based)
    counters: dict[str, int]  # the sampler's small ints (UniPC: the last predictor's order)


def key_problem(found: CheckpointKey, expected: CheckpointKey) -> str | None:
    """Why a checkpoint of ``found`` cannot continue a sampling of ``expected`` (None: it can). An
    empty spec hash on the expected side is not compared."""
    for f in fields(CheckpointKey):
        have, want = getattr(found, f.name), getattr(expected, f.name)
        if f.name == "spec_hash" and not want:
            continue
        if have != want:
            return f"stale: it belongs to {f.name} {_shown(have)}, this sampling's is {_shown(want)}"
    return None


def _shown(value: object) -> str:
    return repr(value[:12]) if isinstance(value, str) and len(value) == 64 else repr(value)


def step_problem(step: int, total_steps: int) -> str | None:
    """A checkpoint lies between two steps: after at least one, before the last."""
    if not 1 <= step < total_steps:
        return f"damaged: step {step} is not a boundary of a {total_steps}-step sampling (1..{total_steps - 1})"
    return None


# ---------------------------------------------------------------------------------- writing
def metadata_for(header: CheckpointHeader, arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    """The safetensors metadata of a checkpoint of ``arrays`` (name -> C-contiguous array), its
    digest included. ``models.sampler_state`` passes numpy views of its CPU tensors."""
    key = header.key
    meta = {
        "format": FORMAT, "version": str(VERSION), "spec_hash": key.spec_hash, "model_id": key.model_id,
        "sampler": key.sampler, "total_steps": str(key.total_steps), "step": str(header.step),
        "latent_shape": json.dumps(list(key.latent_shape)), "seed": str(key.seed),
        # repr of a float reads back as the same float
        "guidance": repr(float(key.guidance)), "counters": json.dumps(header.counters, sort_keys=True),
    }
    meta[DIGEST_KEY] = _digest(meta, arrays)
    return meta


def _digest(meta: Mapping[str, str], arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over the metadata (all but the digest) and each tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != DIGEST_KEY}, sort_keys=True).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
        h.update(a.view(np.uint8).reshape(-1).data)
    return h.hexdigest()


# ---------------------------------------------------------------------------------- reading
def read_checkpoint(data: bytes, *, spec_hash: str = "", model_id: str = ""
                    ) -> tuple[CheckpointHeader, dict[str, np.ndarray]]:
    """Parse and check a step checkpoint: its format and version, its digest, its structure and,
    where given, that it belongs to ``spec_hash`` / ``model_id``. Returns its header and tensors
    (numpy). Raises `StepCheckpointError` saying why it cannot be used. What the request decides
    (sampler, steps, shape, seed, guidance, schedule) the sampler checks against the request."""
    meta = _metadata(data)
    if meta.get("format") != FORMAT:
        raise StepCheckpointError(f"foreign: not a pan2-render step checkpoint (format {meta.get('format')!r})")
    if meta.get("version") != str(VERSION):
        raise StepCheckpointError(f"stale: step checkpoint format version {meta.get('version')!r}, this "
                                  f"pan2-render reads version {VERSION}")
    arrays = _arrays(data)
    if meta.get(DIGEST_KEY) != _digest(meta, arrays):
        raise StepCheckpointError("damaged: its sha256 does not match its contents")
    header = _header(meta)
    expected = replace(header.key, spec_hash=spec_hash or header.key.spec_hash,
                       model_id=model_id or header.key.model_id)
    problem = key_problem(header.key, expected) or step_problem(header.step, header.key.total_steps) \
        or _structure_problem(header, arrays)
    if problem:
        raise StepCheckpointError(problem)
    return header, arrays


def checkpoint_problem(data: bytes, *, spec_hash: str = "", model_id: str = "") -> str | None:
    """`read_checkpoint`'s verdict as a problem string (None: usable), as the runner's checks return."""
    try:
        read_checkpoint(data, spec_hash=spec_hash, model_id=model_id)
    except StepCheckpointError as e:
        return str(e)
    return None


def _metadata(data: bytes) -> dict[str, str]:
    if len(data) < _HEADER_LEN:
        raise StepCheckpointError(f"damaged: {len(data)} bytes, shorter than a safetensors header")
    n = int.from_bytes(data[:_HEADER_LEN], "little")
    if n > len(data) - _HEADER_LEN:
        raise StepCheckpointError(f"damaged: its header claims {n} bytes, the file has {len(data)}")
    try:
        header = json.loads(data[_HEADER_LEN:_HEADER_LEN + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StepCheckpointError(f"damaged: unreadable safetensors header ({e})") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise StepCheckpointError("foreign: a safetensors file without step-checkpoint metadata")
    return meta


def _arrays(data: bytes) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError  # the Rust extension, only when reading
    from safetensors.numpy import load

    try:
        return load(data)
    except (SafetensorError, ValueError, TypeError) as e:
        raise StepCheckpointError(f"damaged: the tensors do not load ({e})") from e


def _header(meta: Mapping[str, str]) -> CheckpointHeader:
    try:
        shape = tuple(json.loads(meta["latent_shape"]))
        counters = json.loads(meta["counters"])
        key = CheckpointKey(model_id=meta["model_id"], sampler=meta["sampler"],
                            total_steps=int(meta["total_steps"]), latent_shape=shape, seed=int(meta["seed"]),
                            guidance=float(meta["guidance"]), spec_hash=meta["spec_hash"])
        step = int(meta["step"])
    except (KeyError, ValueError, TypeError) as e:
        raise StepCheckpointError(f"damaged: its metadata does not parse ({type(e).__name__}: {e})") from e
    if not (all(isinstance(s, int) for s in shape) and isinstance(counters, dict)
            and all(isinstance(v, int) for v in counters.values())):
        raise StepCheckpointError("damaged: its latent shape or counters are not integers")
    return CheckpointHeader(key=key, step=step, counters=counters)


def _structure_problem(header: CheckpointHeader, arrays: Mapping[str, np.ndarray]) -> str | None:
    """The tensors every checkpoint holds, with the dtypes and shapes its header implies."""
    shape, n = header.key.latent_shape, header.key.total_steps
    want = {LATENTS: (np.float32, shape), SCHEDULE: (np.float32, (n + 1,)), GENERATOR: (np.uint8, None)}
    want |= {k: (np.float32, shape) for k in arrays if k.startswith(SAMPLER_PREFIX)}
    for name, (dtype, dims) in want.items():
        a = arrays.get(name)
        if a is None:
            return f"damaged: no {name!r} tensor"
        if a.dtype != dtype or (dims is not None and a.shape != dims) or (dims is None and a.ndim != 1):
            return f"damaged: {name!r} is {a.dtype} {list(a.shape)}, expected {np.dtype(dtype)} " \
                   f"{list(dims) if dims is not None else '[G]'}"
    extra = sorted(set(arrays) - set(want))
    if extra:
        return f"foreign: unexpected tensors {extra}"
    if not np.isfinite(arrays[LATENTS]).all():
        return "damaged: non-finite latents"
    return None

