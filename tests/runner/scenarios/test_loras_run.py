"""LoRA jobs through `pan2-render run`: the adapter files travel to the workers once, a sweep over
a scale on one worker renders each job as a fresh pipeline with that scale does, and a job without
adapters after them renders the checkpoint as loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.models import PAN2Pipeline, PAN2PipelineConfig
from pan2render.models.lora import linear_shapes
from pan2render.runner.cli import main as cli

JOB = {"height": 32, "width": 64, "frames": 5, "steps": 2, "guidance": 2.5, "seed": 4}


def _lora(path: Path, pipe: PAN2Pipeline, *, seed: int, rank: int = 2) -> Path:
    """A diffusers-layout LoRA over every self-attention query and key of the tiny DiT."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (out, inp) in linear_shapes(pipe.dit).items():
        if name.endswith(("attn1.to_q", "attn1.to_k")):
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp ** 0.5
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(out, rank, generator=g) / rank ** 0.5
    save_file(sd, str(path))
    return path


def _latents(out: Path, job_id: str) -> torch.Tensor:
    with safe_open(str(out / job_id / "latents.safetensors"), framework="pt") as f:
        return f.get_tensor("latents")


@pytest.mark.slow
def test_a_sweep_over_a_loras_scale_renders_each_job_as_a_fresh_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")  # one in-process worker: every job on it
    monkeypatch.delenv("PAN2_RENDER_PIPELINE", raising=False)  # the tiny model itself
    reference = PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cpu"))
    style = _lora(tmp_path / "style.safetensors", reference, seed=1)
    scales = [0.5, 1.0, -1.0]
    batch = tmp_path / "b.yaml"
    batch.write_text(yaml.safe_dump({"model": "tiny", "preset": "tiny-preview", "defaults": JOB, "jobs": [
        {"name": "styled", "prompt": "a lighthouse", "loras": [{"path": "style.safetensors", "scale": 1.0}]},
    ], "sweep": {"loras[0].scale": scales}}))
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({"model": "tiny", "preset": "tiny-preview", "defaults": JOB,
                                     "jobs": [{"name": "plain", "prompt": "a lighthouse"}]}))
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == 0
    assert cli.main(["run", str(plain), "--out", str(out), "--no-progress", "--add"]) == 0
    capsys.readouterr()

    led = Ledger.open_readonly(out)
    jobs = {(j.spec.loras[0].scale if j.spec.loras else None): j for j in led.jobs()}
    led.close()
    assert sorted(jobs, key=str) == sorted([*scales, None], key=str)
    assert all(j.state is JobState.DONE for j in jobs.values())
    prompt = reference.encode_prompt("a lighthouse")
    negative = reference.encode_prompt(jobs[None].spec.negative_prompt)
    adapter = reference.read_lora(style)
    for scale, job in jobs.items():
        reference.set_loras([] if scale is None else [(adapter, scale)])
        want = reference.sample(prompt_embeds=prompt, negative_prompt_embeds=negative, **job.spec.sample_args())
        got = _latents(out, job.id)
        print(f"scale {scale}: max abs diff vs a fresh render {float((got - want).abs().max()):.2e}")
        assert torch.equal(got, want), scale
    assert len({float(_latents(out, j.id).abs().sum()) for j in jobs.values()}) == len(jobs)  # each its own
