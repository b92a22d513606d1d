"""Batch files: validation (every problem at once, with file:line), presets, precedence, sweeps,
prompts files and job ids."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from pan2render.jobs import BatchValidationError, JobSpec, Problem, list_presets, load_batch
from pan2render.jobs.inputs import LIMITS
from pan2render.model_files import folder_problems

REPO = Path(__file__).resolve().parents[2]


def _write(folder: Path, text: str, name: str = "batch.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def _problems(path: Path, **kw: object) -> list[Problem]:
    with pytest.raises(BatchValidationError) as info:
        load_batch(path, **kw)
    problems = info.value.problems
    print(f"\n{info.value}")  # the user-facing message, for the log
    return problems


def _find(problems: list[Problem], *, line: int, field: str, file: str | None = None) -> Problem:
    for p in problems:
        if p.location.line == line and p.field == field and (file is None or p.location.file.endswith(file)):
            return p
    raise AssertionError(f"no problem at line {line} field {field!r} among:\n" + "\n".join(map(str, problems)))


def _assert_says(problem: Problem, *fragments: str) -> None:
    text = str(problem)  # what the user sees: "file:line: field: message"
    for frag in fragments:
        assert frag in text, f"{frag!r} missing from {text!r}"


HEADER = """
model: tiny
preset: tiny-preview
"""


# --------------------------------------------------------------------------------------------------
# One test per bad-input case: each names file:line, the field and what is allowed.

# (job line to insert, field, fragments the message must contain)
BAD_JOB_FIELDS = {
    "unknown-key": ("guidence: 3.0", "jobs[0].guidence", ["unknown key 'guidence'", "did you mean 'guidance'",
                                                          "allowed:", "flow_shift"]),
    "steps-string": ("steps: '50'", "jobs[0].steps", ["'50' (str)", "an integer from 1 to 1000"]),
    "steps-zero": ("steps: 0", "jobs[0].steps", ["got 0", "an integer from 1 to 1000"]),
    "seed-bool": ("seed: yes", "jobs[0].seed", ["True (bool", "an integer in 0.."]),
    "seed-negative": ("seed: -1", "jobs[0].seed", ["got -1", "an integer in 0..9223372036854775807"]),
    "seed-float": ("seed: 1.5", "jobs[0].seed", ["1.5 (float)", "an integer in 0.."]),
    "frames-not-4k1": ("frames: 20", "jobs[0].frames", ["got 20", "17 or 21", "4k+1"]),
    "frames-float": ("frames: 17.0", "jobs[0].frames", ["17.0 (float)", "4k+1"]),
    "height-not-32": ("height: 70", "jobs[0].height", ["got 70", "64 or 96", "multiple of 32"]),
    "width-zero": ("width: 0", "jobs[0].width", ["got 0", "positive multiple of 32"]),
    "width-negative": ("width: -64", "jobs[0].width", ["got -64", "positive multiple of 32"]),
    "guidance-below-1": ("guidance: 0.5", "jobs[0].guidance", ["got 0.5", "a number from 1.0 to 100"]),
    "guidance-nan": ("guidance: .nan", "jobs[0].guidance", ["nan", "a number from 1.0 to 100"]),
    "guidance-bool": ("guidance: true", "jobs[0].guidance", ["(bool", "a number from 1.0 to 100"]),
    "crf-high": ("crf: 52", "jobs[0].crf", ["got 52", "0..51"]),
    "crf-negative": ("crf: -1", "jobs[0].crf", ["got -1", "0..51"]),
    "fps-zero": ("fps: 0", "jobs[0].fps", ["got 0.0", "a number from 1 to 240"]),
    "fps-tiny": ("fps: 0.0001", "jobs[0].fps", ["got 0.0001", "a number from 1 to 240"]),
    "fps-string": ("fps: fast", "jobs[0].fps", ["'fast' (str)", "a number from 1 to 240"]),
    "flow-shift-negative": ("flow_shift: -5", "jobs[0].flow_shift", ["got -5.0", "a number > 0"]),
    "sampler-unknown": ("sampler: eular", "jobs[0].sampler", ["'eular'", "did you mean 'euler'",
                                                              "one of unipc, euler"]),
    "gpus-3": ("gpus: 3", "jobs[0].gpus", ["got 3", "one of 1, 2, 4, 8"]),
    "gpus-16": ("gpus: 16", "jobs[0].gpus", ["got 16", "one of 1, 2, 4, 8"]),
    "prompt-empty": ("prompt: '   '", "jobs[0].prompt", ["is empty", "a non-empty string"]),
    "prompt-number": ("prompt: 42", "jobs[0].prompt", ["42 (int)", "a non-empty string"]),
    "negative-prompt-list": ("negative_prompt: [a]", "jobs[0].negative_prompt", ["(list)", "a string"]),
    "encode-preset-unknown": ("encode_preset: veryfst", "jobs[0].encode_preset",
                              ["'veryfst'", "did you mean 'veryfast'", "one of ultrafast, superfast"]),
}


@pytest.mark.parametrize("case", sorted(BAD_JOB_FIELDS))
def test_bad_job_field_names_line_field_and_allowed(tmp_path: Path, case: str) -> None:
    line_text, field, fragments = BAD_JOB_FIELDS[case]
    key = line_text.split(":")[0]
    prompt = "" if key == "prompt" else "    prompt: a cat\n"
    path = _write(tmp_path, HEADER + "jobs:\n  - name: one\n" + prompt + f"    {line_text}\n")
    problems = _problems(path)
    assert len(problems) == 1, problems
    bad_line = 5 if key == "prompt" else 6
    _assert_says(_find(problems, line=bad_line, field=field), f"batch.yaml:{bad_line}", field, *fragments)


def test_unknown_top_level_key_suggests(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "default:\n  seed: 1\njobs:\n  - prompt: a cat\n")
    p = _find(_problems(path), line=3, field="default")
    _assert_says(p, "batch.yaml:3", "did you mean 'defaults'", "allowed: model, preset, defaults, jobs")


def test_unknown_key_in_defaults_suggests(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "defaults:\n  flowshift: 3\njobs:\n  - prompt: a cat\n")
    _assert_says(_find(_problems(path), line=4, field="defaults.flowshift"), "batch.yaml:4",
                 "did you mean 'flow_shift'")


def test_unknown_preset_lists_known_ones(tmp_path: Path) -> None:
    path = _write(tmp_path, "model: tiny\npreset: pan2-720\njobs:\n  - prompt: a cat\n")
    _assert_says(_find(_problems(path), line=2, field="preset"), "batch.yaml:2", "unknown preset 'pan2-720'",
                 "did you mean 'pan2-720p'", "pan2-480p", "pan2-720p", "tiny-preview", "wan22-ti2v-720p")


def test_missing_model_and_preset(tmp_path: Path) -> None:
    path = _write(tmp_path, "jobs:\n  - prompt: a cat\n")
    problems = _problems(path)
    _assert_says(_find(problems, line=1, field="model"), "missing", "'tiny'", "checkpoint folder")
    _assert_says(_find(problems, line=1, field="preset"), "missing", "tiny-preview")


def test_a_missing_checkpoint_folder_is_the_folder_checks_not_a_problem_of_the_batch(tmp_path: Path) -> None:
    """The batch is valid; the folder's own check says what is missing (validate's exit 5, run's and
    submit's exit 3: tests/runner/cli/test_model_folder_check.py), one exit code per problem."""
    path = _write(tmp_path, "model: ckpt/pan2\npreset: tiny-preview\njobs:\n  - prompt: a cat\n")
    batch = load_batch(path)
    assert batch.model == str(tmp_path / "ckpt" / "pan2") == batch.jobs[0].model
    assert folder_problems(Path(batch.model)) == [f"{tmp_path / 'ckpt' / 'pan2'}: checkpoint folder does not exist"]
    (tmp_path / "ckpt" / "pan2").mkdir(parents=True)
    assert any("model_index.json: file is missing" in p for p in folder_problems(Path(load_batch(path).model)))


