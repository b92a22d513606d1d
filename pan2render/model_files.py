"""What a model folder (a diffusers-layout checkpoint) must hold before its weights are read, and
the id a loaded model goes by, torch-free.

The model loaders (``pan2render.models``) find a component's config and weight files through these
functions; ``pan2-render validate`` and the runner's check before a batch starts (which never import
torch) use them to find every reason a load would refuse a folder: a folder or file missing, a config
that is not JSON, a shard an index lists but the folder lacks. No weights are read here. `model_id`
is the id a loaded pipeline reports (``PAN2Pipeline.model_id``), which names the model's MagCache
calibration: validation reads the same id from the folder without loading it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WEIGHTS_NAME = "diffusion_pytorch_model"
# The components PAN2Pipeline.from_pretrained loads with weights, each with the name its weight files
# start with (transformers' text encoder writes model.safetensors, diffusers' models
# diffusion_pytorch_model). The DiT and the VAE may also be given as their own folder
# (resolve_component); the text encoder is always the root's text_encoder/ beside tokenizer/.
WEIGHTED_COMPONENTS: tuple[tuple[str, str], ...] = (("transformer", WEIGHTS_NAME), ("vae", WEIGHTS_NAME),
                                                    ("text_encoder", "model"))
TEXT_ENCODER_DIR, TOKENIZER_DIR = "text_encoder", "tokenizer"
SCHEDULER_CONFIG = "scheduler/scheduler_config.json"  # optional: the samplers' defaults without it


class ModelFolderError(ValueError):
    """A model folder cannot be loaded; the message names the file and what is wrong."""


def resolve_component(path: str | Path, component: str) -> Path:
    """Accept either a component folder itself (holding config.json) or a checkpoint root.

    ``resolve_component("ckpt", "vae")`` -> ``ckpt/vae`` when that exists, else ``ckpt`` when it
    holds a config.json of its own.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise ModelFolderError(f"{root}: checkpoint folder does not exist")
    if not root.is_dir():
        raise ModelFolderError(f"{root}: expected a checkpoint folder, found a file")
    sub = root / component
    if sub.is_dir():
        return sub
    if (root / "config.json").is_file():
        return root
    raise ModelFolderError(
        f"{root}: no '{component}/' folder and no config.json here; expected a diffusers-layout "
        f"checkpoint (model_index.json, {component}/config.json, {component}/*.safetensors)"
    )


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelFolderError(f"{path}: file is missing")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelFolderError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def safetensors_files(folder: Path, prefix: str = WEIGHTS_NAME) -> list[Path]:
    """The weight files of a component: ``prefix.safetensors`` or the shards its index lists."""
    single = folder / f"{prefix}.safetensors"
    index = folder / f"{prefix}.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFolderError(f"{index}: has no 'weight_map' mapping keys to shard files")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelFolderError(f"{index}: lists shard file(s) that are missing: {', '.join(missing)}")
        return [folder / n for n in names]
    if single.is_file():
        return [single]
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    hint = f" (found {', '.join(pickles)}: pickle files are not loaded; convert them to safetensors)" if pickles else ""
    raise ModelFolderError(f"{folder}: no {prefix}.safetensors and no {prefix}.safetensors.index.json{hint}")


def folder_problems(root: Path) -> list[str]:
    """Every reason loading ``root`` would fail that its files show (each naming the file), without
    reading a weight: [] when the folder, its configs and its weight files are all there."""
    if not root.is_dir():
        return [f"{root}: checkpoint folder does not exist" if not root.exists()
                else f"{root}: expected a checkpoint folder, found a file"]
    problems: list[str] = []

    def check(step: Any) -> None:
        try:
            step()
        except ModelFolderError as e:
            problems.append(str(e))

    check(lambda: read_json(root / "model_index.json"))
    for component, prefix in WEIGHTED_COMPONENTS:
        def component_files(component: str = component, prefix: str = prefix) -> None:
            folder = root / component if component == TEXT_ENCODER_DIR else resolve_component(root, component)
            if not folder.is_dir():
                raise ModelFolderError(f"{folder}: folder is missing")
            read_json(folder / "config.json")
            empty = [f.name for f in safetensors_files(folder, prefix) if f.stat().st_size == 0]
            if empty:
                raise ModelFolderError(f"{folder}: weight file(s) of 0 bytes: {', '.join(empty)}")
        check(component_files)
    tokenizer = root / TOKENIZER_DIR
    if not tokenizer.is_dir() or not any(tokenizer.iterdir()):
        problems.append(f"{tokenizer}: folder is missing or empty (the text encoder needs its tokenizer)")
    if (root / SCHEDULER_CONFIG).exists():
        check(lambda: read_json(root / SCHEDULER_CONFIG))
    return problems


# Where a step-distilled checkpoint may list its DMD timesteps, in the order they are looked for:
# FastVideo writes ``dmd_denoising_steps`` into its pipeline config; a diffusers-layout export may
# carry it in model_index.json.
DMD_TIMESTEPS_KEY = "dmd_denoising_steps"
DMD_TIMESTEPS_FILES = ("model_index.json", "pipeline_config.json")


def listed_dmd_timesteps(root: Path) -> tuple[Path, Any] | None:
    """The file that lists the checkpoint's own DMD timesteps and its value as written (not checked:
    the loader checks it against the scheduler), or None when no file lists them."""
    for name in DMD_TIMESTEPS_FILES:
        path = root / name
        if not path.is_file():
            continue
        value = read_json(path).get(DMD_TIMESTEPS_KEY)
        if value is not None:
            return path, value
    return None


def model_id(root: Path, *, name: str, dmd_timesteps: Sequence[int] | None) -> str:
    """``<name>-<digest>``: a cheap, stable id of a checkpoint's weights (configs plus weight file
    names and sizes, and its own DMD timesteps, which change its renders). ``dmd_timesteps``: the
    checkpoint's, as the loader checked them (`listed_dmd_timesteps`)."""
    h = hashlib.sha256()
    if dmd_timesteps is not None:
        h.update(f"{DMD_TIMESTEPS_KEY}:{list(dmd_timesteps)}".encode())
    for sub in ("transformer", "vae", "text_encoder", "scheduler"):
        folder = root / sub
        if not folder.is_dir():
            continue
        for f in sorted(folder.iterdir()):
            if f.suffix == ".json":
                h.update(f"{sub}/{f.name}:".encode() + f.read_bytes())
            elif f.suffix == ".safetensors":
                h.update(f"{sub}/{f.name}:{f.stat().st_size}".encode())
    return f"{name}-{h.hexdigest()[:10]}"
