"""The fields of a long video in a batch: ``segments`` and ``prompts`` (a story), checked like every
field (file:line, the field, what is allowed); a batch without them keeps its job ids."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pan2render.jobs import BatchValidationError, load_batch
from pan2render.jobs.overrides import Overrides
from pan2render.long_video import segment_prompts, segment_seed, video_frames

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
