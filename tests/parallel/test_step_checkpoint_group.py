"""Step checkpoints in a gloo group of 2 (and, as the same code path in fresh processes, of 1):
a stop asked on ONE rank stops every rank at the same boundary with the same state; new processes
given only rank 0's bytes continue to the latents of the group's uninterrupted sampling, bit for
bit. For UniPC and Euler (guided) under Ulysses over the whole group and under the guidance split,
and DMD (unguided: Ulysses over the whole group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_group, tiny_pipeline

from pan2render.models.sampler_state import SamplingPreempted, pack_sampler_state, unpack_sampler_state
from pan2render.parallel import GuidanceSplitDenoiser, UlyssesDenoiser, parallelize_pipeline

SIZE = dict(height=96, width=160, frames=9)  # 45 tokens: a group of 2 pads its last shard
CASES = {
    "unipc-ulysses": (dict(steps=4, guidance=3.0, seed=7, sampler="unipc"), False),
    "unipc-split": (dict(steps=4, guidance=3.0, seed=7, sampler="unipc"), True),
    "euler-ulysses": (dict(steps=4, guidance=2.0, seed=8, sampler="euler"), False),
    "euler-split": (dict(steps=4, guidance=2.0, seed=8, sampler="euler"), True),
    "dmd": (dict(guidance=1.0, seed=9, sampler="dmd", timesteps=[1000, 757, 522, 261]), True),
}
STOPS = (1, 2, 3)  # every boundary of a 4-step sampling
SPEC = "c" * 64


def _embeds() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"prompt_embeds": torch.randn(16, 32, generator=gen),
            "negative_prompt_embeds": torch.randn(16, 32, generator=gen)}


def _pipe(split: bool):
    pipe = parallelize_pipeline(tiny_pipeline(guidance_parallel=split), dist.group.WORLD)
    if dist.get_world_size() == 2:  # the strategy each case is named after
        assert isinstance(pipe.denoiser, GuidanceSplitDenoiser if split else UlyssesDenoiser)
    return pipe


def _interrupt(rank: int, world: int, out: Path) -> None:
    """Uninterrupted latents, then a stop asked on the last rank only at each boundary: every rank
    must stop there. Rank 0 writes each state's bytes; every rank keeps its state's tensors."""
    result: dict[str, object] = {}
    for name, (req, split) in CASES.items():
        pipe = _pipe(split)
        result[f"{name}/full"] = pipe.sample(**_embeds(), **SIZE, **req)
        for k in STOPS:
            polls: list[int] = []

            def should_stop() -> bool:
                polls.append(1)
                return rank == world - 1 and len(polls) == k

            try:
                pipe.sample(**_embeds(), **SIZE, **req, should_stop=should_stop)
            except SamplingPreempted as stopped:
                state = stopped.state
            else:
                raise AssertionError(f"{name}: rank {rank} did not stop at boundary {k}")
            result[f"{name}/{k}/step"] = state.step
            result[f"{name}/{k}/tensors"] = [state.latents, state.generator, *state.sampler.tensors.values()]
            if rank == 0:
                (out / f"{name}-{k}.ckpt").write_bytes(pack_sampler_state(state, spec_hash=SPEC))
    torch.save(result, out / f"rank{rank}.pt")


def _resume(rank: int, world: int, out: Path) -> None:
    """New processes that know only the bytes: every rank resumes from rank 0's checkpoint."""
    result: dict[str, object] = {}
    for name, (req, split) in CASES.items():
        pipe = _pipe(split)
        for k in STOPS:
            data = (out / f"{name}-{k}.ckpt").read_bytes()
            state = unpack_sampler_state(data, spec_hash=SPEC, model_id=pipe.model_id)
            result[f"{name}/{k}"] = pipe.sample(**_embeds(), **SIZE, **req, resume_from=state)
    torch.save(result, out / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_group_stops_together_and_new_processes_resume_bit_equal(world: int, tmp_path: Path) -> None:
    first = tmp_path / "interrupted"
    first.mkdir()
    interrupted = run_group(world, _interrupt, first)
    for name in CASES:
        for k in STOPS:
            assert [r[f"{name}/{k}/step"] for r in interrupted] == [k] * world, f"{name}: ranks stopped apart"
            for r in interrupted[1:]:  # every rank holds the same state: rank 0's bytes serve all
                assert all(torch.equal(a, b) for a, b in zip(r[f"{name}/{k}/tensors"],
                                                             interrupted[0][f"{name}/{k}/tensors"])), name
    resumed = run_group(world, _resume, first)
    for name in CASES:
        full = interrupted[0][f"{name}/full"]
        for k in STOPS:
            diffs = [float((r[f"{name}/{k}"] - full).abs().max()) for r in resumed]
            print(f"group of {world}, {name}, stopped after step {k}: max abs diff per rank vs uninterrupted {diffs}")
            assert all(torch.equal(r[f"{name}/{k}"], full) for r in resumed), f"{name} resumed after {k}"
