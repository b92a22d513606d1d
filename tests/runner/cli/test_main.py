"""The CLI's contract without Ray: exit codes, nothing written on bad input, status, report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import FolderLock, Ledger
from pan2render.runner.cli import main as cli
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.protocol.messages import WorkerConfig
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def _render_locally(batch: Path, out: Path, *, faults: dict | None = None) -> None:
    """A finished output folder without starting Ray (in-process executor, fake pipeline)."""
    out.mkdir()
    specs = load_batch(batch).jobs
    led = Ledger.open(out)
    led.add_jobs(specs, retries=0)
    ex = LocalExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY, faults=faults or {}))
    Driver(out_dir=out, ledger=led, executor=ex, config=ServingConfig(retries=0, progress=False)).run(
        [s.job_id for s in specs])
    led.close()


def test_invalid_batch_lists_every_problem_exits_2_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batch = write_batch(tmp_path / "bad.yaml", [
        {"name": "a", "prompt": "x", "frames": 16},        # not 4k+1
        {"name": "a", "prompt": "y", "gpus": 3, "sede": 1},  # duplicate name, bad gpus, typo
    ])
    out = tmp_path / "never" / "out"
    assert cli.main(["run", str(batch), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    print(err)
    assert "frames" in err and "gpus" in err and "sede" in err
    assert not (tmp_path / "never").exists()
    assert cli.main(["validate", str(batch)]) == 2


@pytest.mark.parametrize(("jobs", "expected"), [
    ([{"name": "unsorted", "prompt": "x", "timesteps": [522, 757, 1000]},
      {"name": "range", "prompt": "x", "timesteps": [1500, 500]},
      {"name": "empty", "prompt": "x", "timesteps": []}],
     ["dmd.yaml:6: jobs[0].timesteps: [522, 757, 1000] is not strictly decreasing",
      "dmd.yaml:12: jobs[1].timesteps: 1500 in [1500, 500] is out of range",
      "dmd.yaml:17: jobs[2].timesteps: is empty"]),
    ([{"name": "guided", "prompt": "x", "guidance": 3.5, "timesteps": [1000, 500]},
      {"name": "euler", "prompt": "x", "sampler": "euler", "timesteps": [1000, 500]}],
     ["dmd.yaml:6: jobs[0].guidance: got 3.5 with sampler dmd",
      "dmd.yaml:13: jobs[1].timesteps: set with sampler 'euler'"]),
])
def test_bad_dmd_jobs_exit_2_with_file_line_and_write_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], jobs: list[dict], expected: list[str]) -> None:
    batch = write_batch(tmp_path / "dmd.yaml", jobs, defaults={"sampler": "dmd", "guidance": 1})
    out = tmp_path / "never" / "out"
    assert cli.main(["run", str(batch), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    print(err)
    for where in expected:
        assert where in err, where
    assert f"{len(expected)} problem(s)" in err
    assert not (tmp_path / "never").exists()
    assert cli.main(["validate", str(batch)]) == 2


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "missing-out.yaml"])  # --out is required
    assert e.value.code == 2
    assert cli.main(["resume", str(tmp_path)]) == 2  # no ledger there
    assert cli.main(["status", str(tmp_path)]) == 2
    capsys.readouterr()
    # A valid batch, so each exit 2 below comes from the option check it names.
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "x"}])
    out = tmp_path / "out"
    for args, message in [(["--retries", "-1"], "--retries -1: must be >= 0"),
                          (["--cpu-gpus", "0"], "--cpu-gpus 0: must be >= 1"),
                          (["--group-start-timeout", "0"], "--group-start-timeout 0.0: must be > 0 seconds"),
                          (["--cpu-gpus", "2", "--address", "auto"], "cannot be used with --address")]:
        assert cli.main(["run", str(batch), "--out", str(out), *args]) == 2
        err = capsys.readouterr().err
        print(err.strip())
        assert message in err
    assert not out.exists()  # refused before anything was written


def test_validate_and_dry_run_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "x"}], sweep={"seed": [0, 1]})
    assert cli.main(["validate", str(batch)]) == 0
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    print(text)
    assert "a-seed0-" in text and "a-seed1-" in text and "2 job(s) to render" in text
    assert not out.exists()


def test_status_json_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": "fine", "prompt": "x"}, {"name": "broken", "prompt": "y"}],
                        defaults={"steps": 2})
    out = tmp_path / "out"
    _render_locally(batch, out, faults={"fail": {"job": "broken", "stage": "sampling"}})
    capsys.readouterr()
    assert cli.main(["status", str(out), "--json"]) == 1
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["jobs"]}
    print(json.dumps(rows, indent=1))
    for r in rows.values():
        assert {"id", "name", "state", "stage", "attempts", "error", "video"} <= set(r)
    assert rows["fine"]["state"] == "done" and Path(rows["fine"]["video"]).is_file()
    assert rows["broken"]["state"] == "failed" and rows["broken"]["stage"] == "sampling"
    assert rows["broken"]["video"] is None and "injected failure" in rows["broken"]["error"]

    assert cli.main(["status", str(out)]) == 1
    table = capsys.readouterr().out
    assert "1 done, 1 failed" in table

    assert cli.main(["report", str(out)]) == 0
    page = (out / "index.html").read_text()
    fine_id = rows["fine"]["id"]
    print(f"index.html: {len(page)} chars")
    assert f'src="{fine_id}/video.mp4"' in page and f'href="{fine_id}/params.json"' in page
    assert f'id="{rows["broken"]["id"]}"' in page and "injected failure" in page
    assert page.count("<video ") == 1


def test_second_run_on_a_held_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "x"}], defaults={"steps": 2})
    out = tmp_path / "out"
    _render_locally(batch, out)
    with FolderLock(out):
        assert cli.main(["run", str(batch), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    print(err)
    assert "in use by another pan2-render run" in err and "pid" in err
    # Released: the rerun finds the job done and needs no workers at all.
    assert cli.main(["run", str(batch), "--out", str(out)]) == 0
    assert "already done" in capsys.readouterr().err
