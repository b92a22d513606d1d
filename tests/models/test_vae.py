"""WanVAE against diffusers' AutoencoderKLWan: one random state dict, same outputs, same keys.

CPU fp32 at toy widths (base_dim 16, decoder_base_dim 24; z_dim 48, dim_mult and the rest as
released), 1-3 latent frames of 4x6. Run with ``-s`` to see the printed figures.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import weakref

import pytest
import torch
from diffusers import AutoencoderKLWan

from pan2render.models.vae import WanVAE, WanVAEConfig
from pan2render.vae_plan import UnitKind, decoder_plan

MAX_REL_ERR = 1e-4  # max|ours - ref| / max|ref|, fp32

# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json as released (latent stats are WanVAEConfig's
# defaults, checked against diffusers' convert_wan_to_diffusers.py when they were written down).
RELEASED_KEYS = {
    "_class_name": "AutoencoderKLWan",
    "_diffusers_version": "0.35.0.dev0",
    "attn_scales": [],
    "base_dim": 160,
    "clip_output": False,
    "decoder_base_dim": 256,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "in_channels": 12,
    "is_residual": True,
    "num_res_blocks": 2,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "temperal_downsample": [False, True, True],
    "z_dim": 48,
}

SMALL = WanVAEConfig(base_dim=16, decoder_base_dim=24)


def _diffusers_kwargs(cfg: WanVAEConfig) -> dict:
    # diffusers 0.42.1 has no clip_output argument (it always clamps).
    return {k: v for k, v in cfg.to_dict().items() if k != "clip_output"}


def _random_state_dict(model: torch.nn.Module, *, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor random (not default init): weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2),
    norm gammas ~ 1 + N(0, 0.3^2). At this scale most decoded pixels fall inside the [-1, 1] clamp
    (the comparison sees real values) and some hit it (the clamp is exercised)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, ref in model.state_dict().items():
        noise = torch.randn(ref.shape, generator=g)
        if name.endswith("gamma"):
            sd[name] = 1.0 + 0.3 * noise
        elif name.endswith("bias"):
            sd[name] = 0.1 * noise
        else:
            sd[name] = noise / math.sqrt(ref[0].numel())
    return sd


@pytest.fixture(scope="module")
def models() -> tuple[WanVAE, AutoencoderKLWan]:
    torch.manual_seed(0)
    ref = AutoencoderKLWan(**_diffusers_kwargs(SMALL)).eval()
    sd = _random_state_dict(ref, seed=1234)
    ref.load_state_dict(sd, strict=True)
    ours = WanVAE(SMALL).eval()
    ours.load_state_dict(sd, strict=True)
    return ours, ref


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


# ---- config -----------------------------------------------------------------------------------


def test_defaults_are_the_released_config_and_load_from_its_json() -> None:
    released = dict(RELEASED_KEYS)
    released["latents_mean"] = list(WanVAEConfig().latents_mean)
    released["latents_std"] = list(WanVAEConfig().latents_std)
    cfg = WanVAEConfig.from_dict(json.loads(json.dumps(released)))
    assert cfg == WanVAEConfig()
    assert cfg.to_dict() == {k: v for k, v in released.items() if not k.startswith("_")}
    assert len(cfg.latents_mean) == len(cfg.latents_std) == 48
    assert (cfg.latents_mean[0], cfg.latents_std[0], cfg.latents_std[-1]) == (-0.2289, 0.4765, 0.7744)
    assert cfg.encoder_dims == [160, 160, 320, 640, 640]
    assert cfg.decoder_dims == [1024, 1024, 1024, 512, 256]
    assert [cfg.decoded_frames(t) for t in (1, 2, 31)] == [1, 5, 121]
    assert cfg.latent_frames(121) == 31


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("is_residual", False, "only the Wan2.2 residual VAE"),
        ("attn_scales", [1.0], "only [] is supported"),
        ("patch_size", None, "only 2 is supported"),
        ("patch_size", 1, "only 2 is supported"),
        ("in_channels", 3, "must be 12"),
        ("scale_factor_spatial", 8, "must be 16"),
        ("scale_factor_temporal", 8, "only 4x temporal"),
        ("temperal_downsample", [False, True], "must be 3 booleans"),
        ("latents_mean", [0.0] * 16, "must have z_dim=48"),
        ("base_dim", 0, "positive integer"),
        ("dropout", 1.5, "must be in [0, 1)"),
    ],
)
def test_config_rejects_unsupported_values(key: str, value: object, says: str) -> None:
    d = {**RELEASED_KEYS, key: value}
    with pytest.raises(ValueError) as err:
        WanVAEConfig.from_dict(d)
    msg = str(err.value)
    print(f"{key}={value!r}: {msg}")
    assert f"WanVAEConfig.{key}" in msg and says in msg
    if key != "latents_mean":  # a 16-value list is named by its length instead
        assert repr(value) in msg


def test_config_rejects_unknown_keys_but_ignores_diffusers_private_ones() -> None:
    WanVAEConfig.from_dict({"_class_name": "AutoencoderKLWan", "_name_or_path": "/x"})
    with pytest.raises(ValueError, match="unknown key.*'base_dims'"):
        WanVAEConfig.from_dict({"base_dims": 160})


# ---- weights ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [WanVAEConfig(), SMALL], ids=["released", "small"])
def test_state_dict_keys_and_shapes_equal_diffusers(cfg: WanVAEConfig) -> None:
    with torch.device("meta"):  # the released size without allocating its 705M parameters
        ours = WanVAE(cfg).state_dict()
        ref = AutoencoderKLWan(**_diffusers_kwargs(cfg)).state_dict()
    print(f"{len(ours)} keys, {sum(v.numel() for v in ours.values()) / 1e6:.1f}M parameters")
    assert list(ours) == list(ref)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in ref.items()}


# ---- parity -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("batch", "latent_frames"), [(1, 1), (2, 2), (1, 3)])
def test_decode_matches_diffusers(models, batch: int, latent_frames: int) -> None:
    ours, ref = models
    z = torch.randn(batch, 48, latent_frames, 4, 6, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = ref.decode(z).sample
        got = ours.decode(z)
    err = _rel_err(got, expected)
    inside = (expected.abs() < 1).float().mean().item()
    print(f"decode B={batch} T={latent_frames}: {tuple(got.shape)}, max rel err {err:.2e}, "
          f"{inside:.0%} of pixels inside the clamp")
    assert got.shape == (batch, 3, 1 + 4 * (latent_frames - 1), 64, 96)
    assert got.dtype == z.dtype
    assert err <= MAX_REL_ERR
    assert got.abs().max() <= 1.0
    assert inside > 0.5  # most pixels are compared unclamped
    if latent_frames > 1:
        assert inside < 1.0  # and the clamp is exercised (the first frame alone stays inside)


def test_decode_parity_tolerance_catches_a_small_norm_error(models) -> None:
    """Negative control of the parity tolerance: one decoder norm's gamma 0.1% off (a wrong scale
    in one layer) is already past MAX_REL_ERR."""
    ours, ref = models
    wrong = copy.deepcopy(ours)
    with torch.no_grad():
        wrong.decoder.up_blocks[1].resnets[0].norm2.gamma.mul_(1.001)
    z = torch.randn(1, 48, 2, 4, 6, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = ref.decode(z).sample
        err_ours, err_wrong = _rel_err(ours.decode(z), expected), _rel_err(wrong.decode(z), expected)
    print(f"max rel err: ours {err_ours:.2e}, one gamma 0.1% off {err_wrong:.2e} (tolerance {MAX_REL_ERR:.0e})")
    assert err_ours <= MAX_REL_ERR < err_wrong


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| in bf16 units in the last place (of the larger of the two values)."""
    big = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(2.0**-100)
    ulp = torch.exp2(torch.floor(torch.log2(big)) - 7)  # bf16: 7 explicit mantissa bits
    return ((a.float() - b.float()).abs() / ulp).max().item()


