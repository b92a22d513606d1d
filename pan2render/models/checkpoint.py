"""Checkpoint loading for the diffusers layout: ``config.json`` + safetensors, sharded or not.

A checkpoint folder (e.g. any Wan2.2-TI2V-5B-Diffusers download) looks like::

    model_index.json
    transformer/config.json + diffusion_pytorch_model[-0000i-of-0000n].safetensors (+ .index.json)
    vae/config.json + diffusion_pytorch_model.safetensors
    text_encoder/  tokenizer/  scheduler/scheduler_config.json

Only safetensors are read: loading never unpickles anything. Every error names the file and the
problem (missing folder or file, missing/unexpected keys listed, key shape mismatch with expected
and found shapes, unsupported config values).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from safetensors import safe_open
from torch import nn

log = logging.getLogger(__name__)

WEIGHTS_NAME = "diffusion_pytorch_model"
MAX_KEYS_LISTED = 12

M = TypeVar("M", bound=nn.Module)


class CheckpointError(ValueError):
    """A checkpoint folder cannot be loaded; the message names the file and what is wrong."""


def resolve_component(path: str | Path, component: str) -> Path:
    """Accept either a component folder itself (holding config.json) or a checkpoint root.

    ``resolve_component("ckpt", "vae")`` -> ``ckpt/vae`` when that exists, else ``ckpt`` when it
    holds a config.json of its own.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise CheckpointError(f"{root}: checkpoint folder does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root}: expected a checkpoint folder, found a file")
    sub = root / component
    if sub.is_dir():
        return sub
    if (root / "config.json").is_file():
        return root
    raise CheckpointError(
        f"{root}: no '{component}/' folder and no config.json here; expected a diffusers-layout "
        f"checkpoint (model_index.json, {component}/config.json, {component}/*.safetensors)"
    )


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def safetensors_files(folder: Path, prefix: str = WEIGHTS_NAME) -> list[Path]:
    """The weight files of a component: ``prefix.safetensors`` or the shards its index lists."""
    single = folder / f"{prefix}.safetensors"
    index = folder / f"{prefix}.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map' mapping keys to shard files")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard file(s) that are missing: {', '.join(missing)}")
        return [folder / n for n in names]
    if single.is_file():
        return [single]
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    hint = f" (found {', '.join(pickles)}: pickle files are not loaded; convert them to safetensors)" if pickles else ""
    raise CheckpointError(f"{folder}: no {prefix}.safetensors and no {prefix}.safetensors.index.json{hint}")


def read_state_dict(
    folder: Path, *, prefix: str = WEIGHTS_NAME, device: str | torch.device = "cpu",
    cast: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of a component and the file each key came from (for error messages).

    Each tensor is read straight onto ``device`` and passed through ``cast(key, tensor)`` at once,
    so at most one tensor is ever held in the file's dtype (an fp32 release read for a bf16 model
    on the GPU never needs the whole fp32 copy, in host or device memory)."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for file in safetensors_files(folder, prefix):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    if key in tensors:
                        raise CheckpointError(f"{file}: key '{key}' also appears in {origin[key]}")
                    t = f.get_tensor(key)
                    tensors[key] = t if cast is None else cast(key, t)
                    origin[key] = file
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated headers etc.
            raise CheckpointError(f"{file}: cannot read safetensors file ({e})") from e
    return tensors, origin


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:MAX_KEYS_LISTED])
    more = f" ... and {len(keys) - MAX_KEYS_LISTED} more" if len(keys) > MAX_KEYS_LISTED else ""
    return shown + more


def check_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, where: Path,
                     origin: dict[str, Path] | None = None) -> None:
    """Raise CheckpointError listing missing / unexpected keys and shape mismatches."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s): {_listed(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s): {_listed(unexpected)}")
    for key in sorted(set(expected) & set(state_dict)):
        want, got = tuple(expected[key].shape), tuple(state_dict[key].shape)
        if want != got:
            src = origin.get(key, where) if origin else where
            problems.append(f"shape mismatch for '{key}' in {src}: expected {list(want)}, found {list(got)}")
    if problems:
        raise CheckpointError(f"{where}: weights do not fit the model config:\n  " + "\n  ".join(problems))


def instantiate(
    build: Callable[[], M],
    folder: Path,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    keep_in_fp32: tuple[str, ...] = (),
) -> M:
    """Build a model without random init and load a component's safetensors into it.

    The module is constructed on the meta device (no memory, no random init: a 5B model builds in
    milliseconds) and the checkpoint tensors are assigned in place of its parameters. Our models
    keep no buffers outside the checkpoint (RoPE tables are computed per call), which is checked
    here: a module that grew one would be left on the meta device. Parameters whose
    name contains one of ``keep_in_fp32`` stay fp32 (the modulation tables and norms, as diffusers
    keeps them), everything else floating point is cast to ``dtype``.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = build()

    def cast(key: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        return t.to(torch.float32 if any(part in key for part in keep_in_fp32) else dtype)

    # Read onto the target device and cast there, tensor by tensor: no fp32 detour through the host.
    state_dict, origin = read_state_dict(folder, device=device, cast=cast)
    check_state_dict(model, state_dict, where=folder, origin=origin)
    model.load_state_dict(state_dict, strict=True, assign=True)
    stale = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not stale, f"tensors not filled from the checkpoint (non-persistent buffers?): {stale}"
    return model.eval().requires_grad_(False)
