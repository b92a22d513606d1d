"""The split VAE decode (vae_decode_kernel_parallel) on gloo groups of 2 and 4, the ranks'
agreement on the fast decoder (decided once per pipeline, its reason logged once), and the unit
interface (``vae_plan``) it runs both decoders by."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_helpers import max_rel, run_group
from test_ulysses import tiny_pipeline

from pan2render.kernels import vae_decode
from pan2render.kernels.vae_decode import FastWanDecoder
from pan2render.models.tiny import TINY_VAE_CONFIG
from pan2render.models.vae import WanVAE, WanVAEConfig
from pan2render.parallel import decode as split
from pan2render.parallel import parallelize_pipeline
from pan2render.parallel.group import SequenceGroup
from pan2render.vae_plan import DecodeRun, UnitDecoder, decoder_plan


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


# What a decoder offers the split decode: the members vae_plan's protocols declare, nothing else.
RUN_MEMBERS = frozenset(
    name for name in (*vars(DecodeRun), *DecodeRun.__annotations__) if not name.startswith("_")
)
DECODER_MEMBERS = frozenset(name for name in vars(UnitDecoder) if not name.startswith("_"))


class InterfaceOnly:
    """A decoder seen only through ``vae_plan.UnitDecoder`` / ``DecodeRun``: reaching for anything
    else (a private helper, an attribute of one implementation) raises AttributeError."""

    def __init__(self, decoder: Any, *, hide: str = "") -> None:
        self._decoder, self._hide = decoder, hide

    def start_decode(self, z: torch.Tensor) -> _RunView:
        return _RunView(self._decoder.start_decode(z), self._hide)


class _RunView:
    def __init__(self, run: Any, hide: str) -> None:
        self._run, self._hide = run, hide

    def __getattr__(self, name: str) -> Any:
        if name not in RUN_MEMBERS or name == self._hide:
            raise AttributeError(f"{name!r} is not part of vae_plan.DecodeRun (as offered here)")
        return getattr(self._run, name)

    def __enter__(self) -> _RunView:
        self._run.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._run.__exit__(*exc)


def _decode_worker(rank: int, world: int, out: Path) -> None:
    group = SequenceGroup.of(None)
    vae = tiny_vae()
    video = split.pipelined_decode(vae, raw_latents(), group, fast=False, out_dtype=torch.float32)
    # The fast decoder splits the same way (fp32 on CPU, its Triton kernels interpreted), and the
    # split uses nothing of either decoder but the unit interface.
    fast_decoder = FastWanDecoder.from_vae(vae, device="cpu", dtype=torch.float32)
    fast_video = split.split_decode(InterfaceOnly(fast_decoder), raw_latents(), group, out_dtype=torch.float32)
    reference_video = split.split_decode(InterfaceOnly(vae), raw_latents(), group, out_dtype=torch.float32)

    # Agreement: rank 1 says it cannot run the fast decoder -> every rank falls back, naming rank 1.
    vae_decode.fast_decode_available = lambda device: (rank != 1, "patched: no fast decoder on this rank")
    verdict = split.agree_fast_decode(vae, group, device=torch.device("cpu"))
    vae_decode.fast_decode_available = lambda device: (True, "")
    everyone = split.agree_fast_decode(vae, group, device=torch.device("cpu"))
    torch.save({"video": video, "fast_video": fast_video, "reference_video": reference_video, "verdict": verdict,
                "everyone": everyone}, out / f"rank{rank}.pt")


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
    assert torch.equal(results[0]["reference_video"], video)  # the same decode, seen through the interface

    # Agreement: every rank reaches the same verdict, naming the rank that cannot.
    for r in results:
        ok, reason = r["verdict"]
        assert not ok and "rank(s) [1]" in reason, reason
        assert r["everyone"] == (True, "")
    print(f"agreement: rank 0 says {results[0]['verdict']!r}; rank 1 says {results[1]['verdict']!r}")


LATENTS_SEED = 9


def _pipeline_decode_worker(rank: int, world: int, out: Path) -> None:
    """Decode twice through a parallel pipeline, rank 1 unable to run the fast decoder (rank 0
    able: it builds its fast decoder), counting this rank's own checks and its fallback log lines."""
    checks: list[str] = []

    def rank_1_cannot(device: torch.device) -> tuple[bool, str]:
        checks.append(str(device))
        return (True, "") if rank != 1 else (False, "patched: no Hopper GPU on rank 1")

    vae_decode.fast_decode_available = rank_1_cannot
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    vae_decode.log.addHandler(handler)
    vae_decode.log.setLevel(logging.INFO)
    pipe = parallelize_pipeline(tiny_pipeline(), dist.group.WORLD)
    before = pipe.describe()["decode"]
    latents = torch.randn(48, 3, 6, 10, generator=torch.Generator().manual_seed(LATENTS_SEED))
    frames = pipe.decode(latents)
    again = pipe.decode(latents)
    torch.save({"checks": checks, "log": records, "path": pipe.frame_decoder.path, "before": before,
                "after": pipe.describe()["decode"], "frames": frames, "again": again}, out / f"rank{rank}.pt")


