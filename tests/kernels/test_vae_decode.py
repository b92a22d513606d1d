"""The fast Wan2.2 VAE decoder against the reference decoders on a tiny config, and its fallback.

On CPU the whole fast decoder runs in fp32 (cuDNN's part by torch's CPU convs, the Triton kernels
interpreted), so it must match diffusers' fp32 decode to rounding (1e-4 abs on [-1, 1] video):
that checks the causal histories, the first-chunk rules of the temporal upsamplers, the
duplicate-upsample shortcut's channel map and the unpatchify layout.
"""

from __future__ import annotations

import logging
import math
import weakref

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from pan2render.kernels import vae_decode
from pan2render.kernels.vae_decode import FastWanDecoder, fast_decode

TINY = dict(
    base_dim=8, decoder_base_dim=16, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
    temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
    patch_size=2, latents_mean=[0.0] * 4, latents_std=[1.0] * 4, scale_factor_spatial=16,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_vae() -> torch.nn.Module:
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(**TINY).eval()
    with torch.no_grad():  # non-trivial norm scales, so a wrong gamma shows
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.uniform_(0.5, 1.5)
    return vae


@pytest.fixture(scope="module")
def latents_and_reference(tiny_vae: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.randn(1, 4, 4, 3, 5, generator=torch.Generator().manual_seed(1))  # odd h, w
    with torch.no_grad():
        ref = tiny_vae.decode(z).sample  # [1, 3, 13, 48, 80]
    return z, ref


def _max_err(got: torch.Tensor, want: torch.Tensor, name: str) -> float:
    err = (got.float() - want.float()).abs()
    at = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    unclamped = (want.abs() < 0.999).float().mean().item()
    print(f"{name}: max abs err {err.max().item():.3g} at {at}; {unclamped:.1%} of values unclamped")
    return err.max().item()


@pytest.mark.parametrize("phase_gemm", [True, False])
def test_fast_decoder_matches_diffusers_fp32(tiny_vae, latents_and_reference, phase_gemm, monkeypatch) -> None:
    """The phase convs as im2col GEMMs or as cuDNN convs (the tiny frames are below the GEMM
    threshold unless it is 0)."""
    if not phase_gemm:
        monkeypatch.setattr(vae_decode, "PHASE_GEMM_MAX_BYTES", 0)
    z, ref = latents_and_reference
    dec = FastWanDecoder.from_vae(tiny_vae, device="cpu", dtype=torch.float32)
    got = dec.decode(z, out_dtype=torch.float32)
    assert got.shape == ref.shape == (1, 3, 13, 48, 80)
    assert _max_err(got, ref, f"phase_gemm={phase_gemm}") <= 1e-4


def test_phase_conv_gemm_equals_the_conv() -> None:
    """The im2col + GEMM form of the four 2x2 phase kernels against conv2d(padding=1)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 7, 12, generator=g)  # rows [N, H, W, C]
    w = torch.randn(4 * 8, 12, 2, 2, generator=g).contiguous(memory_format=torch.channels_last)
    conv = vae_decode._Conv(w, torch.zeros(32), torch.zeros(32))
    got = vae_decode._phase_conv(x, conv)
    want = torch.nn.functional.conv2d(x.permute(0, 3, 1, 2), w, padding=1).permute(0, 2, 3, 1)
    assert got.shape == want.shape == (2, 6, 8, 32)
    assert _max_err(got, want, "phase conv gemm") <= 1e-5


def test_fast_decoder_uint8_frames_follow_the_pipeline_formula(tiny_vae, latents_and_reference) -> None:
    z, ref = latents_and_reference
    dec = FastWanDecoder.from_vae(tiny_vae, device="cpu", dtype=torch.float32)
    got = dec.decode(z, out_dtype=torch.uint8)
    want = ((ref[0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0)
    assert got.shape == want.shape == (13, 48, 80, 3) and got.dtype == torch.uint8
    diff = (got.int() - want.int()).abs()
    # fp32 rounding differences may flip a value sitting on a .5 boundary by one level, no more.
    print(f"uint8: max diff {diff.max().item()}, {(diff > 0).float().mean().item():.2e} of values differ")
    assert diff.max().item() <= 1 and (diff > 0).float().mean().item() < 1e-3


def test_fast_decoder_from_our_wan_vae_matches(tiny_vae, latents_and_reference) -> None:
    """Built from our WanVAE (same state dict, our config dataclass) it decodes the same video."""
    vae_mod = pytest.importorskip("pan2render.models.vae")
    cfg = vae_mod.WanVAEConfig(**{k: v for k, v in TINY.items()})
    ours = vae_mod.WanVAE(cfg)
    ours.load_state_dict(tiny_vae.state_dict())
    z, ref = latents_and_reference
    got = FastWanDecoder.from_vae(ours, device="cpu", dtype=torch.float32).decode(z, out_dtype=torch.float32)
    assert _max_err(got, ref, "from WanVAE") <= 1e-4


def test_fast_decoder_batch_of_two_decodes_each_video(tiny_vae) -> None:
    z = torch.randn(2, 4, 2, 2, 3, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = tiny_vae.decode(z).sample
    got = FastWanDecoder.from_vae(tiny_vae, device="cpu", dtype=torch.float32).decode(z, out_dtype=torch.float32)
    assert _max_err(got, ref, "batch 2") <= 1e-4
    with pytest.raises(ValueError, match="batch 2"):
        FastWanDecoder.from_vae(tiny_vae, device="cpu", dtype=torch.float32).decode(z, out_dtype=torch.uint8)


def test_bad_latents_are_refused_and_decodes_must_not_overlap(tiny_vae) -> None:
    dec = FastWanDecoder.from_vae(tiny_vae, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"expected \[B, 4"):
        dec.decode(torch.zeros(1, 5, 2, 2, 2))
    z = torch.zeros(1, 4, 2, 2, 2)
    with dec.start_decode(z):
        with pytest.raises(RuntimeError, match="already decoding"):
            dec.decode(z)
    assert dec.decode(z, out_dtype=torch.float32).shape == (1, 3, 5, 32, 32)  # released on leaving the run


def test_fallback_on_cpu_logs_the_reason_once_and_matches_reference(
    tiny_vae, latents_and_reference, caplog, monkeypatch
) -> None:
    z, ref = latents_and_reference
    monkeypatch.setattr(vae_decode, "_FALLBACK_LOGGED", set())
    ok, reason = vae_decode.fast_decode_available(z.device)
    assert not ok and "not a CUDA GPU" in reason
    with caplog.at_level(logging.INFO, logger=vae_decode.__name__):
        frames = fast_decode(tiny_vae, z, out_dtype=torch.uint8)
        video = fast_decode(tiny_vae, z, out_dtype=torch.bfloat16)
    records = [r for r in caplog.records if r.name == vae_decode.__name__]
    print("logged:", [r.getMessage() for r in records])
    assert len(records) == 1 and "not a CUDA GPU" in records[0].getMessage()
    want = ((ref[0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0)
    assert torch.equal(frames, want)
    assert video.dtype == torch.bfloat16 and video.shape == ref.shape


class _Wan21Like:
    """What the builder reads of a VAE (``config``, ``state_dict()``), from a layout it does not
    build: the Wan2.1 VAE (no residual blocks)."""

    def __init__(self, vae: torch.nn.Module) -> None:
        self.config = {**TINY, "is_residual": False}
        self._state = vae.state_dict()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


def test_the_decode_path_says_why_the_fast_decoder_cannot_take_a_vae(tiny_vae, caplog, monkeypatch) -> None:
    """Where the GPU could run the fast decoder (faked here) the one decision still builds it for
    this VAE: a layout it does not build means the reference decoder, the builder's reason given
    and logged once; the Wan2.2 layout builds (the fast path); the switch off needs no check; out
    of memory while building is raised, not taken for a fallback."""
    monkeypatch.setattr(vae_decode, "_FALLBACK_LOGGED", set())
    monkeypatch.setattr(vae_decode, "_DECODERS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(vae_decode, "fast_decode_available", lambda device: (True, ""))
    wan21 = _Wan21Like(tiny_vae)
    with caplog.at_level(logging.INFO, logger=vae_decode.__name__):
        paths = [vae_decode.choose_decode_path(wan21, "cpu") for _ in range(2)]
    records = [r.getMessage() for r in caplog.records if r.name == vae_decode.__name__]
    print("path:", paths[0], "logged:", records)
    assert paths[0] == paths[1] and not paths[0].fast
    assert paths[0].reason == "the fast decoder cannot take this VAE (the fast decoder supports the Wan2.2 VAE " \
                              "only (is_residual=True))"
    assert records == [f"vae_decode_kernel: the reference decoder runs: {paths[0].reason}"]
    assert paths[0].describe() == f"reference decoder ({paths[0].reason})"
    assert vae_decode.choose_decode_path(tiny_vae, "cpu") == vae_decode.DecodePath(True)
    assert vae_decode.choose_decode_path(tiny_vae, "cpu", enabled=False) is vae_decode.SWITCHED_OFF

    def out_of_memory(*args: object, **kwargs: object) -> FastWanDecoder:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (faked)")

    monkeypatch.setattr(vae_decode, "_DECODERS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(FastWanDecoder, "from_vae", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="faked"):
        vae_decode.choose_decode_path(tiny_vae, "cpu")


@pytest.mark.gpu
def test_fast_decode_on_gpu_close_to_fp32_reference(tiny_vae, latents_and_reference) -> None:
    """bf16 fast decode on a Hopper GPU vs the fp32 CPU reference: PSNR well above 40 dB."""
    ok, reason = vae_decode.fast_decode_available("cuda")
    if not ok:
        pytest.skip(reason)
    z, ref = latents_and_reference
    vae = tiny_vae.to("cuda")
    try:
        video = fast_decode(vae, z.cuda(), out_dtype=torch.bfloat16).float().cpu()
    finally:
        tiny_vae.to("cpu")
    mse = (video - ref).pow(2).mean().item()
    db = 10 * math.log10(4 / max(mse, 1e-20))
    print(f"GPU bf16 fast decode vs fp32 reference: PSNR {db:.1f} dB")
    assert video.shape == ref.shape and db > 40


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(vae_decode, "_AVAILABLE", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def test_non_hopper_gpu_is_refused_with_its_architecture(monkeypatch) -> None:
    _fake_gpu(monkeypatch, (8, 0))
    ok, reason = vae_decode.fast_decode_available("cuda:0")
    print("reason:", reason)
    assert not ok and "sm_80" in reason and "Hopper" in reason


def test_failed_kernel_build_is_a_fallback_not_an_error(monkeypatch) -> None:
    _fake_gpu(monkeypatch, (9, 0))

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(vae_decode.vae_ops, "rms_norm_act", broken)
    monkeypatch.setattr(torch, "randn", lambda *a, **k: torch.zeros(37, 96))  # no real GPU here
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(96))
    ok, reason = vae_decode.fast_decode_available("cuda:0")
    print("reason:", reason)
    assert not ok and "failed to build or run" in reason and "ptxas failed" in reason


# ---- the warm-up's decode covers a whole video's shapes ------------------------------------------


def _signature(value: object) -> object:
    """What a call's argument means to a per-shape cache: a tensor's shape, strides (those of
    size-1 dimensions left out, as cuDNN's descriptors leave them) and dtype; scalars as they are."""
    if isinstance(value, torch.Tensor):
        strides = tuple(s if n > 1 else None for n, s in zip(value.shape, value.stride()))
        return ("tensor", tuple(value.shape), strides, value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _signature(v)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


# The ops whose kernel is chosen per shape and cached: convolutions (cuDNN, autotuned in the fast
# decoder), matrix products (cuBLAS) and attention. Elementwise ops and copies pick no algorithm.
_PER_SHAPE = ("conv", "linear", "matmul", "bmm", "mm", "scaled_dot_product")


class _UnitCalls(torch.overrides.TorchFunctionMode):
    """The per-shape ops called while a unit runs, by signature."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[object] = set()
        self.in_unit = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if self.in_unit and any(op in name for op in _PER_SHAPE):
            self.seen.add((name, _signature(args), _signature(kwargs)))
        return func(*args, **kwargs)


def _decode_calls(decoder: object, z: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> set[object]:
    """The calls the units make decoding ``z`` (what cuDNN autotunes and Triton specialises per
    shape: the fast decoder's Triton kernels are recorded with their scalar arguments too)."""
    from pan2render.vae_plan import decode_frames

    calls = _UnitCalls()
    ops = vae_decode.vae_ops

    class _Ops:  # the fast decoder's Triton kernels, recorded with every argument
        def __getattr__(self, name: str) -> object:
            fn = getattr(ops, name)

            def recorded(*args: object, **kwargs: object) -> object:
                if calls.in_unit:
                    calls.seen.add((f"vae_ops.{name}", _signature(args), _signature(kwargs)))
                return fn(*args, **kwargs)

            return recorded

    monkeypatch.setattr(vae_decode, "vae_ops", _Ops())
    run = decoder.start_decode(z)
    real_run_unit = run.run_unit

    def run_unit(unit, state, *, first):
        calls.in_unit = True
        try:
            return real_run_unit(unit, state, first=first)
        finally:
            calls.in_unit = False

    run.run_unit = run_unit
    out = run.new_output(torch.float32)
    with run, calls, torch.no_grad():
        decode_frames(run, out)
    monkeypatch.setattr(vae_decode, "vae_ops", ops)
    return calls.seen


@pytest.mark.parametrize("which", ["fast", "reference"])
def test_a_decode_of_the_shape_covering_frames_runs_every_shape_of_a_longer_one(
        tiny_vae, which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load's warm-up decodes ``SHAPE_COVERING_LATENT_FRAMES`` latent frames, trusting that
    this runs every conv, matrix product and attention on every shape (and the fast decoder's
    Triton kernels with every scalar argument) that a decode of a whole video at that size runs:
    cuDNN's autotuning and Triton's specialisations are per shape, so then the first job's decode
    finds them all done. A change to the plan or the decoders that breaks this fails here."""
    from pan2render.vae_plan import SHAPE_COVERING_LATENT_FRAMES

    vae_mod = pytest.importorskip("pan2render.models.vae")
    if which == "fast":
        decoder = FastWanDecoder.from_vae(tiny_vae, device="cpu", dtype=torch.float32)
    else:
        decoder = vae_mod.WanVAE(vae_mod.WanVAEConfig(**TINY))
        decoder.load_state_dict(tiny_vae.state_dict())
    g = torch.Generator().manual_seed(4)

    def calls(latent_frames: int) -> set[object]:
        return _decode_calls(decoder, torch.randn(1, 4, latent_frames, 3, 5, generator=g), monkeypatch)

    covering, longer = calls(SHAPE_COVERING_LATENT_FRAMES), calls(5)
    print(f"{which}: {len(covering)} distinct calls in a {SHAPE_COVERING_LATENT_FRAMES}-frame decode, "
          f"{len(longer)} in a 5-frame one")
    assert covering == longer, sorted(map(str, covering ^ longer))[:5]
    assert calls(1) < covering  # the frames after the first run shapes of their own: not vacuous