def test_missing_image(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "jobs:\n  - prompt: a cat\n    image: frames/first.png\n")
    _assert_says(_find(_problems(path), line=5, field="jobs[0].image"), "batch.yaml:5",
                 str(tmp_path / "frames" / "first.png"), "does not exist", "a PNG, JPEG or WebP file")


def test_missing_image_in_defaults_and_sweep(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "defaults:\n  image: a.png\njobs:\n  - prompt: a cat\n"
                                     "sweep:\n  image: [b.png]\n")
    problems = _problems(path)
    _assert_says(_find(problems, line=4, field="defaults.image"), "a.png", "does not exist")
    _assert_says(_find(problems, line=8, field="sweep.image[0]"), "b.png", "does not exist")


def test_missing_prompts_file(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "prompts_file: prompts.txt\n")
    _assert_says(_find(_problems(path), line=3, field="prompts_file"), "batch.yaml:3",
                 str(tmp_path / "prompts.txt"), "does not exist")


def test_check_files_false_skips_model_and_image_checks(tmp_path: Path) -> None:
    path = _write(tmp_path, "model: ../elsewhere/ckpt\npreset: tiny-preview\n"
                            "jobs:\n  - prompt: a cat\n    image: first.png\n")
    assert len(_problems(path)) == 1  # the image (the checkpoint is its folder check's)
    batch = load_batch(path, check_files=False)
    job = batch.jobs[0]
    assert job.image == str(tmp_path / "first.png") and job.image_sha256 is None
    assert batch.model == str((tmp_path / "../elsewhere/ckpt").resolve())


