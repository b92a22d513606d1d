"""The job schema (``JobSpec``'s field rules) and what is derived from it: job ids, the batch keys
and checks, the sampler's arguments, the README's field table."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest

from pan2render.jobs import load_batch
from pan2render.jobs.spec import (
    ENCODER_FIELDS,
    FIELDS,
    PIXEL_FIELDS,
    RULES,
    SAMPLER_FIELDS,
    JobSpec,
    Kind,
    LoraRef,
    SourceLocation,
    field_table,
)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import field_table as field_table_script

BASE = dict(name="fox", model="tiny", prompt="A red fox trots through fresh snow at dawn.", negative_prompt="blurry",
            image=None, image_sha256=None, seed=3, steps=8, guidance=2.5, height=64, width=64, frames=17, fps=8.0,
            flow_shift=5.0, sampler="unipc", gpus=1, crf=18, preset="tiny-preview", sweep={"seed": 3})


def _another(f: dataclasses.Field[Any], value: Any) -> Any:
    """A value of field ``f`` other than ``value`` that its rule allows (any value for the fields
    the batch resolves itself)."""
    rule = RULES[f.name]
    if rule.kind is Kind.CHOICE:
        return next(c for c in rule.choices if c != value)
    if rule.kind is Kind.TIMESTEPS:
        return (1000, 500) if value != (1000, 500) else (999,)
    if rule.kind is Kind.LORAS:
        return (*value, LoraRef("/loras/style.safetensors", 0.5))
    if rule.kind is Kind.PROMPTS:
        return (*(value or ("a fox wakes",)), "the fox runs")
    if rule.kind is Kind.NAMES:
        return (*value, "harbour")
    if f.name == "lora_digests":
        return (*value, ("0" * 64, 0.5))
    if rule.kind in (Kind.INT, Kind.FLOAT):
        step = rule.step or 1
        return value - step if rule.max is not None and value + step > rule.max else value + step
    if value is None or isinstance(value, str):  # texts, paths, hashes, fingerprints
        return (value or "") + "x"
    raise AssertionError(f"JobSpec.{f.name}: teach _another a value of this kind ({rule.kind}, {value!r})")


def test_each_pixel_field_changes_the_job_id() -> None:
    base = JobSpec(**BASE)
    assert PIXEL_FIELDS, "the schema marks no field as changing the video"
    by_name = {f.name: f for f in FIELDS}
    for f in PIXEL_FIELDS:
        start = base
        when = RULES[f.name].inert_when
        if when is not None and getattr(base, when[0]) == when[1]:  # make the field count first
            start = dataclasses.replace(base, **{when[0]: _another(by_name[when[0]], when[1])})
        changed = dataclasses.replace(start, **{f.name: _another(f, getattr(start, f.name))})
        assert changed.spec_hash != start.spec_hash, f"changing {f.name} left the job id as it was"
        assert changed.job_id != start.job_id, f.name


def test_a_setting_of_a_lane_that_is_off_keeps_the_job_id() -> None:
    """cache_threshold without a cache, guidance_until without guidance: the same render, so the
    same id; with the lane on, the setting counts (negative control)."""
    base = JobSpec(**BASE)
    assert dataclasses.replace(base, cache_threshold=0.2).spec_hash == base.spec_hash
    unguided = dataclasses.replace(base, guidance=1.0)
    assert dataclasses.replace(unguided, guidance_until=0.5).spec_hash == unguided.spec_hash
    cached = dataclasses.replace(base, cache="magcache")
    assert dataclasses.replace(cached, cache_threshold=0.2).spec_hash != cached.spec_hash
    assert dataclasses.replace(base, guidance_until=0.5).spec_hash != base.spec_hash


def test_fields_that_do_not_change_the_video_keep_the_job_id() -> None:
    base = JobSpec(**BASE)
    others = [f for f in FIELDS if not RULES[f.name].pixels and f.name not in ("name", "sweep")]
    assert {f.name for f in others} >= {"gpus", "image", "preset", "source"}
    for f in others:
        value = getattr(base, f.name)
        other = SourceLocation("elsewhere.yaml", 7) if f.name == "source" else _another(f, value)
        changed = dataclasses.replace(base, **{f.name: other})
        assert changed.spec_hash == base.spec_hash, f"changing {f.name} changed the job id"
        assert changed.job_id == base.job_id, f.name
    # The name and the sweep values are the readable part of the id, not its hash.
    renamed = dataclasses.replace(base, name="vixen", sweep={})
    assert renamed.spec_hash == base.spec_hash and renamed.job_id != base.job_id


def test_job_ids_handed_out_before_the_schema_stay_the_same() -> None:
    # Computed by the code before the schema existed: existing output folders must keep matching.
    # Their ledgers hold each job's spec as written then, encode_preset "medium" included (the
    # default then; a job left at today's default, veryfast, is another bitstream, so another id).
    plain = JobSpec(**{**BASE, "encode_preset": "medium"})
    assert plain.spec_hash == "c9478e33d4de42e3ee2487377fc843afe1b18a65b7cbede545c7e30f91467f84"
    assert plain.job_id == "fox-seed3-c9478e33"
    every = JobSpec(**{**BASE, "sampler": "dmd", "guidance": 1.0, "timesteps": (1000, 757, 522), "steps": 3,
                       "weights": "w" * 16, "encode_preset": "fast", "image": "/x/a.png", "image_sha256": "ab" * 32,
                       "gpus": 2, "sweep": {}})
    assert every.spec_hash == "9b9cc2e6ba1ceae8b0b52e5eb34ce746842b88931b18de26b797e643713cd71c"
    # A spec read back from an old ledger: same hash, so its recorded latents still match it.
    assert JobSpec.from_dict(plain.to_dict()).spec_hash == plain.spec_hash
    assert JobSpec(**BASE).spec_hash != plain.spec_hash  # the default, veryfast


def test_a_spec_as_a_dict_is_what_asdict_gives_with_its_source_as_file_and_line() -> None:
    """What the ledger, params.json and a farm's request hold; to_dict builds it without asdict's
    deep copy of every value (most of the cost of recording 20,000 jobs), to the same dict."""
    specs = [JobSpec(**BASE), JobSpec(**{**BASE, "sweep": {"loras": "style@0.5", "seed": 3, "timesteps": (999, 500)},
                                         "source": SourceLocation("b.yaml", 7)})]
    for f in FIELDS:  # every field away from its value, in turn
        if f.name not in ("sweep", "source"):
            specs.append(dataclasses.replace(specs[0], **{f.name: _another(f, getattr(specs[0], f.name))}))
    for spec in specs:
        expected = dataclasses.asdict(spec)
        expected["source"] = None if spec.source is None else {"file": spec.source.file, "line": spec.source.line}
        d = spec.to_dict()
        assert d == expected and list(d) == list(expected)
        assert {k: type(v) for k, v in d.items()} == {k: type(v) for k, v in expected.items()}
        assert JobSpec.from_dict(d) == spec and d["sweep"] is not spec.sweep


def test_the_sampler_gets_exactly_the_fields_its_request_has() -> None:
    from pan2render.lanes import FastLanes
    from pan2render.models.pipeline import PAN2Pipeline, SampleRequest

    names = {f.name for f in SAMPLER_FIELDS}
    request = {f.name for f in dataclasses.fields(SampleRequest)} - {"geometry"}
    lanes = {f.name for f in dataclasses.fields(FastLanes)}
    assert names == request | lanes, "JobSpec's sampler fields and SampleRequest's + FastLanes' fields differ"
    assert names <= set(inspect.signature(PAN2Pipeline.sample).parameters)
    job = JobSpec(**BASE)
    assert job.sample_args() == {k: getattr(job, k) for k in names}
    dmd = dataclasses.replace(job, sampler="dmd", guidance=1.0, steps=3)
    assert dmd.sample_args()["steps"] is None  # the number of timesteps, the job's or the checkpoint's


def test_the_encoder_gets_every_encoder_field_under_a_keyword_it_takes() -> None:
    from pan2render.media.video import encode_mp4

    keywords = {RULES[f.name].to_encoder for f in ENCODER_FIELDS}
    taken = set(inspect.signature(encode_mp4).parameters) - {"frames", "path", "metadata"}
    assert keywords == taken, "encode_mp4's settings and JobSpec's encoder fields differ"
    job = JobSpec(**BASE)
    assert job.encode_args() == {RULES[f.name].to_encoder: getattr(job, f.name) for f in ENCODER_FIELDS}
    assert job.encode_args()["preset"] == job.encode_preset and job.encode_args()["fps"] == job.fps


def test_size_rules_come_from_the_model_configs() -> None:
    from pan2render.models.dit import PAN2DiTConfig
    from pan2render.models.tiny import TINY_DIT_CONFIG, TINY_VAE_CONFIG
    from pan2render.models.vae import WanVAEConfig
    from pan2render.sampling import WAN22, Geometry

    # The batch is checked before any model loads, against WAN22: the geometry of every checkpoint
    # the loader accepts (the released configs' and the tiny model's).
    assert Geometry.of(WanVAEConfig(), PAN2DiTConfig()) == WAN22
    assert Geometry.of(WanVAEConfig.from_dict(TINY_VAE_CONFIG), PAN2DiTConfig.from_dict(TINY_DIT_CONFIG)) == WAN22
    assert WAN22.spatial_multiple == 32 and RULES["height"].step == RULES["width"].step == 32
    assert RULES["frames"].step == 4
    doubled = Geometry(patch=(1, 4, 4))
    assert doubled.spatial_multiple == 64 and doubled.tokens(frames=17, height=128, width=128) == 5 * 2 * 2


def test_a_request_is_checked_against_its_models_geometry() -> None:
    from pan2render.models.pipeline import SampleRequest
    from pan2render.sampling import Geometry

    SampleRequest(height=32, width=32, frames=5, steps=1, guidance=1.0, seed=0)
    with pytest.raises(ValueError, match="height=32: must be a positive multiple of 64"):
        SampleRequest(height=32, width=64, frames=5, steps=1, guidance=1.0, seed=0, geometry=Geometry(patch=(1, 4, 4)))


def test_batch_keys_and_defaults_come_from_the_schema(tmp_path: Path) -> None:
    from pan2render.jobs import coerce, presets, spec

    assert spec.JOB_KEYS[:2] == ("prompt", "name")
    assert set(coerce._CHECKS) == set(spec.JOB_KEYS) | {"description"}
    assert "image" in spec.DEFAULTS_KEYS and "image" not in presets.PRESET_KEYS
    # What a batch gets for a field it sets nowhere; the fields without a default come from the preset.
    assert spec.BUILTIN_DEFAULTS.items() >= {"negative_prompt": "", "image": None, "seed": 0, "gpus": 1}.items()
    assert set(spec.PRESET_REQUIRED) == {"steps", "guidance", "height", "width", "frames", "fps", "flow_shift",
                                          "sampler", "crf"}
    (tmp_path / "b.yaml").write_text("model: tiny\npreset: tiny-preview\njobs:\n  - prompt: a kite\n")
    job = load_batch(tmp_path / "b.yaml").jobs[0]
    assert (job.seed, job.gpus, job.negative_prompt, job.encode_preset) == (0, 1, "", "veryfast")


def test_readme_field_table_is_the_schemas() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert field_table_script.START in readme, "README.md lost its job-fields block"
    assert readme == field_table_script.with_table(readme), (
        "README.md's job-field table differs from the schema's: run python scripts/field_table.py --write")
    for name in RULES:
        if RULES[name].kind is not None:
            assert f"| `{name}` |" in field_table()


def test_encode_tune_is_checked_hashed_and_handed_to_the_encoder(tmp_path: Path) -> None:
    from pan2render.jobs import BatchValidationError

    (tmp_path / "b.yaml").write_text(
        "model: tiny\npreset: tiny-preview\njobs:\n  - prompt: a kite\n  - prompt: a cel-shaded kite\n"
        "    encode_tune: animation\n")
    plain, anim = load_batch(tmp_path / "b.yaml").jobs
    assert (plain.encode_tune, anim.encode_tune) == ("none", "animation")
    assert anim.encode_args()["tune"] == "animation"
    assert dataclasses.replace(anim, encode_tune="none").spec_hash != anim.spec_hash
    (tmp_path / "bad.yaml").write_text("model: tiny\npreset: tiny-preview\njobs:\n  - prompt: a kite\n"
                                       "    encode_tune: cartoon\n")
    with pytest.raises(BatchValidationError) as err:
        load_batch(tmp_path / "bad.yaml")
    assert "bad.yaml:5: jobs[0].encode_tune: " in str(err.value) and "animation" in str(err.value)


def test_checkpoint_every_is_settable_anywhere_checked_and_not_hashed(tmp_path: Path) -> None:
    """Seconds of sampling between step checkpoints: the built-in default, a job's own value and
    --set's (which wins) apply; a negative value names the field and what is allowed; the job id
    does not follow it (a resumed sampling gives the same latents)."""
    from pan2render.jobs import BatchValidationError
    from pan2render.jobs.overrides import Overrides

    (tmp_path / "b.yaml").write_text(
        "model: tiny\npreset: tiny-preview\njobs:\n  - prompt: a kite\n  - prompt: a slow kite\n"
        "    checkpoint_every: 0\n")
    plain, off = load_batch(tmp_path / "b.yaml").jobs
    assert (plain.checkpoint_every, off.checkpoint_every) == (60.0, 0.0)
    assert dataclasses.replace(off, checkpoint_every=60.0).job_id == off.job_id
    by_flag = load_batch(tmp_path / "b.yaml", overrides=Overrides(sets=("checkpoint_every=12.5",))).jobs
    assert [j.checkpoint_every for j in by_flag] == [12.5, 12.5]
    (tmp_path / "bad.yaml").write_text("model: tiny\npreset: tiny-preview\njobs:\n  - prompt: a kite\n"
                                       "    checkpoint_every: -5\n")
    with pytest.raises(BatchValidationError) as err:
        load_batch(tmp_path / "bad.yaml")
    assert "bad.yaml:5: jobs[0].checkpoint_every: " in str(err.value) and ">= 0" in str(err.value)
