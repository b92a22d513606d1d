"""MagCache calibrations: measured on a user's checkpoint, stored beside its model id, looked up.

``pan2-render calibrate MODEL`` runs one exact job (`calibrate`) with a `RatioRecorder` on the
block stack and stores the per-step magnitude ratios of each guidance branch in the pan2-render
cache, ``<cache>/magcache/<model id>.json``, one entry per kind of job (text-only, and conditioned
on a first frame). `calibration_for` is what a cached job uses: the stored entry for its model and
kind; else, for a transformer of the Wan2.2-TI2V-5B architecture, MagCache's published ratios for
that model (``pan2render.lanes.published_calibration``); else none, and the job is refused with
the command that makes one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ..lanes import Branch, Calibration, published_calibration
from .dit import PAN2DiTConfig
from .tiny import cache_root

__all__ = ["CalibrationMissing", "calibration_for", "calibration_path", "calibrate", "model_file",
           "store_calibration", "stored_calibration"]

CALIBRATION_FORMAT = 1


class CalibrationMissing(ValueError):
    """A cached job's model has no calibration and no published one applies (deterministic)."""


def _kind(conditioned: bool) -> str:
    return "image" if conditioned else "text"


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
    path = calibration_path(model_id)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationMissing(f"{path}: unreadable MagCache calibration ({e}); run pan2-render calibrate "
                                 "again to rewrite it") from e
    entry = doc.get(_kind(conditioned)) if isinstance(doc, dict) else None
    return None if entry is None else Calibration.from_json(entry, source=str(path))


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
    doc[_kind(conditioned)] = entry
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


def calibration_for(model_id: str, dit_config: PAN2DiTConfig, *, conditioned: bool) -> Calibration:
    """The calibration a cached job of ``model_id`` uses (see the module doc)."""
    stored = stored_calibration(model_id, conditioned=conditioned)
    if stored is not None:
        return stored
    if dit_config == PAN2DiTConfig():  # the Wan2.2-TI2V-5B transformer the ratios were published for
        return published_calibration(conditioned=conditioned)
    raise CalibrationMissing(
        f"cache magcache: model {model_id} has no MagCache calibration for {_kind(conditioned)}-conditioned "
        f"jobs and is not the Wan2.2-TI2V-5B architecture the published ratios are for; run "
        f"`pan2-render calibrate MODEL{' --image IMAGE' if conditioned else ''}` once, or use cache none")


def calibrate(pipe: Any, **sample_args: Any) -> Calibration:
    """Run one exact job on ``pipe`` (a `PAN2Pipeline`; ``sample_args``: `PAN2Pipeline.sample`'s
    keywords, fast lanes left at their defaults) and return the magnitude ratios it measured."""
    from .step_cache import RatioRecorder  # torch

    recorder = RatioRecorder()
    pipe.sample(**sample_args, record=recorder)
    settings = {k: v for k, v in sample_args.items()
                if k in ("height", "width", "frames", "steps", "guidance", "flow_shift", "sampler", "seed")}
    settings["image"] = sample_args.get("image") is not None
    return Calibration(cond=tuple(recorder.ratios[Branch.COND]), uncond=tuple(recorder.ratios[Branch.UNCOND]),
                       source=f"calibrated on {pipe.model_id}", settings={**settings, "model_id": pipe.model_id})
