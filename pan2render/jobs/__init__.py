"""Batch specs: YAML parsing, validation, presets, sweep expansion and job ids (the ledger lives in
``pan2render.jobs.ledger``)."""

from pan2render.jobs.batch import load_batch
from pan2render.jobs.presets import list_presets
from pan2render.jobs.spec import (
    ALLOWED_GPUS,
    Batch,
    BatchValidationError,
    JobSpec,
    Problem,
    SourceLocation,
)

__all__ = [
    "ALLOWED_GPUS", "Batch", "BatchValidationError", "JobSpec", "Problem", "SourceLocation",
    "list_presets", "load_batch",
]