def test_the_group_decides_the_decode_path_once_and_logs_its_reason_once(tmp_path: Path) -> None:
    """A group of 2 whose rank 1 cannot run the fast decoder: on the first decode every rank
    checks itself once and the group agrees on the reference decoder, for a reason naming rank 1
    (rank 1 adds its own); the second decode reuses the verdict (no second check, no second log
    line). The frames (rank 0 only) are the single-process decode's, and the pipeline's description
    says which decoder the split runs once it is known."""
    world = 2
    results = run_group(world, _pipeline_decode_worker, tmp_path)
    verdict = f"rank(s) [1] of {world} cannot run the fast decoder"
    for rank, r in enumerate(results):
        print(f"rank {rank}: {len(r['checks'])} check(s), path {r['path']!r}, log {r['log']}")
        assert len(r["checks"]) == 1, r["checks"]
        assert r["path"].fast is False and r["path"].reason.startswith(verdict), r["path"]
        assert ("patched: no Hopper GPU on rank 1" in r["path"].reason) == (rank == 1)
        assert r["log"] == [f"vae_decode_kernel: the reference decoder runs: {r['path'].reason}"]
        split_by = f"split by layers over {world} ranks"
        assert (r["before"], r["after"]) == (split_by, f"{split_by}, reference decoder ({r['path'].reason})")

    latents = torch.randn(48, 3, 6, 10, generator=torch.Generator().manual_seed(LATENTS_SEED))
    reference = tiny_pipeline().decode(latents)
    diff = (results[0]["frames"].int() - reference.int()).abs()
    print(f"group of {world}: pipe.decode uint8 vs one process: max abs diff {int(diff.max())}")
    assert int(diff.max()) <= 1 and torch.equal(results[0]["frames"], results[0]["again"])
    assert all(r["frames"] is None and r["again"] is None for r in results[1:])


def test_layer_split_is_balanced_at_full_size() -> None:
    """The released decoder at 704x1248 (latent 44x78) cut for 2, 4 and 8 ranks."""
    plan = decoder_plan(WanVAEConfig(), height=44, width=78)
    total = sum(u.cost for u in plan.units)
    print(f"decoder work per latent frame at 704x1248: {2 * sum(u.macs for u in plan.units) / 1e12:.1f} TFLOP")
    for parts in (2, 4, 8):
        bounds = split.split_units(plan.units, parts)
        spans = [sum(u.cost for u in plan.units[a:b]) for a, b in zip(bounds, bounds[1:])]
        worst = max(spans) / (total / parts)
        print(f"{parts} ranks: largest span {worst:.3f}x the even share; cuts after "
              f"{[plan.units[b - 1].name for b in bounds[1:-1]]}")
        assert worst < {2: 1.05, 4: 1.3, 8: 2.0}[parts]  # unit granularity: one resnet


def _members(cls: type, names: frozenset[str]) -> dict[str, Any]:
    """Each member's call signature (parameter names and kinds, self left out), or "attribute"."""
    found = {}
    for name in sorted(names):
        member = inspect.getattr_static(cls, name, None)
        if callable(member):
            params = list(inspect.signature(member).parameters.values())[1:]
            found[name] = [(p.name, p.kind) for p in params]
        else:
            found[name] = "attribute"
    return found


@pytest.mark.parametrize("which", ["reference", "fast"])
def test_both_decoders_implement_the_unit_interface(which: str) -> None:
    """Each decoder offers every member of vae_plan's protocols with the protocol's parameters, so
    renaming one (or changing its call) fails here, not as a silent fallback on a GPU group."""
    vae = tiny_vae()
    decoder = vae if which == "reference" else FastWanDecoder.from_vae(vae, device="cpu", dtype=torch.float32)
    z = raw_latents()
    run = decoder.start_decode(z)
    assert isinstance(decoder, UnitDecoder) and isinstance(run, DecodeRun)
    want = _members(UnitDecoder, DECODER_MEMBERS)
    assert _members(type(decoder), DECODER_MEMBERS) == want
    want_run = {k: v for k, v in _members(DecodeRun, RUN_MEMBERS).items()}
    got_run = _members(type(run), RUN_MEMBERS)
    for name in RUN_MEMBERS:  # attributes are set per run
        if want_run[name] == "attribute":
            assert got_run[name] == "attribute" and hasattr(run, name), name
    assert {k: v for k, v in got_run.items() if v != "attribute"} == {
        k: v for k, v in want_run.items() if v != "attribute"}
    assert run.plan == decoder_plan(vae.config, height=4, width=6) and run.latent_frames == 4


def test_a_decoder_without_the_interface_fails_loudly() -> None:
    """The split decode has no fallback for a decoder that lacks a member of the interface: it
    raises, naming the member (negative control of the interface-only runs above)."""
    vae = tiny_vae()
    solo = SequenceGroup(group=None, rank=0, world_size=1)
    with torch.inference_mode():
        want = vae.decode(raw_latents())
        got = split.split_decode(InterfaceOnly(vae), raw_latents(), solo, out_dtype=torch.float32)
        assert torch.equal(got, want)
        for missing in ("settle", "run_unit", "plan"):
            with pytest.raises(AttributeError, match=missing):
                split.split_decode(InterfaceOnly(vae, hide=missing), raw_latents(), solo, out_dtype=torch.float32)
        assert torch.equal(vae.decode(raw_latents()), want)  # the failed runs released the decoder