def test_duplicate_job_names(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "jobs:\n  - name: fox\n    prompt: a fox\n"
                                     "  - name: fox\n    prompt: another fox\n")
    _assert_says(_find(_problems(path), line=6, field="jobs[1].name"), "batch.yaml:6",
                 "duplicate job name 'fox'", "first used at", "batch.yaml:4", "must be unique")


def test_identical_resolved_jobs_are_duplicates(tmp_path: Path) -> None:
    # Different names, same render: one of them would be wasted GPU time.
    path = _write(tmp_path, HEADER + "jobs:\n  - name: a\n    prompt: a fox\n    seed: 0\n"
                                     "  - name: b\n    prompt: a fox\n")
    p = _find(_problems(path), line=7, field="jobs")
    _assert_says(p, "batch.yaml:7", "'b'", "same render as job 'a'", "batch.yaml:4", "change its prompt, seed")


def test_sweep_that_makes_jobs_identical_is_reported(tmp_path: Path) -> None:
    # The sweep value overrides the job's own steps, so both jobs collapse into one render.
    path = _write(tmp_path, HEADER + "jobs:\n  - name: a\n    prompt: fox\n    steps: 4\n"
                                     "  - name: b\n    prompt: fox\n    steps: 6\nsweep:\n  steps: [2]\n")
    _assert_says(_find(_problems(path), line=7, field="jobs"), "'b' with steps=2", "same render as job 'a'")


@pytest.mark.parametrize("text", ["jobs: []\n", "", "prompts_file: empty.txt\n"], ids=["empty-list", "no-jobs",
                                                                                       "empty-prompts-file"])
def test_empty_batch(tmp_path: Path, text: str) -> None:
    (tmp_path / "empty.txt").write_text("# only a comment\n\n")
    path = _write(tmp_path, HEADER + text)
    problems = _problems(path)
    assert len(problems) == 1
    _assert_says(problems[0], "batch.yaml:", "no jobs", "`jobs:` list", "prompts_file")


def test_missing_prompt(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "jobs:\n  - name: fox\n    seed: 1\n")
    _assert_says(_find(_problems(path), line=4, field="jobs[0].prompt"), "batch.yaml:4", "missing",
                 "non-empty `prompt`")


def test_job_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "jobs:\n  - [a, b]\n")
    _assert_says(_find(_problems(path), line=4, field="jobs[0]"), "(list)", "a mapping with `prompt`")


@pytest.mark.parametrize(
    "text,line,fragment",
    [("model: tiny\npreset: [tiny-preview\njobs: []\n", 3, "YAML syntax error"),
     ("model: tiny\n  preset: tiny-preview\n", 2, "YAML syntax error"),
     ("model: tiny\npreset: tiny-preview\njobs:\n\t- prompt: x\n", 4, "YAML syntax error")],
    ids=["unclosed-bracket", "bad-indent", "tab"],
)
def test_yaml_syntax_error_has_line(tmp_path: Path, text: str, line: int, fragment: str) -> None:
    problems = _problems(_write(tmp_path, text))
    assert len(problems) == 1
    _assert_says(problems[0], f"batch.yaml:{line}", "(yaml)", fragment, "fix the file")


def test_python_tags_are_refused(tmp_path: Path) -> None:
    # The safe loader never builds Python objects from tags.
    path = _write(tmp_path, HEADER + "jobs:\n  - prompt: !!python/object/apply:os.system ['echo hi']\n")
    _assert_says(_problems(path)[0], "batch.yaml:4", "(yaml)", "python/object/apply")


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "jobs:\n  - prompt: a cat\n    seed: 1\n    seed: 2\n")
    _assert_says(_find(_problems(path), line=6, field="seed"), "batch.yaml:6", "appears twice", "line 5")


def test_sweep_over_unknown_field(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "jobs:\n  - prompt: a cat\nsweep:\n  guidence: [2.0, 3.0]\n")
    _assert_says(_find(_problems(path), line=6, field="sweep.guidence"), "batch.yaml:6",
                 "cannot sweep unknown field", "did you mean 'guidance'", "allowed:", "seed")


@pytest.mark.parametrize("value", ["[]", "3", "{a: 1}"], ids=["empty-list", "scalar", "mapping"])
def test_sweep_needs_a_non_empty_list(tmp_path: Path, value: str) -> None:
    path = _write(tmp_path, HEADER + f"jobs:\n  - prompt: a cat\nsweep:\n  seed: {value}\n")
    _assert_says(_find(_problems(path), line=6, field="sweep.seed"), "batch.yaml:6", "a non-empty list")


