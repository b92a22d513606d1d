"""A checkpoint folder that cannot be loaded (missing, or incomplete) is found before anything
renders, one exit code per command whatever the problem: `validate` says so with an exit code of its
own (5), `run` and `submit` refuse the batch before recording it (exit 3, as the README says), and
`resume` fails the batch once (exit 3) instead of every job's load, its jobs left pending."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.ledger import EventKind, JobState, Ledger
from pan2render.jobs.overrides import Overrides
from pan2render.models.tiny import tiny_model_folder
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
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "x"}], model=str(tiny_model_folder()))
    assert cli.main(["validate", str(batch)]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "its configs and weight files are there" in out and "problem" not in out


def _broken(tmp_path: Path) -> dict[str, Path]:
    return {"missing": tmp_path / "nope", "incomplete": _only_model_index(tmp_path)}


def test_validate_run_and_submit_agree_on_a_broken_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Missing or incomplete: validate 5, run 3 and submit 3, each before anything is recorded."""
    from runner_helpers import serving_farm

    from pan2render.client import FarmClient
    from pan2render.runner.cli.batches import submit

    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")
    with serving_farm(tmp_path) as (_farm, url, token):
        for what, folder in _broken(tmp_path).items():
            batch = write_batch(tmp_path / f"{what}.yaml", [{"name": "a", "prompt": "x"}], model=str(folder))
            out = tmp_path / f"out-{what}"
            codes = {"validate": cli.main(["validate", str(batch)]),
                     "run": cli.main(["run", str(batch), "--out", str(out), "--no-progress", "--no-farm"]),
                     "submit": submit(FarmClient(url, token), batch.read_text(), name=batch.name, base=tmp_path,
                                      out=out, sets=[], sweeps=[], priority=0, retries=2, wait=False)}
            said = capsys.readouterr()
            print(what, codes, said.out, said.err)
            assert codes == {"validate": cli.EXIT_CHECKPOINT, "run": cli.EXIT_ENVIRONMENT,
                             "submit": cli.EXIT_ENVIRONMENT}, what
            assert "nothing was recorded" in said.err and "the farm does not serve the batch" in said.err
            assert not (out / "ledger.sqlite").exists()


def test_a_checkpoint_broken_since_the_run_fails_resume_once_before_any_job_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder lost everything but model_index.json after the batch was recorded: `resume` exits 3
    with one error naming what is missing, and no job was started, charged or retried (each stays
    pending)."""
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model_folder(), ckpt)
    batch = write_batch(tmp_path / "b.yaml", [{"name": n, "prompt": n} for n in ("a", "b", "c")], model=str(ckpt))
    out = tmp_path / "out"
    from pan2render.jobs.batch import load_batch
    from pan2render.runner.serve.session import BatchRequest, BatchSession

    with BatchSession.record(BatchRequest(out_dir=out, batch=load_batch(batch), overrides=Overrides()), stream=None,
                             title="test"):
        pass
    for sub in ("transformer", "vae", "text_encoder", "tokenizer"):
        shutil.rmtree(ckpt / sub)
    capsys.readouterr()
    assert cli.main(["resume", str(out), "--no-progress"]) == cli.EXIT_ENVIRONMENT
    err = capsys.readouterr().err
    print(err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "transformer" in errors[0] and "No job was started" in errors[0]
    assert "the jobs stay pending" in errors[0]
    ledger = Ledger.open_readonly(out)
    jobs = ledger.jobs()
    assert len(jobs) == 3 and all(j.state is JobState.PENDING and j.attempts == 0 for j in jobs)
    assert not [e for e in ledger.events() if e.started or e.kind is EventKind.TRACEBACK]
