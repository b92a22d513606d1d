"""The embedded tiny checkpoint written from inside a process group (what a GPU group's workers do:
they load the model after joining their group). transformers' save_pretrained writes nothing on
ranks other than 0 of an initialised torch.distributed group; the tiny writer must not depend on it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_helpers import run_group

from pan2render.models.tiny import TINY_FILES, missing_tiny_files, tiny_model_folder, write_tiny_model


def _write_on_each_rank(rank: int, world: int, out: Path) -> None:
    root = out / f"rank{rank}-checkpoint"
    write_tiny_model(root)
    torch.save({"missing": missing_tiny_files(root)}, out / f"rank{rank}.pt")


def test_every_rank_of_a_group_writes_a_complete_checkpoint(tmp_path: Path) -> None:
    results = run_group(2, _write_on_each_rank, tmp_path)
    print("missing per rank:", [r["missing"] for r in results])
    assert [r["missing"] for r in results] == [[], []]


def test_an_incomplete_cached_checkpoint_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAN2_RENDER_CACHE", str(tmp_path))
    root = tiny_model_folder()
    assert missing_tiny_files(root) == [] and len(TINY_FILES) == 10
    (root / "text_encoder" / "config.json").unlink()  # e.g. written by a version with the bug above
    again = tiny_model_folder()
    assert again == root and missing_tiny_files(again) == []
    assert not [p for p in os.listdir(root.parent) if p.startswith(".")]  # nothing left aside
