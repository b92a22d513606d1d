"""Command-line overrides (``--set key=value``, ``--sweep key=a,b,c``): validated by the batch
validator with its messages, located by the flag as typed; other tools' field names get a
did-you-mean."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pan2render.jobs import BatchValidationError, load_batch
from pan2render.jobs.overrides import Overrides

REPO = Path(__file__).resolve().parents[2]

BATCH = """
model: ../missing-checkpoint
preset: pan2-720p
defaults:
  seed: 42
jobs:
  - name: a
    prompt: first
    steps: 30
  - name: b
    prompt: second
sweep:
  guidance: [2.0, 3.0]
"""


def _batch(tmp_path: Path) -> Path:
    path = tmp_path / "sub" / "b.yaml"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(BATCH).lstrip())
    return path


def _messages(path: Path, **overrides: tuple[str, ...]) -> list[str]:
    with pytest.raises(BatchValidationError) as info:
        load_batch(path, overrides=Overrides(**overrides))
    print(info.value)
    return [str(p) for p in info.value.problems]


def test_set_model_and_preset_make_a_batch_with_a_missing_checkpoint_runnable(tmp_path: Path) -> None:
    path = _batch(tmp_path)
    assert load_batch(path).model == str(tmp_path / "missing-checkpoint")  # (its folder check: exit 5 / 3)
    batch = load_batch(path, overrides=Overrides(sets=("model=tiny", "preset=tiny-preview")))
    assert batch.model == "tiny" and batch.preset == "tiny-preview"
    assert {(j.width, j.height, j.frames, j.model) for j in batch.jobs} == {(64, 64, 17, "tiny")}
    assert len(batch.jobs) == 4


def test_set_applies_after_defaults_and_the_jobs_own_values(tmp_path: Path) -> None:
    path = _batch(tmp_path)
    plain = {j.name: j for j in load_batch(path, check_model=False).jobs if j.guidance == 2.0}
    assert plain["a"].steps == 30 and plain["b"].steps == 50 and plain["a"].seed == 42
    over = load_batch(path, check_model=False, overrides=Overrides(sets=("steps=4", "seed=7", "sampler=euler")))
    for j in over.jobs:
        assert (j.steps, j.seed, j.sampler) == (4, 7, "euler")
    assert {j.job_id for j in over.jobs}.isdisjoint({j.job_id for j in load_batch(path, check_model=False).jobs})


def test_sweep_adds_an_axis_or_replaces_the_batchs(tmp_path: Path) -> None:
    path = _batch(tmp_path)
    added = load_batch(path, check_model=False, overrides=Overrides(sweeps=("seed=0,1,2",)))
    assert len(added.jobs) == 2 * 2 * 3
    assert {(j.sweep["guidance"], j.sweep["seed"]) for j in added.jobs if j.name == "a"} == {
        (g, s) for g in (2.0, 3.0) for s in (0, 1, 2)}
    replaced = load_batch(path, check_model=False, overrides=Overrides(sweeps=("guidance=5",)))
    assert [j.guidance for j in replaced.jobs] == [5.0, 5.0]
    assert all(j.sweep == {"guidance": 5.0} for j in replaced.jobs)


@pytest.mark.parametrize(("overrides", "fragments"), [
    ({"sets": ("stpes=4",)}, ["--set stpes=4: stpes: unknown key 'stpes'", "did you mean 'steps'"]),
    ({"sets": ("num_inference_steps=4",)},
     ["--set num_inference_steps=4: num_inference_steps:", "did you mean 'steps'?", "another tool's name"]),
    ({"sets": ("guidance_scale=5",)}, ["did you mean 'guidance'?"]),
    ({"sweeps": ("num_frames=17,33",)}, ["--sweep num_frames=17,33", "did you mean 'frames'?"]),
    ({"sets": ("frames=16",)}, ["--set frames=16: frames: got 16 (nearest: 13 or 17)", "4k+1"]),
    ({"sets": ("steps=many",)}, ["--set steps=many: steps: got 'many' (str); allowed: an integer from 1 to 1000"]),
    ({"sets": ("preset=tiny",)}, ["--set preset=tiny: preset: unknown preset 'tiny'", "did you mean 'tiny-preview'"]),
    ({"sets": ("steps",)}, ["--set steps: (flag): must look like key=value"]),
    ({"sets": ("steps=[1, 2]",)}, ["a flag value must be a single number or word"]),
    ({"sets": ("prompt=hi",)}, ["--set prompt=hi: prompt: unknown key 'prompt'"]),
    ({"sets": ("steps=4", "steps=5")}, ["--set steps=5: steps: 'steps' is given again (first by `--set steps=4`)"]),
    ({"sweeps": ("seed=1,x,1",)}, ["--sweep seed=1,x,1: seed[1]: got 'x'", "values 1 appear more than once"]),
    ({"sets": ("guidance=4",)}, ["--set guidance=4: guidance: the batch sweeps 'guidance'", "--sweep guidance=VALUE"]),
    ({"sets": ("seed=1",), "sweeps": ("seed=2,3",)}, ["--sweep seed=2,3: seed: 'seed' is given again (first by "
                                                      "`--set seed=1`)"]),
])
def test_bad_overrides_are_named_by_their_flag(tmp_path: Path, overrides: dict, fragments: list[str]) -> None:
    path = _batch(tmp_path)
    sets = overrides.get("sets", ())
    if not any(s.startswith("model=") for s in sets):
        sets = ("model=tiny", *sets)  # so that the file's missing checkpoint is not among the problems
    text = "\n".join(_messages(path, sets=sets, sweeps=overrides.get("sweeps", ())))
    for frag in fragments:
        assert frag in text, f"{frag!r} missing from:\n{text}"


def test_every_flag_problem_is_listed_with_the_files(tmp_path: Path) -> None:
    path = _batch(tmp_path)
    messages = _messages(path, sets=("steps=0", "crf=99"), sweeps=("sampler=ddim",))
    # The three flags' problems, all at once (its missing checkpoint is its folder check's).
    assert len(messages) == 3
    assert any(m.startswith("--set crf=99: crf:") for m in messages)
    assert any(m.startswith("--sweep sampler=ddim: sampler[0]: got 'ddim'") for m in messages)


def test_aliases_also_hint_in_the_batch_file(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("model: tiny\npreset: tiny-preview\njobs:\n  - prompt: x\n    guidance_scale: 4\n")
    (msg,) = _messages(path)
    assert "b.yaml:5: jobs[0].guidance_scale: unknown key 'guidance_scale' (did you mean 'guidance'?" in msg


def test_set_image_is_relative_to_the_working_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from pan2render.media.video import png_bytes

    path = _batch(tmp_path)
    (tmp_path / "first.png").write_bytes(png_bytes(np.zeros((8, 8, 3), np.uint8)))
    monkeypatch.chdir(tmp_path)
    batch = load_batch(path, overrides=Overrides(sets=("model=tiny", "image=first.png")))
    assert {j.image for j in batch.jobs} == {str(tmp_path / "first.png")}
    messages = _messages(path, sets=("model=tiny", "image=sub/first.png"))
    assert any("--set image=sub/first.png: image:" in m and "does not exist" in m for m in messages)


def test_the_sweep_example_runs_on_the_tiny_model() -> None:
    batch = load_batch(REPO / "jobs" / "sweep.yaml", overrides=Overrides(sets=("model=tiny", "preset=tiny-preview")))
    assert len(batch.jobs) == 18 and {j.model for j in batch.jobs} == {"tiny"}
