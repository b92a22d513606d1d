"""What `run` does to an output folder that already holds something: it names the jobs an edited
batch supersedes, keeps a copy of every batch file it was run with, refuses another batch's folder
(without --add) and a folder of someone else's files (without --force), and drops with --prune the
jobs no longer in the batch, which `resume` would otherwise render."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.jobs.presets import preset_text
from pan2render.runner.cli import main as cli


@pytest.fixture(autouse=True)
def _local_fake(monkeypatch: pytest.MonkeyPatch, fake_pipeline: None) -> None:
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["run", *args, "--no-progress"])
    return code, capsys.readouterr().err


def _jobs(out: Path) -> dict[str, JobState]:
    ledger = Ledger.open_readonly(out)
    try:
        return {j.id: j.state for j in ledger.jobs()}
    finally:
        ledger.close()


def test_an_edited_batch_names_what_it_supersedes_and_each_version_of_the_file_is_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": "fox", "prompt": "a fox", "seed": 42},
                                              {"name": "owl", "prompt": "an owl"}], defaults={"steps": 2})
    out = tmp_path / "out"
    assert _run(capsys, str(batch), "--out", str(out))[0] == 0
    first = batch.read_text()
    batch.write_text(first.replace("seed: 42", "seed: 43"))
    code, err = _run(capsys, str(batch), "--out", str(out), "--set", "crf=20")
    print(err)
    assert code == 0
    old = [i for i in _jobs(out) if i.startswith("fox")]
    lines = [line for line in err.splitlines() if "is superseded by" in line]
    # Both jobs changed (crf for every job); fox's seed too: each named once, with what changed.
    assert len(lines) == 2 and any("seed 42 -> 43" in line and "crf 18 -> 20" in line for line in lines)
    assert all(line.split()[0] in old or line.startswith("owl") for line in lines)
    assert "2 new job(s) (2 superseding an older version)" in err

    copies = sorted((out / "_batches").glob("*.yaml"))
    assert [c.read_text() for c in copies] == [first, batch.read_text()]
    assert json.loads(copies[1].with_suffix(".json").read_text())["flags"] == ["--set", "crf=20"]
    # The same file with the same flags again: nothing new to keep.
    assert _run(capsys, str(batch), "--out", str(out), "--set", "crf=20")[0] == 0
    assert len(list((out / "_batches").glob("*.yaml"))) == 2
    assert cli.main(["status", str(out)]) == 0
    status = capsys.readouterr().out
    assert "_batches/001-b.yaml" in status and "_batches/002-b.yaml --set crf=20" in status


def test_another_batch_needs_add_and_a_foreign_folder_needs_force(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = write_batch(tmp_path / "one.yaml", [{"name": "a", "prompt": "a"}], defaults={"steps": 2})
    two = write_batch(tmp_path / "two.yaml", [{"name": "b", "prompt": "b"}], defaults={"steps": 2})
    out = tmp_path / "out"
    assert _run(capsys, str(one), "--out", str(out))[0] == 0
    before = _jobs(out)
    code, err = _run(capsys, str(two), "--out", str(out))
    print(err)
    assert code == 2 and "holds the jobs of another batch" in err and str(one.absolute()) in err and "--add" in err
    assert _jobs(out) == before  # nothing recorded
    # `submit` leaves the check to the farm, which validates what it receives (tests/runner/farm/
    # test_intake.py): without one, it says so and writes nothing.
    nofarm = ["--root", str(tmp_path / "nofarm")]
    assert cli.main(["submit", str(two), "--out", str(out), "--add", *nofarm]) == 3
    assert "no farm" in capsys.readouterr().err.lower() and _jobs(out) == before
    assert _run(capsys, str(two), "--out", str(out), "--add")[0] == 0
    assert len(_jobs(out)) == 2

    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "holiday.jpg").write_bytes(b"\xff\xd8")
    (mine / ".DS_Store").write_bytes(b"")
    code, err = _run(capsys, str(one), "--out", str(mine))
    print(err)
    assert code == 2 and "is not a pan2-render output folder" in err and "holiday.jpg" in err and "--force" in err
    assert sorted(p.name for p in mine.iterdir()) == [".DS_Store", "holiday.jpg"]  # nothing written
    assert _run(capsys, str(one), "--out", str(mine), "--force")[0] == 0
    assert (mine / "holiday.jpg").read_bytes() == b"\xff\xd8" and (mine / "ledger.sqlite").is_file()


def test_prune_drops_the_jobs_no_longer_in_the_batch_that_resume_would_render(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": "keep", "prompt": "k"}, {"name": "gone", "prompt": "g"}],
                        defaults={"steps": 2})
    out = tmp_path / "out"
    monkeypatch.setenv("PAN2_RENDER_FAULTS", json.dumps({"fail": {"job": "gone", "stage": "decode"}}))
    assert _run(capsys, str(batch), "--out", str(out), "--retries", "0")[0] == 1
    monkeypatch.delenv("PAN2_RENDER_FAULTS")
    write_batch(batch, [{"name": "keep", "prompt": "k"}], defaults={"steps": 2})  # "gone" removed

    assert _run(capsys, str(batch), "--out", str(out))[0] == 0  # without --prune it stays, failed
    assert sorted(s.value for s in _jobs(out).values()) == ["done", "failed"]
    code, err = _run(capsys, str(batch), "--out", str(out), "--prune")
    print(err)
    assert code == 0 and "--prune: dropped 1 job(s) no longer in the batch (gone-" in err
    assert [i.split("-")[0] for i in _jobs(out)] == ["keep"]
    # `resume` has nothing left to render.
    assert cli.main(["resume", str(out), "--no-progress"]) == 0
    assert "all 1 job(s) already done" in capsys.readouterr().err


def test_a_preset_file_of_ones_own_is_checked_like_the_shipped_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "presets").mkdir()
    mine = tmp_path / "presets" / "mine.yaml"
    mine.write_text(preset_text("tiny-preview").replace("steps: 8", "steps: 3"))
    batch = tmp_path / "b.yaml"
    batch.write_text("model: tiny\npreset: presets/mine.yaml\njobs:\n  - {name: a, prompt: x}\n")
    assert cli.main(["validate", str(batch)]) == 0
    assert " 3  " in capsys.readouterr().out  # the steps column: the file's value

    mine.write_text("steps: 0\nguidance: 2.5\n")
    assert cli.main(["validate", str(batch)]) == 2
    err = capsys.readouterr().err
    print(err)
    assert f"{mine}:1: steps: got 0" in err and "preset lacks required field 'height'" in err
    assert cli.main(["validate", str(batch), "--set", "preset=./nowhere.yaml"]) == 2
    assert "preset file" in capsys.readouterr().err