def test_sweep_values_are_validated_and_distinct(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "jobs:\n  - prompt: a cat\nsweep:\n  frames: [17, 18]\n  seed: [1, 1]\n")
    problems = _problems(path)
    _assert_says(_find(problems, line=6, field="sweep.frames[1]"), "got 18", "4k+1")
    _assert_says(_find(problems, line=7, field="sweep.seed"), "appear more than once")


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"prompt": "ok"}\n{"prompt": "x", "gpus": 3}\nnot json\n')
    path = _write(tmp_path, """
        model: tiny
        preset: tiny-preview
        defaults:
          crf: 60
        jobs:
          - name: a
            prompt: a cat
            frames: 16
            height: 100
          - name: a
            prompt: ""
          - prompt: a dog
            sampler: ddim
            colour: red
        prompts_file: rows.jsonl
        sweep:
          guidance: [0.0, 3.0]
          nope: [1]
        """)
    problems = _problems(path)
    expected = [
        (4, "defaults.crf"), (8, "jobs[0].frames"), (9, "jobs[0].height"), (10, "jobs[1].name"),
        (11, "jobs[1].prompt"), (13, "jobs[2].sampler"), (14, "jobs[2].colour"), (17, "sweep.guidance[0]"),
        (18, "sweep.nope"),
    ]
    for line, field in expected:
        _find(problems, line=line, field=field, file="batch.yaml")
    _find(problems, line=2, field="prompts_file[1].gpus", file="rows.jsonl")
    _find(problems, line=3, field="prompts_file[2]", file="rows.jsonl")
    assert len(problems) == len(expected) + 2, "\n".join(map(str, problems))
    # Listed batch file first, in line order.
    lines = [p.location.line for p in problems if p.location.file.endswith("batch.yaml")]
    assert lines == sorted(lines)


def test_missing_batch_file(tmp_path: Path) -> None:
    problems = _problems(tmp_path / "nope.yaml")
    _assert_says(problems[0], "nope.yaml:1", "does not exist")


# --------------------------------------------------------------------------------------------------
# Presets


def test_presets_have_the_documented_values() -> None:
    presets = list_presets()
    print({k: {f: v for f, v in p.items() if f != "negative_prompt"} for k, p in presets.items()})
    assert set(presets) == {"pan2-720p", "pan2-480p", "wan22-ti2v-720p", "tiny-preview", "fastwan-720p",
                            "distill-lora-720p", "pan2-720p-fast"}
    expect = {
        "pan2-720p": dict(height=704, width=1248, frames=121, fps=24.0, steps=50, guidance=2.5, flow_shift=5.0,
                          sampler="unipc"),
        "pan2-480p": dict(height=480, width=832, frames=121, fps=24.0, steps=50, guidance=2.5, flow_shift=3.0,
                          sampler="unipc"),
        "wan22-ti2v-720p": dict(height=704, width=1280, frames=121, fps=24.0, steps=50, guidance=5.0,
                                flow_shift=5.0, sampler="unipc"),
        "tiny-preview": dict(height=64, width=64, frames=17, fps=8.0, steps=8, guidance=2.5, flow_shift=5.0,
                             sampler="unipc"),
        "distill-lora-720p": dict(height=704, width=1248, frames=121, fps=24.0, steps=4, guidance=1.0,
                                  flow_shift=5.0, sampler="dmd", timesteps=(1000, 750, 500, 250)),
    }
    # pan2-720p's job with MagCache's published Wan2.2-TI2V-5B setting, gating and FP8 on top.
    expect["pan2-720p-fast"] = dict(expect["pan2-720p"], cache="magcache", cache_threshold=0.06, cache_max_skips=2,
                                    cache_retention=0.2, guidance_until=0.5, precision="fp8")
    for name, values in expect.items():
        assert {k: presets[name][k] for k in values} == values, name
        assert presets[name]["description"]


