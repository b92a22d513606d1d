"""`run --from PATH` renders a finished job again from what it left behind: its params.json, its
mp4, or its folder give the same id and bit-equal latents; `--set` changes it on top."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runner_helpers import write_batch
from safetensors.numpy import load_file

from pan2render.jobs.ledger import Ledger
from pan2render.runner.cli import main as cli


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two swept jobs of the tiny model (real weights, in-process workers), rendered once."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PAN2_RENDER_EXECUTOR", "local")
    tmp = tmp_path_factory.mktemp("from")
    batch = write_batch(tmp / "b.yaml", [{"name": "fox", "prompt": "a red fox in the snow", "seed": 7}],
                        defaults={"steps": 3, "height": 32, "width": 32, "frames": 5,
                                  "negative_prompt": "blurry"}, sweep={"guidance": [2.0, 3.5]})
    out = tmp / "first"
    try:
        assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == 0
    finally:
        mp.undo()
    return out


def _latents(folder: Path) -> dict[str, np.ndarray]:
    return {p.parent.name: load_file(str(p))["latents"] for p in folder.glob("*/latents.safetensors")}


@pytest.mark.parametrize("source", ["params.json", "video.mp4", "folder"])
def test_run_from_a_renders_record_reproduces_the_job_bit_for_bit(
        rendered: Path, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")
    original = _latents(rendered)
    job, other = sorted(original)[1], sorted(original)[0]
    assert original[job].tobytes() != original[other].tobytes()  # the comparison below can fail
    path = rendered / job if source == "folder" else rendered / job / source
    out = tmp_path / "again"
    assert cli.main(["run", "--from", str(path), "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"--from {path}: job {job}, as recorded" in err
    again = _latents(out)
    assert list(again) == [job]  # the same id: its sweep values and hash
    assert again[job].dtype == original[job].dtype and again[job].tobytes() == original[job].tobytes()
    copy = next((out / "_batches").glob("*.yaml")).read_text()
    assert f"--from {path}" in copy and "guidance:\n  - 3.5" in copy  # what was run is kept, readable


def test_run_from_with_set_renders_a_changed_job_and_says_what_changed(
        rendered: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")
    job = sorted(_latents(rendered))[0]
    out = tmp_path / "changed"
    assert cli.main(["run", "--from", str(rendered / job), "--out", str(out), "--no-progress",
                     "--set", "seed=8", "--set", "guidance=4"]) == 0
    err = capsys.readouterr().err
    print(err)
    assert f"job {job} renders as" in err and "seed 7 -> 8" in err and "guidance 2.0 -> 4.0" in err
    ledger = Ledger.open_readonly(out)
    (new,) = ledger.jobs()
    ledger.close()
    assert new.id != job and new.spec.seed == 8 and new.spec.guidance == 4.0
    assert new.spec.negative_prompt == "blurry" and new.spec.prompt == "a red fox in the snow"


def test_run_from_something_else_says_what_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "notes.json"
    other.write_text('{"hello": 1}')
    assert cli.main(["run", "--from", str(other), "--out", str(tmp_path / "o")]) == 2
    assert "not a pan2-render params.json" in capsys.readouterr().err
    assert cli.main(["run", "--from", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "folder without params.json or video.mp4" in capsys.readouterr().err
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "x"}])
    assert cli.main(["run", str(batch), "--from", str(other), "--out", str(tmp_path / "o")]) == 2
    assert "one of the two" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