def test_the_decoders_norm_is_the_fast_decoders_op_reference(models) -> None:
    """One reference per op: the decoder's norm + SiLU (``[B, C, T, H, W]``, channels first) is
    `vae_ops.rms_norm_act_reference`, the function the Triton kernel is tested against on
    channels-last rows: in bf16 the two layouts land on the same bf16 value or its neighbour (the
    fp32 sums run in another order). Negative control: diffusers' WanRMS_norm then SiLU, which
    round after each step, are further off."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    from pan2render.kernels import vae_ops

    ours, _ = models
    norm = copy.deepcopy(ours.decoder.up_blocks[0].resnets[0].norm1).to(torch.bfloat16)  # C = 96
    c = norm.gamma.shape[0]
    x = (torch.randn(2, c, 3, 5, 7, generator=torch.Generator().manual_seed(12)) * 3).to(torch.bfloat16)
    theirs = WanRMS_norm(c, images=False).to(torch.bfloat16)
    with torch.no_grad():
        theirs.gamma.copy_(norm.gamma)
        got = norm(x, silu=True)
        rows = vae_ops.rms_norm_act_reference(x.movedim(1, -1).contiguous(), norm.gamma.reshape(-1), silu=True)
        diffusers_rounding = torch.nn.functional.silu(theirs(x))
    ours_ulps, theirs_ulps = _bf16_ulps(got, rows.movedim(-1, 1)), _bf16_ulps(diffusers_rounding, got)
    print(f"bf16 norm + SiLU, C={c}: ours vs the op reference on rows {ours_ulps:g} ulp; "
          f"diffusers' rounding vs ours {theirs_ulps:g} ulp")
    assert ours_ulps <= 1 < theirs_ulps


def test_decode_in_bf16_is_no_further_from_fp32_than_diffusers_in_bf16(models) -> None:
    """The shared op references round once (fp32 math) where diffusers rounds a bf16 norm after
    each step, so in bf16 our decode differs from diffusers' bf16 decode by design. It stays a
    faithful decode: against the fp32 one its error is no larger than diffusers' own bf16 error.
    Negative control: a bf16 decoder with one gamma 5% off is further than diffusers."""
    ours, ref = models
    z = torch.randn(1, 48, 3, 4, 6, generator=torch.Generator().manual_seed(7))
    wrong = copy.deepcopy(ours)
    with torch.no_grad():
        wrong.decoder.up_blocks[1].resnets[0].norm2.gamma.mul_(1.05)
        fp32 = ref.decode(z).sample
        videos = {
            "diffusers bf16": copy.deepcopy(ref).to(torch.bfloat16).decode(z.bfloat16()).sample,
            "ours bf16": copy.deepcopy(ours).to(torch.bfloat16).decode(z.bfloat16()),
            "one gamma 5% off, bf16": wrong.to(torch.bfloat16).decode(z.bfloat16()),
        }
    mse = {name: (v.float() - fp32).pow(2).mean().item() for name, v in videos.items()}
    for name, v in videos.items():
        print(f"{name} vs diffusers fp32: PSNR {10 * math.log10(4 / mse[name]):.2f} dB, "
              f"max rel err {_rel_err(v.float(), fp32):.2e}")
    assert mse["ours bf16"] <= mse["diffusers bf16"] < mse["one gamma 5% off, bf16"]


def test_encode_matches_diffusers_posterior_mean(models) -> None:
    ours, ref = models
    x = torch.rand(1, 3, 9, 64, 96, generator=torch.Generator().manual_seed(8)) * 2 - 1
    with torch.no_grad():
        expected = ref.encode(x).latent_dist.mean
        got = ours.encode(x)
    err = _rel_err(got, expected)
    print(f"encode: {tuple(got.shape)}, max rel err {err:.2e}")
    assert got.shape == (1, 48, 3, 4, 6)
    assert err <= MAX_REL_ERR


def test_encode_rejects_shapes_it_cannot_chunk(models) -> None:
    ours, _ = models
    with pytest.raises(ValueError, match="8 frames: encode needs 1 \\+ 4k frames"):
        ours.encode(torch.zeros(1, 3, 8, 64, 64))
    with pytest.raises(ValueError, match="60x64: encode needs .* multiples of 16"):
        ours.encode(torch.zeros(1, 3, 5, 60, 64))
    with pytest.raises(ValueError, match=r"expected \[B, 48, T>=1, h, w\]"):
        ours.decode(torch.zeros(1, 16, 2, 4, 4))


# ---- output buffer and cache ------------------------------------------------------------------


def _unregistered_tensors(model: torch.nn.Module) -> list[str]:
    """Tensors a module holds outside its parameters and buffers (e.g. a leftover causal cache)."""
    found = []
    for name, m in model.named_modules():
        for attr, value in vars(m).items():
            items = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, torch.Tensor) for v in items):
                found.append(f"{name}.{attr}")
    return found


def test_decode_fills_one_preallocated_video_chunk_by_chunk(models) -> None:
    """Driven through its unit interface (what the split decode uses): each latent frame's frames
    land in place in the one output, later frames untouched, and the result is `decode`'s."""
    ours, _ = models
    z = torch.randn(1, 48, 3, 4, 6, generator=torch.Generator().manual_seed(9))
    spans: list[tuple[int, int]] = []
    with torch.no_grad():
        plain = ours.decode(z)
        as_float64 = ours.decode(z, out_dtype=torch.float64)
        with ours.start_decode(z) as run:
            video = run.new_output(torch.float64).fill_(float("nan"))
            ptr, start = video.data_ptr(), 0
            for t in range(run.latent_frames):
                state = run.latent_input(t)
                for unit in run.plan.units:
                    state = run.run_unit(unit, state, first=t == 0)
                n = run.write(run.settle(state), video, start)
                assert video[:, :, start : start + n].isfinite().all()
                assert video[:, :, start + n :].isnan().all()  # nothing written ahead
                spans.append((start, start + n))
                start += n
    print(f"chunks written: {spans}")
    assert spans == [(0, 1), (1, 5), (5, 9)]
    assert video.data_ptr() == ptr and video.dtype == torch.float64  # one buffer, written in place
    assert torch.equal(video, plain.double()) and torch.equal(as_float64, video)