def test_fast_lane_fields_are_checked_with_their_line(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        model: tiny
        preset: tiny-preview
        jobs:
          - prompt: a fox
            cache: magcahe
            cache_threshold: -1
            guidance_until: 0
        """)
    with pytest.raises(BatchValidationError) as e:
        load_batch(path)
    text = str(e.value)
    assert ":5: jobs[0].cache: got 'magcahe' (did you mean 'magcache'?)" in text, text
    assert ":6: jobs[0].cache_threshold: got -1.0; allowed: a number >= 0" in text, text
    assert ":7: jobs[0].guidance_until: got 0.0; allowed: a number > 0 and <= 1" in text, text
    dmd = _write(tmp_path, """
        model: tiny
        preset: fastwan-720p
        jobs:
          - prompt: a dmd fox
            cache: magcache
        """, "dmd.yaml")
    with pytest.raises(BatchValidationError) as e:
        load_batch(dmd)
    assert ":5: jobs[0].cache: got magcache with sampler dmd; allowed: none" in str(e.value), str(e.value)


def test_a_sweep_over_the_cache_keeps_the_exact_job_id(tmp_path: Path) -> None:
    """The exact job of a cache sweep is the job a batch without the sweep renders: same id."""
    plain = load_batch(_write(tmp_path, "model: tiny\npreset: tiny-preview\njobs:\n  - prompt: a fox\n", "a.yaml"))
    swept = load_batch(_write(tmp_path, "model: tiny\npreset: tiny-preview\njobs:\n  - prompt: a fox\n"
                                        "sweep:\n  cache: [none, magcache]\n", "b.yaml"),
                       check_model=False)  # (the tiny model's calibration: tests/test_calibration_store.py)
    assert [j.spec_hash for j in swept.jobs][0] == plain.jobs[0].spec_hash
    assert swept.jobs[1].spec_hash != plain.jobs[0].spec_hash and swept.jobs[1].cache == "magcache"


# --------------------------------------------------------------------------------------------------
# Resolution


def test_precedence_preset_defaults_job_sweep(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        model: tiny
        preset: tiny-preview
        defaults:
          steps: 4
          guidance: 3.0
          crf: 20
        jobs:
          - name: a
            prompt: a cat
            guidance: 4.0
            crf: 30
        sweep:
          crf: [40]
        """)
    (job,) = load_batch(path).jobs
    got = {k: getattr(job, k) for k in ("frames", "steps", "guidance", "crf", "seed", "gpus", "negative_prompt")}
    print(got)
    # frames: preset; steps: defaults; guidance: job; crf: sweep; seed/gpus/negative_prompt: built-in.
    assert got == dict(frames=17, steps=4, guidance=4.0, crf=40, seed=0, gpus=1, negative_prompt="")
    assert job.preset == "tiny-preview" and job.model == "tiny" and job.sweep == {"crf": 40}
    assert str(job.source) == f"{path}:8"


def test_sweep_is_a_cartesian_product_over_every_job(tmp_path: Path) -> None:
    (tmp_path / "more.txt").write_text("a third prompt\n")
    path = _write(tmp_path, HEADER + textwrap.dedent("""
        jobs:
          - {name: a, prompt: one}
          - {name: b, prompt: two}
        prompts_file: more.txt
        sweep:
          guidance: [2, 3.5]
          seed: [0, 1, 2]
        """))
    jobs = load_batch(path).jobs
    print([j.job_id for j in jobs])
    assert len(jobs) == 3 * 2 * 3
    for name in ("a", "b", "a-third-prompt"):
        combos = [(j.guidance, j.seed) for j in jobs if j.name == name]
        assert combos == [(2.0, 0), (2.0, 1), (2.0, 2), (3.5, 0), (3.5, 1), (3.5, 2)]
    assert jobs[0].sweep == {"guidance": 2.0, "seed": 0}
    assert len({j.job_id for j in jobs}) == len(jobs)
    assert jobs[0].job_id.startswith("a-guidance2.0-seed0-")


def test_ids_are_deterministic_across_loads_and_folders(tmp_path: Path) -> None:
    text = HEADER + "jobs:\n  - name: fox\n    prompt: a fox\n  - prompt: a red kite\nsweep:\n  seed: [0, 1]\n"
    first = load_batch(_write(tmp_path, text)).jobs
    again = load_batch(_write(tmp_path, text)).jobs
    (tmp_path / "other").mkdir()
    moved = load_batch(_write(tmp_path / "other", "# a comment changes nothing\n" + text, "renamed.yaml")).jobs
    ids = [j.job_id for j in first]
    print(ids)
    assert ids == [j.job_id for j in again] == [j.job_id for j in moved]
    assert ids[2].startswith("a-red-kite-seed0-")  # unnamed: named after its prompt
    # Re-ordering the jobs keeps every id: names do not depend on the position.
    reordered = HEADER + "jobs:\n  - prompt: a red kite\n  - name: fox\n    prompt: a fox\nsweep:\n  seed: [0, 1]\n"
    assert sorted(j.job_id for j in load_batch(_write(tmp_path, reordered)).jobs) == sorted(ids)


