"""MagCache calibrations: measured on a user's checkpoint (`calibrate`).

``pan2-render calibrate MODEL`` runs one exact job (`calibrate`) with a `RatioRecorder` on the
block stack and stores the per-step magnitude ratios of each guidance branch beside the model's id
(``pan2render.calibration_store``, torch-free: where they are kept, and which calibration a cached
job of a model gets, which batch validation checks before any model loads).
"""

from __future__ import annotations

from typing import Any

from ..calibration_store import (
    CalibrationMissing,
    calibration_for,
    calibration_path,
    model_file,
    store_calibration,
    stored_calibration,
)
from ..lanes import Branch, Calibration

__all__ = ["CalibrationMissing", "calibration_for", "calibration_path", "calibrate", "model_file",
           "store_calibration", "stored_calibration"]


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
