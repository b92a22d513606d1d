"""Live previews in a gloo group of 2: rank 0 alone is given the hook (as the worker does), the
other rank samples as before; every rank's latents are the bits of the group's sampling without
previews, and rank 0's previews are the ones one process takes (the group's latents equal one
process's), under Ulysses over the whole group, the guidance split and DMD; rank 0 fits a model's
latent -> RGB map on its own while the other rank goes on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_group, tiny_pipeline

from pan2render.parallel import parallelize_pipeline

SIZE = dict(height=96, width=160, frames=9)  # 45 tokens: a group of 2 pads its last shard
CASES = {
    "unipc-ulysses": (dict(steps=4, guidance=3.0, seed=7, sampler="unipc"), False),
    "unipc-split": (dict(steps=4, guidance=3.0, seed=7, sampler="unipc"), True),
    "dmd": (dict(guidance=1.0, seed=9, sampler="dmd", timesteps=[1000, 757, 522, 261]), True),
}


def _embeds() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"prompt_embeds": torch.randn(16, 32, generator=gen),
            "negative_prompt_embeds": torch.randn(16, 32, generator=gen)}


def _sample(rank: int, world: int, out: Path) -> None:
    result: dict[str, object] = {}
    # A model without a stored map: rank 0 alone fits one on the VAE, as the worker asks for it;
    # were that fit the group's split decode (a collective), rank 0 would hang here.
    os.environ["PAN2_RENDER_CACHE"] = str(out / "cache")
    if rank == 0:
        grouped = parallelize_pipeline(tiny_pipeline(guidance_parallel=True), dist.group.WORLD)
        result["map"] = grouped.preview_map.to_json()
    for name, (req, split) in CASES.items():
        pipe = parallelize_pipeline(tiny_pipeline(guidance_parallel=split), dist.group.WORLD)
        result[f"{name}/off"] = pipe.sample(**_embeds(), **SIZE, **req)
        previews: list = []
        result[f"{name}/on"] = pipe.sample(**_embeds(), **SIZE, **req, preview_every_s=1e-9 if rank == 0 else 0.0,
                                           on_preview=previews.append if rank == 0 else None)
        result[f"{name}/previews"] = [(p.step, p.frames, p.x0) for p in previews]
    torch.save(result, out / f"rank{rank}.pt")


@pytest.mark.slow
def test_rank_0_takes_the_previews_and_no_ranks_latents_change(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, = run_group(1, _sample, tmp_path / "one")
    two = run_group(2, _sample, tmp_path / "two")
    assert two[0]["map"] == one["map"] and "map" not in two[1]  # fitted by rank 0 alone, as one process does
    for name in CASES:
        for r in two:
            assert torch.equal(r[f"{name}/on"], r[f"{name}/off"]), f"{name}: a rank's latents changed"
        assert two[1][f"{name}/previews"] == []  # rank 1 is given no hook: nothing taken there
        mine = two[0][f"{name}/previews"]
        assert [(s, f) for s, f, _ in mine] == [(s, f) for s, f, _ in one[f"{name}/previews"]] == \
            [(s, (0, 1, 2)) for s in (1, 2, 3)]
        assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(mine, one[f"{name}/previews"])), name