def test_numbers_are_canonical_so_5_and_5_0_hash_alike(tmp_path: Path) -> None:
    a = load_batch(_write(tmp_path, HEADER + "jobs:\n  - {prompt: x, guidance: 5, fps: 8}\n", "a.yaml")).jobs[0]
    b = load_batch(_write(tmp_path, HEADER + "jobs:\n  - {prompt: x, guidance: 5.0, fps: 8.0}\n", "b.yaml")).jobs[0]
    assert a.spec_hash == b.spec_hash and isinstance(a.guidance, float)
    c = load_batch(_write(tmp_path, HEADER + "jobs:\n  - {prompt: x, guidance: 5.5}\n", "c.yaml")).jobs[0]
    assert c.spec_hash != a.spec_hash


def test_repeated_unnamed_prompts_get_numbered_names(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "jobs:\n  - {prompt: A fox!, seed: 1}\n  - {prompt: a fox, seed: 2}\n"
                                     "  - {name: a-fox-3, prompt: x}\n  - {prompt: A FOX, seed: 3}\n")
    assert [j.name for j in load_batch(path).jobs] == ["a-fox", "a-fox-2", "a-fox-3", "a-fox-4"]


def test_image_is_resolved_and_hashed(tmp_path: Path) -> None:
    import numpy as np

    from pan2render.media.video import png_bytes

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "first.png").write_bytes(png_bytes(np.full((8, 8, 3), 10, np.uint8)))
    path = _write(tmp_path, HEADER + "jobs:\n  - {prompt: x, image: img/first.png}\n")
    job = load_batch(path).jobs[0]
    assert job.image == str(tmp_path / "img" / "first.png") and job.image_sha256 is not None
    (tmp_path / "img" / "first.png").write_bytes(png_bytes(np.full((8, 8, 3), 20, np.uint8)))
    assert load_batch(path).jobs[0].spec_hash != job.spec_hash  # new pixels, new render


def test_prompts_file_txt(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "prompts.txt").write_text("# header\n\nA fox in snow\n   \n  a kite over hills  \n# end\n")
    path = _write(tmp_path, HEADER + "prompts_file: p/prompts.txt\ndefaults:\n  seed: 9\n")
    jobs = load_batch(path).jobs
    print([(j.name, str(j.source)) for j in jobs])
    assert [j.prompt for j in jobs] == ["A fox in snow", "a kite over hills"]
    assert [j.source.line for j in jobs] == [3, 5]
    assert all(j.source.file.endswith("p/prompts.txt") and j.seed == 9 for j in jobs)


def test_prompts_file_jsonl_rows_carry_fields(tmp_path: Path) -> None:
    rows = [{"prompt": "a fox", "seed": 5, "name": "fox"}, {"prompt": "a kite", "steps": 2, "guidance": 4}]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    path = _write(tmp_path, HEADER + "jobs:\n  - {name: first, prompt: yaml job}\nprompts_file: rows.jsonl\n")
    jobs = load_batch(path).jobs
    assert [j.name for j in jobs] == ["first", "fox", "a-kite"]
    assert (jobs[1].seed, jobs[2].steps, jobs[2].guidance, jobs[2].seed) == (5, 2, 4.0, 0)
    assert str(jobs[2].source) == str(tmp_path / "rows.jsonl") + ":2"


def test_prompts_file_jsonl_bad_rows(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "frames": 18}\n\n["a list"]\n{"seed": 1}\n{bad\n')
    problems = _problems(_write(tmp_path, HEADER + "prompts_file: rows.jsonl\n"))
    _assert_says(_find(problems, line=1, field="prompts_file[0].frames"), "rows.jsonl:1", "4k+1")
    _assert_says(_find(problems, line=3, field="prompts_file[1]"), "rows.jsonl:3", "a JSON object")
    _assert_says(_find(problems, line=4, field="prompts_file[2].prompt"), "rows.jsonl:4", "missing")
    _assert_says(_find(problems, line=5, field="prompts_file[3]"), "rows.jsonl:5", "not valid JSON")


def test_yaml_anchors_and_merge_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + textwrap.dedent("""
        jobs:
          - &base {name: a, prompt: a fox, steps: 3, seed: 4}
          - <<: *base
            name: b
            seed: 5
        """))
    a, b = load_batch(path).jobs
    assert (b.prompt, b.steps, b.seed) == ("a fox", 3, 5) and a.seed == 4


@pytest.mark.parametrize("name", ["../../etc/passwd", "/abs", "..", ".", "", "a/../../b", "\x00nul",
                                  "C:\\windows\\x", "x" * 10_000, "猫の動画", ".hidden"])
