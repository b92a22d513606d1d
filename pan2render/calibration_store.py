"""MagCache calibrations kept beside a model id, and which one a model's cached jobs get, torch-free.

``pan2-render calibrate MODEL`` (``pan2render.models.calibration.calibrate``) measures a model's
per-step magnitude ratios and stores them in the pan2-render cache, ``<cache>/magcache/<model
id>.json``, one entry per kind of job (text-only, and conditioned on a first frame). A cached job
uses the stored entry for its model and kind; else, for a transformer of the Wan2.2-TI2V-5B
architecture, MagCache's published ratios for that model (``pan2render.lanes.published_calibration``);
else none, and the job is refused with the command that makes one.

Here, not in ``pan2render.models``, because batch validation refuses such a job before anything
runs (``pan2render.jobs``, in a driver that never imports torch): it reads the model's id and its
transformer config from the folder's files (`model_calibration_problem`), never its weights.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pan2render.cache import cache_root
from pan2render.hints import command
from pan2render.lanes import Calibration, CalibrationMissing, published_calibration
from pan2render.model_files import (
    ModelFolderError,
    listed_dmd_timesteps,
    model_id,
    read_json,
    resolve_component,
)
from pan2render.sampling import is_int
from pan2render.tiny_dit import TINY_DIT_CONFIG, TINY_MODEL, TINY_NAME, tiny_folder

__all__ = ["CalibrationMissing", "PUBLISHED_DIT_CONFIG", "calibration_for", "calibration_path",
           "folder_model_id", "model_calibration_problem", "model_file", "published_applies", "store_calibration",
           "stored_calibration"]

CALIBRATION_FORMAT = 1

# The transformer the published ratios were measured on: Wan2.2-TI2V-5B's transformer/config.json,
# every key our DiT reads (`PAN2DiTConfig`'s defaults, which reproduce it: a test keeps them equal).
# A key a config leaves out takes this value, as `PAN2DiTConfig.from_dict` fills it.
PUBLISHED_DIT_CONFIG: dict[str, Any] = {
    "patch_size": [1, 2, 2], "num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 48,
    "out_channels": 48, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 14336, "num_layers": 30,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
}


def kind_of(conditioned: bool) -> str:
    return "image" if conditioned else "text"


def _kind_words(conditioned: bool) -> str:
    return "image-conditioned" if conditioned else "text-only"


def model_file(folder: str, model_id: str) -> Path:
    """``<cache>/<folder>/<model id>.json``: what a calibration keeps of a model, beside its id (a
    pipeline's ``model_id``: name and weight digest)."""
    if not model_id or "/" in model_id or model_id.startswith("."):
        raise ValueError(f"model id {model_id!r} cannot name a calibration file")
    return cache_root() / folder / f"{model_id}.json"


def calibration_path(model_id: str) -> Path:
    """Where ``model_id``'s MagCache calibrations live."""
    return model_file("magcache", model_id)


def stored_calibration(model_id: str, *, conditioned: bool) -> Calibration | None:
    """``model_id``'s stored calibration for its kind of job, None when there is none; a file that
    cannot be used raises CalibrationMissing naming it."""
    path = calibration_path(model_id)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        entry = doc.get(kind_of(conditioned)) if isinstance(doc, dict) else None
        return None if entry is None else Calibration.from_json(entry, source=str(path))
    except (OSError, ValueError) as e:  # (json.JSONDecodeError is a ValueError)
        raise CalibrationMissing(f"run `pan2-render calibrate MODEL` again to rewrite {path}: an unusable MagCache "
                                 f"calibration ({e})") from e


def store_calibration(model_id: str, calibration: Calibration, *, conditioned: bool) -> Path:
    """Write (atomically) ``calibration`` as ``model_id``'s entry for its kind of job."""
    path = calibration_path(model_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"format": CALIBRATION_FORMAT, "model_id": model_id}
    if path.is_file():
        try:
            doc.update(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            pass  # rewritten whole below
    entry = calibration.to_json()
    entry["source"] = f"pan2-render calibrate, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    doc[kind_of(conditioned)] = entry
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


def published_applies(dit_config: Mapping[str, Any]) -> bool:
    """Is ``dit_config`` (a transformer/config.json dict) the architecture the published ratios are for?"""
    def same(key: str, value: Any) -> bool:
        given = dit_config.get(key, value)
        return (list(given) if isinstance(given, (list, tuple)) else given) == value
    return all(same(k, v) for k, v in PUBLISHED_DIT_CONFIG.items())


def calibration_for(model_id: str, dit_config: Mapping[str, Any], *, conditioned: bool,
                    model: str = "MODEL") -> Calibration:
    """The calibration a cached job of ``model_id`` uses (see the module doc); ``model``: how the
    batch names the model, for the command in the message."""
    stored = stored_calibration(model_id, conditioned=conditioned)
    if stored is not None:
        return stored
    if published_applies(dit_config):
        return published_calibration(conditioned=conditioned)
    raise CalibrationMissing(missing_message(model, model_id, conditioned=conditioned))


def missing_message(model: str, model_id: str | None, *, conditioned: bool) -> str:
    """The fix first (a line cut to the terminal keeps it), then why."""
    fix = command("calibrate", model, *(["--image", "IMAGE"] if conditioned else []))
    return (f"run `{fix}` once (or set cache: none): cache magcache needs a MagCache calibration of the model for "
            f"{_kind_words(conditioned)} jobs, and {model}"
            + (f" ({model_id})" if model_id else "")
            + " has none: the published ratios are for the Wan2.2-TI2V-5B architecture alone")


def folder_model_id(model: str) -> str | None:
    """The id ``model`` (``tiny`` or a checkpoint folder) loads as (``PAN2Pipeline.model_id``), read
    from its files; None when its folder is not there (the tiny model before its first use)."""
    root = tiny_folder() if model == TINY_MODEL else Path(model).expanduser().resolve()
    name = TINY_NAME if model == TINY_MODEL else root.name
    if not (root / "model_index.json").is_file():
        return None
    listed = listed_dmd_timesteps(root)
    value = None if listed is None else listed[1]
    # A list the loader refuses fails the load whatever it names: the id is not needed then.
    timesteps = value if isinstance(value, list) and all(is_int(t) for t in value) else None
    return model_id(root, name=name, dmd_timesteps=timesteps)


def model_calibration_problem(model: str, *, conditioned: bool, guided: bool) -> str | None:
    """Why a job of ``model`` with ``cache: magcache`` would be refused at its sampling (no
    calibration for its kind of job, or one without the unconditional ratios a guided job needs), or
    None. Reads the folder's configs and the calibration store, never a weight; a folder that cannot
    be read is left to the checkpoint's own check (None)."""
    try:
        dit = TINY_DIT_CONFIG if model == TINY_MODEL else read_json(resolve_component(model, "transformer")
                                                                    / "config.json")
        ident = folder_model_id(model)
        if ident is None:  # nothing can be stored for a model never loaded here
            return None if published_applies(dit) else missing_message(model, None, conditioned=conditioned)
        calibration = calibration_for(ident, dit, conditioned=conditioned, model=model)
    except (ModelFolderError, OSError):
        return None
    except CalibrationMissing as e:
        return str(e)
    if guided and not calibration.uncond:
        return (f"run `{command('calibrate', model)}` again with a guided preset (guidance > 1), or set cache: none: "
                f"{calibration.source} was calibrated on an unguided run and has no unconditional ratios")
    return None
