"""Helpers shared by the runner tests (imported by name: tests/ is not a package)."""

from __future__ import annotations

from pathlib import Path

import yaml


def write_batch(path: Path, jobs: list[dict], *, defaults: dict | None = None,
                sweep: dict | None = None, model: str = "tiny") -> Path:
    doc: dict = {"model": model, "preset": "tiny-preview", "jobs": jobs}
    if defaults:
        doc["defaults"] = defaults
    if sweep:
        doc["sweep"] = sweep
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path
