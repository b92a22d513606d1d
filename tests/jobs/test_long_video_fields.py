"""The fields of a long video in a batch: ``segments`` and ``prompts`` (a story), checked like every
field (file:line, the field, what is allowed); a batch without them keeps its job ids."""

from __future__ import annotations

import hashlib
import runpy
import textwrap
from pathlib import Path

import pytest

from pan2render.jobs import BatchValidationError, load_batch
from pan2render.jobs.overrides import Overrides
from pan2render.long_video import segment_prompts, segment_seed, video_fps, video_frames

HEADER = "model: tiny\npreset: tiny-preview\n"


def _batch(tmp: Path, body: str, name: str = "b.yaml") -> Path:
    path = tmp / name
    path.write_text(HEADER + textwrap.dedent(body).lstrip("\n"))
    return path


def _problems(path: Path, **kw: object) -> list[str]:
    with pytest.raises(BatchValidationError) as info:
        load_batch(path, **kw)
    print(info.value)
    return [str(p) for p in info.value.problems]


def test_a_story_gives_its_segments_and_its_first_prompt(tmp_path: Path) -> None:
    jobs = load_batch(_batch(tmp_path, """
        jobs:
          - name: story
            prompts: [a fox wakes, the fox runs, the fox sleeps]
          - name: river
            prompt: a river
            segments: 3
          - name: one
            prompts: [a lone prompt]
        """)).jobs
    story, river, one = jobs
    assert (story.segments, story.prompt) == (3, "a fox wakes")
    assert segment_prompts(story) == ("a fox wakes", "the fox runs", "the fox sleeps")
    assert river.prompts is None and segment_prompts(river) == ("a river",) * 3
    assert video_frames(story) == video_frames(river) == 3 * 17 - 2  # tiny-preview: 17 frames a segment
    # One prompt is a job of one segment, the same render as `prompt:` (the same id but for the name).
    assert one.prompts is None and one.segments == 1
    assert one.spec_hash == load_batch(_batch(tmp_path, "jobs: [{name: one, prompt: a lone prompt}]",
                                              "plain.yaml")).jobs[0].spec_hash
    # Each segment's seed comes from the job's and k; the first is the job's own.
    assert segment_seed(story.seed, 1) == story.seed
    assert len({segment_seed(7, k) for k in range(1, 6)}) == 5 and segment_seed(7, 2) == segment_seed(7, 2)


def test_a_batch_without_the_fields_keeps_its_job_ids() -> None:
    """The quickstart's ids as they were before segments and interpolation existed."""
    jobs = load_batch(Path(__file__).resolve().parents[2] / "jobs" / "quickstart.yaml").jobs
    assert [j.job_id for j in jobs] == [
        "fox-seed0-ff878fd3", "fox-seed1-5136b0ff", "harbour-seed0-569f179f", "harbour-seed1-07f5a674",
        "a-paper-lantern-drifts-up-into-seed0-18faf37a", "a-paper-lantern-drifts-up-into-seed1-79ae501f"]
    assert all((j.segments, j.prompts, j.interpolate) == (1, None, 1) for j in jobs)


def test_bad_segments_and_prompts_are_refused_with_file_line_and_field(tmp_path: Path) -> None:
    path = _batch(tmp_path, """
        jobs:
          - name: zero
            prompt: a
            segments: 0
          - name: many
            prompt: b
            segments: 33
          - name: empty
            prompts: []
          - name: blank
            prompts: [fine, "  "]
          - name: text
            prompts: one string
        """)
    found = _problems(path)
    assert any(p.startswith(f"{path}:6: jobs[0].segments: got 0; allowed: an integer from 1 to 32") for p in found)
    assert any(p.startswith(f"{path}:9: jobs[1].segments: got 33; allowed") for p in found)
    assert any(p.startswith(f"{path}:11: jobs[2].prompts: got 0 prompt(s); allowed: a list of 1 to 32 non-empty")
               for p in found)
    assert any(p.startswith(f"{path}:13: jobs[3].prompts: [1] is empty") for p in found)
    assert any(p.startswith(f"{path}:15: jobs[4].prompts: got 'one string' (str); allowed: a list") for p in found)


def test_segments_and_prompts_that_disagree_are_refused(tmp_path: Path) -> None:
    path = _batch(tmp_path, """
        jobs:
          - name: disagree
            prompts: [a, b]
            segments: 3
          - name: two-firsts
            prompt: x
            prompts: [y, z]
        """)
    found = _problems(path)
    assert f"{path}:6: jobs[0].segments: got 3 but the job lists 2 prompts, one per segment; drop segments, or " \
           "give 3 prompts" in found
    assert any(p.startswith(f"{path}:8: jobs[1].prompt: differs from prompts[0] ('y')") for p in found)
    # `segments` from the defaults disagrees with the story as well; from the preset it would not.
    other = _batch(tmp_path, """
        defaults: {segments: 4}
        jobs:
          - {name: story, prompts: [a, b]}
        """, "defaults.yaml")
    assert any(p.startswith(f"{other}:5: jobs[0].segments: got 4 but the job lists 2 prompts")
               for p in _problems(other))
    # A --set disagrees as the file would, located at the job.
    story = _batch(tmp_path, "jobs: [{name: story, prompts: [a, b]}]", "story.yaml")
    assert any("jobs[0].segments: got 5 but the job lists 2 prompts" in p
               for p in _problems(story, overrides=Overrides(sets=["segments=5"])))