def test_cache_is_released_after_encode_and_decode(models) -> None:
    ours, _ = models
    with torch.no_grad():
        ours.decode(torch.randn(1, 48, 2, 4, 6))
        ours.encode(torch.zeros(1, 3, 5, 32, 32))
    assert ours._cache is None
    assert _unregistered_tensors(ours) == []


def test_cache_is_released_when_decode_fails(models) -> None:
    ours, _ = models
    z = torch.randn(1, 48, 3, 4, 6, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        expected = ours.decode(z)
    calls, history = [0], []

    def fail_on_second_chunk(module, args, output) -> None:
        calls[0] += 1
        if calls[0] == 2:
            history.extend(weakref.ref(t) for t in ours._cache.tensors())
            raise RuntimeError("injected failure")

    handle = ours.decoder.up_blocks[1].upsampler.register_forward_hook(fail_on_second_chunk)
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match="injected failure") as failure:
            ours.decode(z)
    finally:
        handle.remove()
    gc.collect()
    alive = sum(ref() is not None for ref in history)
    print(f"cache tensors at the failure: {len(history)}, still alive after it: {alive}")
    assert failure.traceback  # the traceback (and the decode's frame) is still held here
    assert len(history) > 0 and alive == 0
    assert ours._cache is None and _unregistered_tensors(ours) == []
    with torch.no_grad():
        assert torch.equal(ours.decode(z), expected)  # nothing stale left behind


