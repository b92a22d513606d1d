"""`resume` without --cpu-gpus renders on the logical GPUs the folder's last run had (a batch run
with --cpu-gpus 2 does not quietly resume on 1), and says so; --cpu-gpus still decides when given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.ledger import Ledger
from pan2render.runner.cli import main as cli
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def _last_run(out: Path) -> dict:
    ledger = Ledger.open_readonly(out)
    try:
        return ledger.get_meta("runs")[-1]
    finally:
        ledger.close()


def test_resume_takes_the_last_runs_logical_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")
    monkeypatch.setenv("PAN2_RENDER_PIPELINE", FAKE_FACTORY)
    monkeypatch.setenv("PAN2_RENDER_FAULTS", json.dumps({"fail": {"job": "b", "stage": "decode",
                                                                  "raise": "JobInputError"}}))
    batch = write_batch(tmp_path / "b.yaml", [{"name": n, "prompt": n} for n in ("a", "b", "c")],
                        defaults={"steps": 2})
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--cpu-gpus", "2", "--no-progress"]) == cli.EXIT_FAILED
    assert (_last_run(out)["gpus"], _last_run(out)["cpu_gpus"]) == (2, 2)
    monkeypatch.delenv("PAN2_RENDER_FAULTS")
    capsys.readouterr()

    assert cli.main(["resume", str(out), "--no-progress"]) == cli.EXIT_OK
    err = capsys.readouterr().err
    print(err)
    assert "had 2 logical GPU(s): resuming on as many (--cpu-gpus 2" in err
    assert _last_run(out)["gpus"] == 2 and _last_run(out)["command"] == "resume"

    assert cli.main(["resume", str(out), "--no-progress", "--cpu-gpus", "1"]) == cli.EXIT_OK  # (all done)
    assert "resuming on as many" not in capsys.readouterr().err