def test_hostile_names_give_ids_inside_the_folder(tmp_path: Path, name: str) -> None:
    spec = load_batch(_write(tmp_path, HEADER + "jobs:\n  - prompt: a fox\n")).jobs[0]
    hostile = JobSpec(**{**spec.to_dict(), "source": None, "name": name})
    job_id = hostile.job_id
    print(repr(name[:20]), "->", job_id)
    out = tmp_path / "renders"
    assert (out / job_id).resolve().parent == out.resolve()
    assert job_id not in ("", ".", "..") and not job_id.startswith(".")
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in job_id)
    assert len(job_id) <= 100


def test_hostile_name_in_a_batch_file(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "jobs:\n  - {name: ../../etc/passwd, prompt: a}\n  - {name: /abs, prompt: b}\n"
                                     f"  - {{name: {'n' * LIMITS.name_chars}, prompt: c}}\n")
    for job in load_batch(path).jobs:
        assert (tmp_path / job.job_id).resolve().parent == tmp_path.resolve()


# --------------------------------------------------------------------------------------------------
# The shipped example batches


def test_quickstart_batch() -> None:
    batch = load_batch(REPO / "jobs" / "quickstart.yaml")
    print([j.job_id for j in batch.jobs])
    assert batch.model == "tiny" and batch.preset == "tiny-preview"
    assert len({j.name for j in batch.jobs}) >= 3 and len(batch.jobs) == 6
    assert {j.seed for j in batch.jobs} == {0, 1}
    assert all((j.height, j.width, j.frames) == (64, 64, 17) for j in batch.jobs)


def test_other_example_batches_load() -> None:
    sweep = load_batch(REPO / "jobs" / "sweep.yaml", check_files=False)  # the checkpoint is not here
    assert sweep.preset == "pan2-720p" and len(sweep.jobs) == 3 * 3 * 2
    assert {(j.guidance, j.flow_shift) for j in sweep.jobs} == {(g, s) for g in (2.0, 2.5, 3.5) for s in (3.0, 5.0)}
    prompts = load_batch(REPO / "jobs" / "prompts_file.yaml")
    assert len(prompts.jobs) == 3 and all(j.seed == 7 for j in prompts.jobs)
    groups = load_batch(REPO / "jobs" / "groups.yaml")
    assert [(j.name, j.gpus, j.seed) for j in groups.jobs] == [
        ("lighthouse", 2, 0), ("lighthouse-seed-5", 2, 5), ("market-single-gpu", 1, 0)]


def test_encode_preset_reaches_the_job_and_counts_in_its_id_only_when_set(tmp_path: Path) -> None:
    jobs = "jobs:\n  - name: a\n    prompt: a cat\n"
    plain = load_batch(_write(tmp_path, HEADER + jobs, "plain.yaml")).jobs[0]
    medium = load_batch(_write(tmp_path, HEADER + "defaults:\n  encode_preset: medium\n" + jobs, "m.yaml")).jobs[0]
    fast = load_batch(_write(tmp_path, HEADER + "defaults:\n  encode_preset: veryfast\n" + jobs, "f.yaml")).jobs[0]
    print(plain.job_id, medium.job_id, fast.job_id)
    assert (plain.encode_preset, medium.encode_preset, fast.encode_preset) == ("veryfast", "medium", "veryfast")
    # Every job was encoded with medium before the field existed: a medium job keeps the id it had
    # then (this one's, from before the default became veryfast), and any other value is another
    # bitstream, so another id, the default included.
    assert medium.job_id == "a-5c1a2fce"
    assert plain.job_id == fast.job_id != medium.job_id
    assert JobSpec.from_dict({k: v for k, v in plain.to_dict().items() if k != "encode_preset"}) == plain


# --------------------------------------------------------------------------------------------------
# Sampler dmd: the timesteps field and the rules tying it to sampler and guidance

DMD_HEADER = HEADER + "defaults:\n  sampler: dmd\n  guidance: 1\n"


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        ("[1000, 522, 757]", ["not strictly decreasing (522 then 757)"]),
        ("[1000, 1000]", ["not strictly decreasing"]),
        ("[1001, 500]", ["1001", "out of range", "1..1000"]),
        ("[1000, 0]", ["0 in [1000, 0] is out of range"]),
        ("[]", ["is empty"]),
        ("[1000, 757.5]", ["757.5 (float)"]),
        ("1000", ["got 1000", "a non-empty list of integers"]),
    ],
)
def test_bad_timesteps_name_file_line_and_what_is_allowed(tmp_path: Path, value: str, fragments: list[str]) -> None:
    path = _write(tmp_path, DMD_HEADER + f"jobs:\n  - prompt: x\n  - prompt: y\n    timesteps: {value}\n")
    problems = _problems(path)
    assert len(problems) == 1
    _assert_says(_find(problems, line=9, field="jobs[1].timesteps"), "batch.yaml:9", *fragments, "strictly decreasing")