def test_a_job_needs_a_prompt_or_prompts(tmp_path: Path) -> None:
    path = _batch(tmp_path, "jobs:\n  - name: nothing\n    seed: 3\n")
    assert _problems(path) == [f"{path}:4: jobs[0].prompt: missing; every job needs a non-empty `prompt` (or "
                               "`prompts`, one per segment)"]


def test_segments_sweep_and_set_like_any_field(tmp_path: Path) -> None:
    path = _batch(tmp_path, """
        jobs: [{name: river, prompt: a river}]
        sweep: {segments: [1, 2, 3]}
        """)
    jobs = load_batch(path).jobs
    assert [(j.segments, video_frames(j)) for j in jobs] == [(1, 17), (2, 33), (3, 49)]
    assert len({j.job_id for j in jobs}) == 3
    flags = load_batch(_batch(tmp_path, "jobs: [{name: river, prompt: a river}]", "plain.yaml"),
                       overrides=Overrides(sets=["segments=2"])).jobs
    assert flags[0].segments == 2


# ---------------------------------------------------------------------------------------- interpolation
_MAKE = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "make_random_ifnet.py"))


def test_interpolation_weights_resolve_against_the_batch_and_hash_by_content(tmp_path: Path) -> None:
    weights = _MAKE["save_random_ifnet"](tmp_path / "rife" / "ifnet.safetensors")
    path = _batch(tmp_path, """
        defaults: {interpolation_weights: rife/ifnet.safetensors}
        jobs:
          - {name: smooth, prompt: a river, interpolate: 2}
          - {name: plain, prompt: a river}
        """)
    smooth, plain = load_batch(path).jobs
    assert smooth.interpolation_weights == str(weights) and smooth.interpolation_sha256 == \
        hashlib.sha256(weights.read_bytes()).hexdigest()
    assert video_frames(smooth) == 2 * 17 - 1 and video_fps(smooth) == 16.0  # tiny-preview: 17 frames at 8 fps
    # Weights that nothing interpolates with change nothing: the job's id is the one it had without them.
    assert plain.spec_hash == load_batch(_batch(tmp_path, "jobs: [{name: plain, prompt: a river}]", "p.yaml")
                                         ).jobs[0].spec_hash
    # The same weights elsewhere: the same job; other weights: another.
    moved = tmp_path / "elsewhere.safetensors"
    moved.write_bytes(weights.read_bytes())
    again = load_batch(path, overrides=Overrides(sets=[f"interpolation_weights={moved}"])).jobs[0]
    assert again.spec_hash == smooth.spec_hash
    _MAKE["save_random_ifnet"](moved, seed=1)
    assert load_batch(path, overrides=Overrides(sets=[f"interpolation_weights={moved}"])).jobs[0].spec_hash \
        != smooth.spec_hash
    # A segmented, interpolated job: (3 x 17 - 2 - 1) x 2 + 1 frames.
    both = load_batch(_batch(tmp_path, """
        jobs: [{name: both, prompt: a, segments: 3, interpolate: 2, interpolation_weights: rife/ifnet.safetensors}]
        """, "both.yaml")).jobs[0]
    assert video_frames(both) == (3 * 17 - 2 - 1) * 2 + 1


def test_missing_or_wrong_interpolation_weights_are_refused_naming_them(tmp_path: Path) -> None:
    (tmp_path / "notes.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")  # no tensors
    (tmp_path / "lora.safetensors").write_bytes(b"not a weights file at all")
    path = _batch(tmp_path, """
        jobs:
          - name: gone
            prompt: a
            interpolate: 2
            interpolation_weights: gone.safetensors
          - name: empty
            prompt: b
            interpolate: 4
            interpolation_weights: notes.safetensors
          - name: junk
            prompt: c
            interpolate: 2
            interpolation_weights: lora.safetensors
          - name: without
            prompt: d
            interpolate: 2
        """)
    found = _problems(path)
    assert f"{path}:7: jobs[0].interpolation_weights: interpolation weights '{tmp_path / 'gone.safetensors'}' " \
           "does not exist; allowed: a RIFE IFNet weights file (v4.25 / v4.26, .safetensors or a torch state dict)" \
        in found
    # The model's own check says what is wrong with the others, naming them.
    assert any(p.startswith(f"{path}:11: jobs[1].interpolation_weights: IFNet weights file "
                            f"'{tmp_path / 'notes.safetensors'}' holds no tensors") for p in found)
    assert any(p.startswith(f"{path}:15: jobs[2].interpolation_weights: IFNet weights file "
                            f"'{tmp_path / 'lora.safetensors'}' is neither a safetensors file nor a torch state dict")
               for p in found)
    # Checked once the files are (the other problems stop the batch first), a job without weights:
    good = _MAKE["save_random_ifnet"](tmp_path / "ok.safetensors")
    fixed = path.read_text().replace("gone.safetensors", good.name).replace("notes.safetensors", good.name) \
        .replace("lora.safetensors", good.name)
    path.write_text(fixed)
    assert _problems(path) == [f"{path}:18: jobs[3].interpolate: interpolate 2 needs `interpolation_weights`: the "
                               "RIFE IFNet weights file it runs (a path relative to this file)"]
    assert any("jobs[0].interpolate: got 3; allowed: one of 1, 2, 4" in p
               for p in _problems(_batch(tmp_path, "jobs: [{name: x, prompt: x, interpolate: 3}]", "three.yaml")))


def test_the_example_story_batch_validates() -> None:
    jobs = load_batch(Path(__file__).resolve().parents[2] / "jobs" / "story.yaml").jobs
    assert [(j.name, j.segments, video_frames(j)) for j in jobs] == [("lighthouse", 3, 49), ("river", 2, 33)]