# ---- latent statistics ------------------------------------------------------------------------


def test_latent_normalisation_follows_the_diffusers_pipeline(models) -> None:
    ours, _ = models
    cfg = ours.config
    z = torch.randn(1, 48, 2, 3, 3, generator=torch.Generator().manual_seed(11))
    # pipeline_wan.py (before decode) and pipeline_wan_i2v.py (after encode), written out.
    mean = torch.tensor(cfg.latents_mean).view(1, 48, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, 48, 1, 1, 1).to(z.device, z.dtype)
    assert torch.equal(ours.normalize_latents(z), (z - mean) * inv_std)
    assert torch.equal(ours.denormalize_latents(z), z / inv_std + mean)
    round_trip = ours.denormalize_latents(ours.normalize_latents(z))
    err = (round_trip - z).abs().max().item()
    print(f"normalise -> denormalise max abs err {err:.1e}")
    assert err < 1e-5
    # bf16 latents: statistics are cast to the latents' dtype first, as the pipeline does.
    zb = z.bfloat16()
    assert ours.normalize_latents(zb).dtype == torch.bfloat16


# ---- the decoder's plan -------------------------------------------------------------------------


def test_decoder_plan_covers_every_decoder_module_once_in_call_order() -> None:
    """The plan (vae_plan) is the one description of the decoder's structure: its units name every
    residual block, the attention and every upsampler of the module tree exactly once, in the
    order the modules' data flows, for the released config and a smaller one."""
    for cfg in (WanVAEConfig(), WanVAEConfig(dim_mult=(1, 2, 4), temperal_downsample=(True, True),
                                             scale_factor_spatial=8, num_res_blocks=1)):
        with torch.device("meta"):
            dec = WanVAE(cfg).decoder
        plan = decoder_plan(cfg)
        names = [u.name for u in plan.units]
        print(f"dim_mult={cfg.dim_mult}: {len(names)} units: {names}")
        want = ["conv_in", "mid.res0.a", "mid.res0.b", "mid.attn", "mid.res1.a", "mid.res1.b"]
        for i, block in enumerate(dec.up_blocks):
            want += [f"up{i}.res{j}.{h}" for j in range(len(block.resnets)) for h in "ab"]
            want += [f"up{i}.up"] if block.upsampler is not None else []
        assert names == want + ["head"]
        assert len(set(plan.units)) == len(plan.units)
        assert plan.space_factor == cfg.scale_factor_spatial and plan.time_factor == cfg.scale_factor_temporal
        assert [plan.decoded_frames(t) for t in (1, 2, 31)] == [cfg.decoded_frames(t) for t in (1, 2, 31)]
        ups = [u for u in plan.units if u.kind is UnitKind.UPSAMPLE]
        assert [u.block for u in ups] == [i for i, b in enumerate(dec.up_blocks) if b.upsampler is not None]
        # diffusers' config.json (what the fast decoder may be built from) gives the same plan.
        assert decoder_plan(_diffusers_kwargs(cfg)) == plan