def test_dmd_with_guidance_and_timesteps_without_dmd_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + textwrap.dedent("""
        jobs:
          - prompt: guided dmd
            sampler: dmd
            timesteps: [1000, 757, 522]
            guidance: 3.0
          - prompt: timesteps with euler
            sampler: euler
            timesteps: [1000, 500]
          - prompt: dmd guided by the preset
            sampler: dmd
            timesteps: [1000, 500]
          - prompt: dmd with steps of its own
            sampler: dmd
            guidance: 1
            timesteps: [1000, 500]
            steps: 4
        sweep:
          seed: [0, 1]
        """))
    problems = _problems(path)
    _assert_says(_find(problems, line=8, field="jobs[0].guidance"), "got 3 with sampler dmd", "allowed: 1")
    _assert_says(_find(problems, line=11, field="jobs[1].timesteps"), "sampler 'euler'", "for sampler dmd only")
    # The guidance came from the preset (tiny-preview: 2.5): the job's own line is named.
    _assert_says(_find(problems, line=12, field="jobs[2].guidance"), "got 2.5 with sampler dmd")
    _assert_says(_find(problems, line=19, field="jobs[3].steps"), "got 4", "2 timesteps", "drop steps")
    # One problem per job, not one per sweep combination.
    assert len(problems) == 4


def test_dmd_steps_is_the_number_of_timesteps_and_timesteps_change_the_id(tmp_path: Path) -> None:
    path = _write(tmp_path, DMD_HEADER + "jobs:\n  - {name: a, prompt: x, timesteps: [1000, 757, 522]}\n"
                                         "  - {name: b, prompt: x, timesteps: [1000, 757, 500]}\n"
                                         "  - {name: c, prompt: x, sampler: unipc, guidance: 2.5}\n")
    a, b, c = load_batch(path).jobs
    assert (a.sampler, a.steps, a.timesteps, a.guidance) == ("dmd", 3, (1000, 757, 522), 1.0)
    assert c.timesteps is None and c.steps == 8
    # Only the timesteps differ between a and b (names do not enter the hash): new pixels, new id.
    assert a.spec_hash != b.spec_hash
    # A round trip through the ledger's JSON keeps the spec and its id.
    again = JobSpec.from_dict(json.loads(json.dumps(a.to_dict())))
    assert again == a and again.job_id == a.job_id


def test_ids_of_jobs_without_timesteps_are_unchanged(tmp_path: Path) -> None:
    """timesteps joined the hashed fields later: unset, it stays out of the hash, so folders rendered
    before keep their ids (the payload below is the hash as it was before the field existed)."""
    import hashlib

    # encode_preset: medium, what every job was encoded with then (the default is veryfast now).
    job = load_batch(_write(tmp_path, HEADER + "defaults:\n  encode_preset: medium\n"
                                               "jobs:\n  - {name: a, prompt: x}\n")).jobs[0]
    before = ("model", "prompt", "negative_prompt", "image_sha256", "seed", "steps", "guidance", "height",
              "width", "frames", "fps", "flow_shift", "sampler", "crf")
    blob = json.dumps({k: getattr(job, k) for k in before}, sort_keys=True, separators=(",", ":"), default=str)
    assert job.spec_hash == hashlib.sha256(blob.encode()).hexdigest()


def test_timesteps_can_be_swept(tmp_path: Path) -> None:
    path = _write(tmp_path, DMD_HEADER + "jobs:\n  - {name: a, prompt: x}\n"
                                         "sweep:\n  timesteps: [[1000, 757, 522], [1000, 500]]\n")
    jobs = load_batch(path).jobs
    print([j.job_id for j in jobs])
    assert [(j.timesteps, j.steps) for j in jobs] == [((1000, 757, 522), 3), ((1000, 500), 2)]
    assert jobs[0].job_id.startswith("a-timesteps-1000-757-522-")


def test_fastwan_preset_and_example_batch() -> None:
    preset = list_presets()["fastwan-720p"]
    assert {k: preset[k] for k in ("height", "width", "frames", "fps", "sampler", "timesteps", "steps", "guidance")} \
        == dict(height=704, width=1248, frames=121, fps=24.0, sampler="dmd", timesteps=(1000, 757, 522), steps=3,
                guidance=1.0)
    batch = load_batch(REPO / "jobs" / "fastwan.yaml")
    assert [(j.name, j.sampler, j.timesteps, j.steps, j.guidance, j.gpus) for j in batch.jobs] == [
        ("fox", "dmd", (1000, 757, 522), 3, 1.0, 1), ("fox-two-steps", "dmd", (1000, 500), 2, 1.0, 1),
        ("harbour-group", "dmd", (1000, 757, 522), 3, 1.0, 2)]
