"""The split VAE decode (vae_decode_kernel_parallel) on gloo groups of 2 and 4, and the ranks'
agreement on the fast decoder."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pan2render.models.tiny import TINY_VAE_CONFIG
from pan2render.models.vae import WanVAE, WanVAEConfig
from pan2render.parallel import decode as split
from pan2render.parallel import parallelize_pipeline
from pan2render.parallel.group import SequenceGroup

from dist_helpers import max_rel, run_group
from test_ulysses import tiny_pipeline


def tiny_vae() -> WanVAE:
    torch.manual_seed(3)
    vae = WanVAE(WanVAEConfig.from_dict(TINY_VAE_CONFIG)).eval()
    with torch.no_grad():  # non-trivial norms and biases, so every layer matters
        for name, p in vae.named_parameters():
            if name.endswith(("gamma", "bias")):
                p.add_(torch.randn_like(p) * 0.2)
    return vae


def raw_latents() -> torch.Tensor:
    return torch.randn(1, 48, 4, 4, 6, generator=torch.Generator().manual_seed(5))  # 13 frames, 64x96


def _decode_worker(rank: int, world: int, out: Path) -> None:
    group = SequenceGroup.of(None)
    vae = tiny_vae()
    video = split.pipelined_decode(vae, raw_latents(), group, fast=False, out_dtype=torch.float32)
    # The fast decoder's layers split the same way (fp32 on CPU, its Triton kernels interpreted).
    from pan2render.kernels import vae_decode as fast

    fast._DECODERS[vae] = fast.FastWanDecoder.from_vae(vae, device="cpu", dtype=torch.float32)
    fast_video = split.pipelined_decode(vae, raw_latents(), group, fast=True, out_dtype=torch.float32)

    # Agreement: rank 1 says it cannot run the fast decoder -> every rank falls back, naming rank 1.
    def one_rank_cannot(_vae, _device, *, enabled):
        return (rank != 1, "patched: no fast decoder on this rank")

    verdict = split.agree_fast_decode(vae, group, device=torch.device("cpu"), can_run=one_rank_cannot)
    everyone = split.agree_fast_decode(vae, group, device=torch.device("cpu"),
                                       can_run=lambda *_a, **_k: (True, ""))

    # Through the pipeline: rank 0 claims the fast decoder, rank 1 cannot -> all take the reference path.
    split._can_run_fast = lambda *_a, **_k: (rank != 1, "patched: no fast decoder on this rank")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    split.log.addHandler(handler)
    split.log.setLevel(logging.INFO)
    pipe = parallelize_pipeline(tiny_pipeline(), dist.group.WORLD)
    latents = torch.randn(48, 3, 6, 10, generator=torch.Generator().manual_seed(9))
    frames = pipe.decode(latents)
    frames_again = pipe.decode(latents)  # the reason is logged once, not per decode
    torch.save({"video": video, "fast_video": fast_video, "verdict": verdict, "everyone": everyone, "frames": frames,
                "again": frames_again, "log": records}, out / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_split_decode_matches_one_process(world: int, tmp_path: Path) -> None:
    results = run_group(world, _decode_worker, tmp_path)
    with torch.inference_mode():
        want = tiny_vae().decode(raw_latents())  # [1, 3, 13, 64, 96] float32 in [-1, 1]
    video = results[0]["video"]
    err = max_rel(video, want)
    print(f"group of {world}: float decode on rank 0 vs one process: max rel err {err:.2e} "
          f"(max abs {float((video - want).abs().max()):.2e}), shape {tuple(video.shape)}")
    assert video.shape == want.shape and err < 1e-5
    assert all(r["video"] is None for r in results[1:])
    fast_err = max_rel(results[0]["fast_video"], want)
    print(f"group of {world}: split fast decoder (fp32, interpreted) vs one-process reference: "
          f"max rel err {fast_err:.2e}")
    assert fast_err < 1e-5 and all(r["fast_video"] is None for r in results[1:])

    # Agreement: every rank reaches the same verdict, naming the rank that cannot.
    for r in results:
        ok, reason = r["verdict"]
        assert not ok and "rank(s) [1]" in reason, reason
        assert r["everyone"] == (True, "")
    print(f"agreement: rank 0 says {results[0]['verdict']!r}; rank 1 says {results[1]['verdict']!r}")

    # The pipeline's decode on the group took the reference path everywhere, said so once on each
    # rank, and returned uint8 frames on rank 0 only, equal to the single-process decode.
    reference = tiny_pipeline().decode(torch.randn(48, 3, 6, 10, generator=torch.Generator().manual_seed(9)))
    diff = (results[0]["frames"].int() - reference.int()).abs()
    print(f"group of {world}: pipe.decode uint8 vs one process: max abs diff {int(diff.max())}")
    assert int(diff.max()) <= 1 and torch.equal(results[0]["frames"], results[0]["again"])
    for r in results:
        fallbacks = [m for m in r["log"] if "reference decoder" in m]
        assert len(fallbacks) == 1 and "rank(s) [1]" in fallbacks[0], r["log"]
    assert all(r["frames"] is None for r in results[1:])


def test_layer_split_is_balanced_at_full_size() -> None:
    """The released decoder at 704x1248 (latent 44x78) cut for 2, 4 and 8 ranks."""
    with torch.device("meta"):
        vae = WanVAE(WanVAEConfig())
    plan = split.plan_layers(vae, height=44, width=78)
    total = sum(u.cost for u in plan)
    print(f"decoder work per latent frame at 704x1248: {2 * sum(u.macs for u in plan) / 1e12:.1f} TFLOP")
    for parts in (2, 4, 8):
        bounds = split.split_layers(plan, parts)
        spans = [sum(u.cost for u in plan[a:b]) for a, b in zip(bounds, bounds[1:])]
        worst = max(spans) / (total / parts)
        print(f"{parts} ranks: largest span {worst:.3f}x the even share; cuts after "
              f"{[plan[b - 1].name for b in bounds[1:-1]]}")
        assert worst < {2: 1.05, 4: 1.3, 8: 2.0}[parts]  # unit granularity: one resnet


def test_split_needs_the_fast_decoders_units_to_match_its_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split runs FastWanDecoder.run_unit by the names of plan_layers: the local check says
    yes when they match and falls back, saying why, when the decoder's units differ."""
    from pan2render.kernels import vae_decode as fast

    vae = tiny_vae()
    monkeypatch.setattr(fast, "fast_decode_available", lambda device: (True, ""))
    ok, why = split._can_run_fast(vae, torch.device("cpu"), enabled=True)
    assert ok, why
    monkeypatch.setattr(fast.FastWanDecoder, "unit_names", lambda self: ["conv_in", "mid", "head"])
    ok, why = split._can_run_fast(vae, torch.device("cpu"), enabled=True)
    assert not ok and "differ from the split's plan" in why
