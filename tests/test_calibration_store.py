"""Which MagCache calibration a model's cached jobs get, read without torch from the calibration
store and the folder's configs: its own (per kind of job), else the published ratios for the
Wan2.2-TI2V-5B architecture alone; batch validation refuses the rest at the `cache` line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pan2render.calibration_store import (
    PUBLISHED_DIT_CONFIG,
    folder_model_id,
    model_calibration_problem,
    published_applies,
    store_calibration,
)
from pan2render.jobs import BatchValidationError, load_batch
from pan2render.lanes import Calibration
from pan2render.tiny_dit import TINY_DIT_CONFIG

FLAT = Calibration(cond=(1.0,) + (0.99,) * 7, uncond=(1.0,) + (0.98,) * 7, source="test")


def _folder(root: Path, dit: dict) -> Path:
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    (root / "transformer" / "config.json").write_text(json.dumps(dit))
    return root


def test_the_published_architecture_is_our_dits_default_config() -> None:
    from pan2render.models.dit import PAN2DiTConfig

    assert set(PUBLISHED_DIT_CONFIG) == {f.name for f in dataclasses.fields(PAN2DiTConfig)}
    assert published_applies(PAN2DiTConfig().to_dict()) and published_applies({})  # defaults: 5B values
    assert not published_applies(TINY_DIT_CONFIG)
    assert not published_applies({**PUBLISHED_DIT_CONFIG, "num_layers": 40})


def test_a_model_is_refused_until_its_kind_of_job_is_calibrated(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAN2_RENDER_CACHE", str(tmp_path / "cache"))
    wan = _folder(tmp_path / "Wan2.2-TI2V-5B", {"_class_name": "WanTransformer3DModel", "num_layers": 30})
    assert model_calibration_problem(str(wan), conditioned=True, guided=True) is None  # the published ratios
    small = str(_folder(tmp_path / "small", TINY_DIT_CONFIG))
    text = model_calibration_problem(small, conditioned=False, guided=True)
    assert text is not None and text.startswith(f"run `pan2-render calibrate {small}` once (or set cache: none)")
    assert "text-only jobs" in text and folder_model_id(small) in text

    ident = folder_model_id(small)
    assert ident is not None and ident.startswith("small-")
    store_calibration(ident, FLAT, conditioned=False)
    assert model_calibration_problem(small, conditioned=False, guided=True) is None
    image = model_calibration_problem(small, conditioned=True, guided=True)  # another kind of job
    assert image is not None and f"calibrate {small} --image IMAGE`" in image

    unguided = Calibration(cond=FLAT.cond, uncond=(), source="unguided")
    store_calibration(ident, unguided, conditioned=False)
    assert model_calibration_problem(small, conditioned=False, guided=False) is None
    assert "unguided run" in model_calibration_problem(small, conditioned=False, guided=True)
    (Path(tmp_path / "cache" / "magcache" / f"{ident}.json")).write_text("{not json")
    assert "again to rewrite" in model_calibration_problem(small, conditioned=False, guided=False)


def test_the_batch_names_the_cache_line_once_per_kind_of_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAN2_RENDER_CACHE", str(tmp_path / "cache"))
    small = _folder(tmp_path / "small", TINY_DIT_CONFIG)
    path = tmp_path / "b.yaml"
    path.write_text(f"model: {small}\npreset: tiny-preview\ndefaults:\n  cache: magcache\njobs:\n"
                    "  - prompt: a fox\n  - prompt: a cat\n  - prompt: a dog\n    cache: none\n")
    with pytest.raises(BatchValidationError) as refused:
        load_batch(path)
    (problem,) = [str(p) for p in refused.value.problems]
    print(problem)
    assert problem.startswith(f"{path}:6: jobs[0].cache: got magcache; run `pan2-render calibrate {small}` once")
    assert problem.endswith("(2 jobs of the batch ask for it)")
    store_calibration(folder_model_id(str(small)), FLAT, conditioned=False)
    assert [j.cache for j in load_batch(path).jobs] == ["magcache", "magcache", "none"]
