"""The `loras` job field: resolved like `image`, swept whole or by one adapter's scale, hashed by the
files' contents and scales, and every file checked against the model's DiT before anything runs."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pan2render.jobs import load_batch
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import BatchValidationError, JobSpec, LoraRef
from pan2render.lora_plan import dit_linears
from pan2render.tiny_dit import TINY_DIT_CONFIG

LINEARS = dit_linears(TINY_DIT_CONFIG)


def write_lora(path: Path, *, seed: int = 0, width_factor: int = 1, key: str = "blocks.0.self_attn.q") -> Path:
    """A small original-Wan-layout LoRA for the tiny model (``width_factor`` 2: for a model twice as wide)."""
    g = torch.Generator().manual_seed(seed)
    out, inp = LINEARS["blocks.0.attn1.to_q"]
    save_file({f"diffusion_model.{key}.lora_down.weight": torch.randn(4, inp * width_factor, generator=g),
               f"diffusion_model.{key}.lora_up.weight": torch.randn(out * width_factor, 4, generator=g),
               f"diffusion_model.{key}.alpha": torch.tensor(4.0)}, str(path))
    return path


def batch(tmp: Path, body: str) -> Path:
    path = tmp / "batch.yaml"
    path.write_text("model: tiny\npreset: tiny-preview\n" + body)
    return path


def problems(path: Path, **kw: object) -> list[str]:
    with pytest.raises(BatchValidationError) as info:
        load_batch(path, **kw)
    out = [str(p) for p in info.value.problems]
    print("\n".join(out))
    return out


def test_adapters_resolve_against_the_batch_and_hash_by_content(tmp_path: Path) -> None:
    (tmp_path / "loras").mkdir()
    write_lora(tmp_path / "loras" / "style.safetensors", seed=1)
    write_lora(tmp_path / "loras" / "detail.safetensors", seed=2)
    path = batch(tmp_path, "defaults:\n  loras: [loras/style.safetensors]\njobs:\n  - prompt: a fox\n"
                           "  - prompt: a cat\n    loras: [{path: loras/detail.safetensors, scale: 0.5}, "
                           "loras/style.safetensors]\n")
    fox, cat = load_batch(path).jobs
    assert fox.loras == (LoraRef(str(tmp_path / "loras" / "style.safetensors"), 1.0),)
    assert [r.scale for r in cat.loras] == [0.5, 1.0]
    assert [s for _, s in cat.lora_digests] == [0.5, 1.0] and cat.lora_digests[1] == fox.lora_digests[0]
    assert JobSpec.from_dict(cat.to_dict()) == cat  # as the ledger keeps it
    # The same file elsewhere (the path is not hashed): same job; changed in place: a new job.
    moved = tmp_path / "elsewhere"
    os.rename(tmp_path / "loras", moved)
    path.write_text(path.read_text().replace("loras/", "elsewhere/"))
    assert load_batch(path).jobs[0].job_id == fox.job_id
    write_lora(moved / "style.safetensors", seed=3)
    assert load_batch(path).jobs[0].job_id != fox.job_id
    # Without adapters a job keeps the id it had before the field existed.
    plain = dataclasses.replace(fox, loras=(), lora_digests=())
    path.write_text("model: tiny\npreset: tiny-preview\njobs:\n  - prompt: a fox\n")
    assert load_batch(path).jobs[0].job_id == plain.job_id


def test_sweeps_over_one_adapters_scale_and_over_whole_lists(tmp_path: Path) -> None:
    write_lora(tmp_path / "style.safetensors", seed=1)
    write_lora(tmp_path / "detail.safetensors", seed=2)
    path = batch(tmp_path, "defaults:\n  loras: [style.safetensors]\njobs:\n  - prompt: a fox\n"
                           "sweep:\n  loras[0].scale: [0.25, 0.5, 1.0]\n")
    jobs = load_batch(path).jobs
    assert [j.loras[0].scale for j in jobs] == [0.25, 0.5, 1.0]
    assert len({j.job_id for j in jobs}) == 3 and jobs[0].job_id.startswith("a-fox-loras-0-.scale0.25-")
    path = batch(tmp_path, "jobs:\n  - prompt: a fox\nsweep:\n  loras: [[], [style.safetensors], "
                           "[{path: style.safetensors, scale: 0.5}, detail.safetensors]]\n")
    jobs = load_batch(path).jobs
    assert [j.sweep["loras"] for j in jobs] == ["none", "style@1", "style@0.5+detail@1"]
    assert [len(j.loras) for j in jobs] == [0, 1, 2]
    # The same axes from the command line, paths relative to the folder it runs in.
    os.chdir(tmp_path)
    flags = Overrides(sets=("loras=style.safetensors",), sweeps=("loras[0].scale=0.5,2",))
    jobs = load_batch(batch(tmp_path, "jobs:\n  - prompt: a fox\n"), overrides=flags).jobs
    assert [(j.loras[0].path, j.loras[0].scale) for j in jobs] == [(str(tmp_path / "style.safetensors"), 0.5),
                                                                    (str(tmp_path / "style.safetensors"), 2.0)]


def test_bad_adapters_are_refused_with_file_line_field_and_key(tmp_path: Path) -> None:
    torch.save({"x": torch.zeros(1)}, tmp_path / "pickled.safetensors")
    write_lora(tmp_path / "wide.safetensors", width_factor=2)
    write_lora(tmp_path / "deep.safetensors", key="blocks.7.self_attn.q")
    write_lora(tmp_path / "ok.safetensors")
    path = batch(tmp_path, "jobs:\n"  # (line 3: after model and preset)
                           "  - prompt: a fox\n"
                           "    loras: [pickled.safetensors, wide.safetensors]\n"
                           "  - prompt: a cat\n"
                           "    loras: [{path: deep.safetensors}, missing.safetensors]\n"
                           "  - prompt: an owl\n"
                           "    loras: [{path: ok.safetensors, weight: 2}]\n"
                           "  - prompt: a hare\n"
                           "    loras: [{path: ok.safetensors, scale: 500}]\n"
                           "  - prompt: a crow\n"
                           "    loras: [ok.safetensors, ok.safetensors]\n")
    found = problems(path)
    display = str(path)
    assert found[0].startswith(f"{display}:5: jobs[0].loras: LoRA '{tmp_path / 'pickled.safetensors'}'")
    assert "pickle" in found[0]
    assert found[1].startswith(f"{display}:5: jobs[0].loras:") and \
        "'diffusion_model.blocks.0.self_attn.q.lora_down.weight' has shape [4, 192]" in found[1]
    assert found[2].startswith(f"{display}:7: jobs[1].loras:") and \
        "'diffusion_model.blocks.7.self_attn.q." in found[2] and "not in this DiT" in found[2]
    assert found[3].startswith(f"{display}:7: jobs[1].loras:") and "does not exist" in found[3]
    assert found[4].startswith(f"{display}:9: jobs[2].loras: [0]: unknown key 'weight' (did you mean 'scale'?")
    assert found[5].startswith(f"{display}:11: jobs[3].loras: [0]: scale 500 is out of range")
    assert found[6].startswith(f"{display}:13: jobs[4].loras: lists 'ok.safetensors' more than once")
    assert len(found) == 7


def test_a_scale_axis_needs_the_adapter_in_every_job(tmp_path: Path) -> None:
    write_lora(tmp_path / "style.safetensors")
    path = batch(tmp_path, "jobs:\n  - prompt: a fox\n    loras: [style.safetensors]\n  - prompt: a cat\n"
                           "sweep:\n  loras[1].scale: [0.5, 1.0]\n")
    found = problems(path)
    assert len(found) == 2 and all("the sweep varies loras[1].scale but this job has" in p for p in found)
    assert found[0].startswith(f"{path}:5: jobs[0].loras:") and found[1].startswith(f"{path}:6: jobs[1].loras:")
