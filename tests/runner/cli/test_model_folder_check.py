"""A checkpoint folder that cannot be loaded is found before anything renders: `validate` says so
with an exit code of its own, and `run` fails the batch once (exit 3) instead of every job's load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.ledger import EventKind, JobState, Ledger
from pan2render.runner.cli import main as cli


def _only_model_index(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return ckpt


def test_validate_says_when_the_checkpoint_is_missing_or_incomplete_with_exit_5(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = write_batch(tmp_path / "missing.yaml", [{"name": "a", "prompt": "x"}], model=str(tmp_path / "nope"))
    assert cli.main(["validate", str(missing)]) == cli.EXIT_CHECKPOINT
    out = capsys.readouterr().out
    print(out)
    assert "checkpoint folder does not exist" in out and "`run` will refuse it" in out

    incomplete = write_batch(tmp_path / "inc.yaml", [{"name": "a", "prompt": "x"}],
                             model=str(_only_model_index(tmp_path)))
    assert cli.main(["validate", str(incomplete)]) == cli.EXIT_CHECKPOINT
    out = capsys.readouterr().out
    print(out)
    for part in ("transformer", "vae", "text_encoder", "tokenizer"):
        assert f"'{part}/' folder" in out or f"{part}: folder is missing" in out, part
    assert "4 problem(s)" in out


def test_validate_of_a_complete_checkpoint_folder_is_valid(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from pan2render.models.tiny import tiny_model_folder

    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "x"}], model=str(tiny_model_folder()))
    assert cli.main(["validate", str(batch)]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "its configs and weight files are there" in out and "problem" not in out


def test_a_broken_checkpoint_fails_the_batch_once_before_any_job_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder holds only model_index.json: `run` exits 3 with one error naming what is missing,
    and no job was started, charged or retried (each stays pending for `resume`)."""
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")
    batch = write_batch(tmp_path / "b.yaml", [{"name": n, "prompt": n} for n in ("a", "b", "c")],
                        model=str(_only_model_index(tmp_path)))
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == cli.EXIT_ENVIRONMENT
    err = capsys.readouterr().err
    print(err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "transformer" in errors[0] and "No job was started" in errors[0]
    ledger = Ledger.open_readonly(out)
    jobs = ledger.jobs()
    assert len(jobs) == 3 and all(j.state is JobState.PENDING and j.attempts == 0 for j in jobs)
    assert not [e for e in ledger.events() if e.started or e.kind is EventKind.TRACEBACK]