def test_decoder_plan_costs_are_the_modules_work() -> None:
    """Each unit's MACs are the multiply-accumulates of the convs it runs (weights x output
    positions, counted from the modules), plus the attention's two matmuls."""
    cfg, (h, w) = WanVAEConfig(), (44, 78)
    with torch.device("meta"):
        dec = WanVAE(cfg).decoder
    plan = decoder_plan(cfg, height=h, width=w)

    def macs(module: torch.nn.Module, positions: int) -> float:
        return float(module.weight.numel()) * positions

    area, frames, want = h * w, 1, []
    want.append(macs(dec.conv_in, area))
    for j, res in enumerate(dec.mid_block.resnets):
        want += [macs(res.conv1, area), macs(res.conv2, area)]
        if j == 0:
            attn = dec.mid_block.attentions[0]
            want.append(macs(attn.to_qkv, area) + macs(attn.proj, area) + 2.0 * area * area * attn.proj.weight.shape[0])
    for block in dec.up_blocks:
        for res in block.resnets:
            shortcut = macs(res.conv_shortcut, area * frames) if isinstance(res.conv_shortcut, torch.nn.Conv3d) else 0
            want += [macs(res.conv1, area * frames) + shortcut, macs(res.conv2, area * frames)]
        if block.upsampler is not None:
            up = 0.0
            if block.upsampler.temporal:
                up, frames = macs(block.upsampler.time_conv, area * frames), frames * 2
            area *= 4
            want.append(up + macs(block.upsampler.resample[1], area * frames))
    want.append(macs(dec.conv_out, area * frames))
    got = [u.macs for u in plan.units]
    print(f"decoder MACs per latent frame at {h}x{w}: {sum(got) / 1e12:.2f} T (modules: {sum(want) / 1e12:.2f} T)")
    assert got == pytest.approx(want, rel=1e-12)
