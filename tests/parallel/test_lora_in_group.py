"""LoRA adapters in a group of 2 (gloo): merged into the plain model the parallel strategies share,
so the guidance split (guided steps) and Ulysses (unguided steps) render what one process renders
with the same adapters, and a switch between jobs applies on every rank."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from dist_helpers import max_rel, run_group
from safetensors.torch import save_file
from test_ulysses import T2V, inputs, tiny_pipeline

from pan2render.models.lora import linear_shapes
from pan2render.parallel import GuidanceSplitDenoiser, parallelize_pipeline

JOBS = {"guided": T2V, "unguided": {**T2V, "guidance": 1.0}}


def write_lora(path: Path, *, seed: int) -> Path:
    """A musubi-tuner-style LoRA over every attention and feed-forward linear of the tiny DiT."""
    shapes = linear_shapes(tiny_pipeline().dit)
    g = torch.Generator().manual_seed(seed)
    names = {"attn1.to_q": "self_attn_q", "attn2.to_v": "cross_attn_v", "ffn.net.0.proj": "ffn_0", "ffn.net.2": "ffn_2"}
    tensors = {}
    for i in range(2):
        for ours, theirs in names.items():
            out, inp = shapes[f"blocks.{i}.{ours}"]
            key = f"lora_unet_blocks_{i}_{theirs}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(4, inp, generator=g) / inp ** 0.5
            tensors[f"{key}.lora_up.weight"] = torch.randn(out, 4, generator=g)
            tensors[f"{key}.alpha"] = torch.tensor(2.0)
    save_file(tensors, str(path))
    return path


def render(pipe, lora_paths: list[Path]) -> dict[str, torch.Tensor]:
    """Every job with adapter A at 0.8, then A at -0.5 with B at 1.5, then none (one pipeline)."""
    embeds = {k: v for k, v in inputs().items() if k != "image"}
    a, b = (pipe.read_lora(p) for p in lora_paths)
    out = {}
    for label, adapters in (("a", [(a, 0.8)]), ("ab", [(a, -0.5), (b, 1.5)]), ("none", [])):
        pipe.set_loras(adapters)
        for job, args in JOBS.items():
            out[f"{label}/{job}"] = pipe.sample(**embeds, **args)
    return out


def _worker(rank: int, world: int, out: Path, lora_paths: list[Path]) -> None:
    pipe = parallelize_pipeline(tiny_pipeline(), dist.group.WORLD)
    assert isinstance(pipe.denoiser, GuidanceSplitDenoiser)
    torch.save(render(pipe, lora_paths), out / f"rank{rank}.pt")


def test_adapters_in_a_group_of_2_match_one_process(tmp_path: Path) -> None:
    paths = [write_lora(tmp_path / "a.safetensors", seed=1), write_lora(tmp_path / "b.safetensors", seed=2)]
    reference = render(tiny_pipeline(), paths)
    results = run_group(2, _worker, tmp_path, paths)
    for key, want in reference.items():
        errs = [max_rel(r[key], want) for r in results]
        print(f"{key}: max rel err per rank vs one process {['%.2e' % e for e in errs]}")
        assert max(errs) < 1e-5
        assert torch.equal(results[0][key], results[1][key])
    for job in JOBS:  # the adapters change the render (else the comparison above proves nothing)
        assert max_rel(reference[f"a/{job}"], reference[f"none/{job}"]) > 1e-2
        assert max_rel(reference[f"ab/{job}"], reference[f"a/{job}"]) > 1e-2
