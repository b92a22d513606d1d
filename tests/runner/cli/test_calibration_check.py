"""`cache: magcache` on a model without a MagCache calibration is refused before anything runs:
`validate` and `run` exit 2 naming the command that makes one, the farm refuses to queue it, and
`calibrate` (a preset that fits the model, its steps shown as they go) makes the same batch render.
A calibration removed after validation fails the job at its sampling as deterministic: not retried."""

from __future__ import annotations

from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.models.tiny import tiny_model_folder
from pan2render.runner.cli import main as cli
from pan2render.runner.farm.http import ApiError
from pan2render.runner.farm.intake import Roots, batch_from_post
from pan2render.tiny_dit import tiny_folder


@pytest.fixture()
def bare_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of its own holding the tiny model (the shared one's, linked: not built again) and no
    calibration."""
    built = tiny_model_folder()
    monkeypatch.setenv("PAN2_RENDER_CACHE", str(tmp_path / "cache"))
    tiny_folder().parent.mkdir(parents=True)
    tiny_folder().symlink_to(built, target_is_directory=True)
    return tmp_path / "cache"


def _cached_batch(tmp_path: Path) -> Path:
    return write_batch(tmp_path / "b.yaml", [{"name": "fox", "prompt": "a fox", "cache": "magcache"},
                                             {"name": "cat", "prompt": "a cat", "cache": "magcache"}])


def test_validate_and_run_refuse_magcache_on_the_uncalibrated_tiny_model_until_calibrate(
        tmp_path: Path, bare_cache: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    batch = _cached_batch(tmp_path)
    assert cli.main(["validate", str(batch)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    print(err)
    assert "b.yaml:6: jobs[0].cache: got magcache; run `pan2-render calibrate tiny` once" in err
    assert "(2 jobs of the batch ask for it)" in err and "1 problem(s)" in err
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == cli.EXIT_USAGE
    assert "pan2-render calibrate tiny" in capsys.readouterr().err and not out.exists()

    assert cli.main(["calibrate", "tiny"]) == cli.EXIT_OK  # no --preset: the tiny model's own
    said = capsys.readouterr().out
    print(said)
    assert "preset tiny-preview (64x64, 17 frames, 8 steps" in said
    assert [f"step {k}/8" in said for k in range(1, 9)] == [True] * 8
    assert list((bare_cache / "magcache").glob("tiny-v*.json"))

    assert cli.main(["validate", str(batch)]) == cli.EXIT_OK
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == cli.EXIT_OK
    ledger = Ledger.open_readonly(out)
    assert [j.state for j in ledger.jobs()] == [JobState.DONE] * 2
    ledger.close()


def test_the_farm_refuses_to_queue_magcache_on_an_uncalibrated_model(tmp_path: Path, bare_cache: Path) -> None:
    """The farm validates with the same load: a 422 listing the problem, nothing queued."""
    text = _cached_batch(tmp_path).read_text()
    roots = Roots.of([tmp_path], [tmp_path])
    with pytest.raises(ApiError) as refused:
        batch_from_post({"text": text, "name": "b.yaml", "out": str(tmp_path / "out")}, roots, 2)
    print(refused.value)
    assert refused.value.status == 422
    assert any("run `pan2-render calibrate tiny` once" in p for p in refused.value.extra["problems"])
