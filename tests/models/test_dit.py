"""PAN2 DiT vs diffusers' WanTransformer3DModel, both built from one random state dict (CPU fp32).

Relative error here is max|ours - ref| / max|ref| over the whole output.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pan2render.models.dit import ContextCache, PAN2DiT, PAN2DiTConfig
from pan2render.models.dit_ops import TORCH_OPS, DiTOps, attention, modulated_norm, residual_modulated_norm

diffusers = pytest.importorskip("diffusers")
from diffusers import WanTransformer3DModel

MAX_REL_ERR = 1e-4

# 3 heads x 20: RoPE splits 20 as t/h/w = 8/6/6, i.e. t = h + 2 like the real 44/42/42.
TINY = PAN2DiTConfig(num_attention_heads=3, attention_head_dim=20, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)

# Wan2.2-TI2V-5B-Diffusers transformer/config.json.
WAN22_TI2V_5B_CONFIG = {
    "_class_name": "WanTransformer3DModel",
    "_diffusers_version": "0.35.0.dev0",
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 14336,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 48,
    "num_attention_heads": 24,
    "num_layers": 30,
    "out_channels": 48,
    "patch_size": [1, 2, 2],
    "pos_embed_seq_len": None,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}


def _diffusers_kwargs(config: PAN2DiTConfig) -> dict:
    return {k: v for k, v in config.to_dict().items() if not k.startswith("_")}


def _random_state_dict(model: torch.nn.Module, *, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter random: weights ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1^2),
    biases, norm biases and modulation tables ~ N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, t in model.state_dict().items():
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        if t.ndim >= 2 and "scale_shift_table" not in key:
            out[key] = noise / math.sqrt(math.prod(t.shape[1:]))
        elif "norm" in key and key.endswith("weight"):
            out[key] = 1 + 0.1 * noise
        else:
            out[key] = 0.1 * noise
    return out


@pytest.fixture(scope="module")
def models() -> tuple[WanTransformer3DModel, PAN2DiT]:
    ref = WanTransformer3DModel(**_diffusers_kwargs(TINY)).eval()
    ours = PAN2DiT(TINY).eval()
    state = _random_state_dict(ref, seed=0)
    ref.load_state_dict(state, strict=True)
    ours.load_state_dict(state, strict=True)
    return ref, ours


def _inputs(grid: tuple[int, int, int], *, per_token: bool, seed: int = 1):
    """Latents [2, 48, T, h, w], timesteps [2] or [2, L] (first frame's tokens at 0), context."""
    g = torch.Generator().manual_seed(seed)
    frames, h, w = grid
    x = torch.randn(2, TINY.in_channels, frames, h, w, generator=g)
    context = torch.randn(2, 7, TINY.text_dim, generator=g)
    t = torch.tensor([937.5, 412.0])
    if not per_token:
        return x, t, context
    tokens_per_frame = (h // 2) * (w // 2)
    timestep = t[:, None].repeat(1, frames * tokens_per_frame)  # [B, L]
    timestep[:, :tokens_per_frame] = 0.0
    return x, timestep, context


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


# --- config ----------------------------------------------------------------------------------


def test_config_defaults_are_wan22_ti2v_5b() -> None:
    config = PAN2DiTConfig.from_dict(WAN22_TI2V_5B_CONFIG)
    assert config == PAN2DiTConfig()
    assert config.patch_size == (1, 2, 2)
    assert (config.inner_dim, config.rope_split) == (3072, (44, 42, 42))
    to_dict = config.to_dict()
    assert to_dict["_class_name"] == "WanTransformer3DModel"
    assert {k: v for k, v in to_dict.items() if not k.startswith("_")} == {
        k: v for k, v in WAN22_TI2V_5B_CONFIG.items() if not k.startswith("_")
    }


def test_config_round_trips_through_diffusers(models) -> None:
    ref, _ = models
    assert PAN2DiTConfig.from_dict(dict(ref.config)) == TINY


@pytest.mark.parametrize(
    ("key", "value", "supported"),
    [
        ("image_dim", 1280, "must be null"),
        ("added_kv_proj_dim", 5120, "must be null"),
        ("pos_embed_seq_len", 514, "must be null"),
        ("qk_norm", "rms_norm", "rms_norm_across_heads"),
        ("attention_head_dim", 7, "even head dim >= 6"),
        ("num_layers", 0, "positive int"),
        ("patch_size", [1, 2], "3 positive ints"),
        ("eps", -1.0, "positive float"),
        ("window_size", [-1, -1], "supported keys are"),
    ],
)
def test_config_rejects_unsupported_values(key: str, value: object, supported: str) -> None:
    with pytest.raises(ValueError) as err:
        PAN2DiTConfig.from_dict({**WAN22_TI2V_5B_CONFIG, key: value})
    message = str(err.value)
    print(message)
    assert key in message and str(value) in message and supported in message


# --- checkpoint keys ---------------------------------------------------------------------------


@pytest.mark.parametrize("cross_attn_norm", [True, False])
def test_state_dict_keys_equal_diffusers(cross_attn_norm: bool) -> None:
    config = dataclasses.replace(TINY, cross_attn_norm=cross_attn_norm)
    ref = WanTransformer3DModel(**_diffusers_kwargs(config)).state_dict()
    ours = PAN2DiT(config).state_dict()
    print(f"{len(ours)} keys, cross_attn_norm={cross_attn_norm}")
    assert list(ours) == list(ref)  # same names, same order
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in ref.items()}


# --- forward parity ----------------------------------------------------------------------------


@pytest.mark.parametrize("per_token", [False, True], ids=["timestep[B]", "timestep[B,L]"])
@pytest.mark.parametrize("grid", [(2, 4, 4), (3, 4, 6), (1, 6, 2)], ids=lambda g: "x".join(map(str, g)))
def test_forward_matches_diffusers(models, grid: tuple[int, int, int], per_token: bool) -> None:
    ref, ours = models
    x, timestep, context = _inputs(grid, per_token=per_token)
    with torch.no_grad():
        expected = ref(x, timestep, context, return_dict=False)[0]
        got = ours(x, timestep, context)
    err = _rel_err(got, expected)
    print(f"grid {grid} timestep {tuple(timestep.shape)}: max rel err {err:.2e}")
    assert got.shape == expected.shape == x.shape
    assert err <= MAX_REL_ERR


def test_forward_without_cross_attn_norm_matches_diffusers() -> None:
    config = dataclasses.replace(TINY, cross_attn_norm=False)
    ref = WanTransformer3DModel(**_diffusers_kwargs(config)).eval()
    ours = PAN2DiT(config).eval()
    state = _random_state_dict(ref, seed=2)
    ref.load_state_dict(state, strict=True)
    ours.load_state_dict(state, strict=True)
    x, timestep, context = _inputs((3, 4, 6), per_token=True)
    with torch.no_grad():
        err = _rel_err(ours(x, timestep, context), ref(x, timestep, context, return_dict=False)[0])
    print(f"cross_attn_norm=False: max rel err {err:.2e}")
    assert err <= MAX_REL_ERR


KEEP_FP32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")


def _bf16_model_and_diffusers() -> tuple[PAN2DiT, WanTransformer3DModel, dict[str, torch.Tensor]]:
    """Ours and diffusers' in the loader's bf16 layout (KEEP_FP32 modules fp32, diffusers'
    _keep_in_fp32_modules), one random state dict; also returned, that state with every tensor
    fp32 (bf16-exact), for an fp32 reference."""
    ref = WanTransformer3DModel(**_diffusers_kwargs(TINY)).eval()
    ours = PAN2DiT(TINY).eval()
    state = {
        k: v if any(part in k for part in KEEP_FP32) else v.bfloat16()
        for k, v in _random_state_dict(ref, seed=0).items()
    }
    ref.load_state_dict(state, strict=True, assign=True)
    ours.load_state_dict(state, strict=True, assign=True)
    ours.set_ops(TORCH_OPS)
    return ours, ref, {k: v.float() for k, v in state.items()}


def test_bf16_with_fp32_modulation_matches_diffusers() -> None:
    """The checkpoint loader's mixed precision: bf16 weights, fp32 time embedder / modulation
    tables / norms (diffusers' _keep_in_fp32_modules), bf16 activations."""
    ours, ref, _ = _bf16_model_and_diffusers()
    x, timestep, context = _inputs((3, 4, 6), per_token=True)
    with torch.no_grad():
        expected = ref(x.bfloat16(), timestep, context.bfloat16(), return_dict=False)[0]
        got = ours(x.bfloat16(), timestep, context.bfloat16())
    err = _rel_err(got.float(), expected.float())
    print(f"bf16 grid (3, 4, 6) timestep {tuple(timestep.shape)}: max rel err {err:.2e}")
    assert got.dtype == expected.dtype == torch.bfloat16
    assert err <= 1e-2  # bit-equal on CPU here; BLAS may round bf16 differently for U vs B*L rows


# --- numerics: fp32 residual stream, GELU epilogue -----------------------------------------------


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def test_fp32_residual_stream_is_closer_to_fp32_and_none_is_diffusers() -> None:
    """bf16: the fp32 residual stream beats diffusers' per-add bf16 rounding against an fp32
    forward of the same (bf16-exact) weights; residual_dtype None stays diffusers' numerics bit for
    bit (on an H200 at full size: 1.46e-2 -> 3.35e-3, docs/performance.md)."""
    ours, ref, state32 = _bf16_model_and_diffusers()
    full = PAN2DiT(TINY).eval()
    full.load_state_dict(state32, strict=True)
    full.set_ops(TORCH_OPS)
    x, timestep, context = _inputs((2, 4, 4), per_token=True)
    x, context = x.bfloat16(), context.bfloat16()
    with torch.no_grad():
        want = full(x.float(), timestep, context.float())
        diffusers_bf16 = ref(x, timestep, context, return_dict=False)[0]
        default = ours(x, timestep, context)
        ours.set_residual_dtype(torch.float32)
        fp32_stream = ours(x, timestep, context)
        ours.set_residual_dtype(None)
        again = ours(x, timestep, context)
    err_bf16, err_fp32 = _rel_l2(default, want), _rel_l2(fp32_stream, want)
    print(f"rel L2 vs fp32: bf16 stream {err_bf16:.3e}, fp32 stream {err_fp32:.3e}")
    assert fp32_stream.dtype == default.dtype == torch.bfloat16
    assert err_fp32 < 0.85 * err_bf16  # measured 3.6e-3 vs 5.1e-3 (ratio ~1.4 over seeds)
    assert torch.equal(default, diffusers_bf16) and torch.equal(again, default)


def test_residual_dtype_is_a_no_op_in_fp32_and_validated(models) -> None:
    _, ours = models
    x, timestep, context = _inputs((2, 4, 4), per_token=False)
    try:
        with torch.no_grad():
            expected = ours(x, timestep, context)
            ours.set_residual_dtype(torch.float32)
            got = ours(x, timestep, context)
        assert torch.equal(got, expected)
        for bad in ("float32", torch.int32):
            with pytest.raises(ValueError, match="floating-point torch.dtype"):
                ours.set_residual_dtype(bad)  # type: ignore[arg-type]
    finally:
        ours.set_residual_dtype(None)


def test_per_token_timesteps_embed_each_distinct_value_once(models) -> None:
    _, ours = models
    x, timestep, context = _inputs((3, 4, 6), per_token=True)
    time = ours.embed_timesteps(timestep, batch_size=2, num_tokens=timestep.shape[1], dtype=torch.float32)
    # values {0, 412, 937.5}: 3 rows of [6, dim], however many tokens
    print(f"timestep {tuple(timestep.shape)} -> projection {tuple(time.projection.shape)}")
    assert time.projection.shape == (3, 6, TINY.inner_dim)
    assert time.index.shape == timestep.shape
    # A sequence shard (tokens 5..16) sees its own tokens' rows: the output head is per token.
    tokens = torch.randn(2, timestep.shape[1], TINY.inner_dim)
    with torch.no_grad():
        full = ours.head(tokens, time=time)
        shard = ours.head(tokens[:, 5:17], time=time.for_tokens(5, 12))
    assert torch.equal(shard, full[:, 5:17])


def test_context_cache_equals_plain_context(models) -> None:
    _, ours = models
    x, timestep, context = _inputs((3, 4, 6), per_token=True)
    with torch.no_grad():
        cache = ours.prepare_context(context)
        plain = ours(x, timestep, context)
        cached = ours(x, timestep, cache)
    assert isinstance(cache, ContextCache) and len(cache.keys_values) == TINY.num_layers
    assert cache.keys_values[0][0].shape == (2, TINY.num_attention_heads, 7, TINY.attention_head_dim)
    print(f"cache vs plain: max abs diff {(cached - plain).abs().max().item():.2e}")
    torch.testing.assert_close(cached, plain, rtol=0, atol=0)


# --- hooks for the follow-up work (sequence parallelism, fused kernels) ------------------------


def test_rope_matches_diffusers_and_slices(models) -> None:
    ref, ours = models
    grid = (3, 2, 3)
    ref_cos, ref_sin = ref.rope(torch.zeros(1, TINY.in_channels, 3, 4, 6))  # [1, L, 1, D] pairs repeated
    cos, sin = ours.rope(grid)  # [L, D/2]
    assert torch.equal(cos, ref_cos[0, :, 0, 0::2]) and torch.equal(sin, ref_sin[0, :, 0, 1::2])
    part_cos, part_sin = ours.rope(grid, start=5, length=7)  # a sequence shard
    assert torch.equal(part_cos, cos[5:12]) and torch.equal(part_sin, sin[5:12])


def test_self_attention_and_ops_are_swappable(models) -> None:
    _, ours = models
    x, timestep, context = _inputs((2, 4, 4), per_token=False)
    with torch.no_grad():
        expected = ours(x, timestep, context)
    seen: list[tuple[int, ...]] = []
    norms: list[str] = []

    def recording_attention(q, k, v):
        seen.append(tuple(q.shape))
        return attention(q, k, v)

    def recording_norm(x, **kwargs):
        norms.append("norm")
        return modulated_norm(x, **kwargs)

    def recording_residual_norm(x, y, **kwargs):
        norms.append("residual+norm" if kwargs["gate"] is not None else "ungated residual+norm")
        return residual_modulated_norm(x, y, **kwargs)

    try:
        for block in ours.blocks:
            block.attn1.attention_fn = recording_attention
        ours.set_ops(dataclasses.replace(TORCH_OPS, modulated_norm=recording_norm,
                                         residual_modulated_norm=recording_residual_norm))
        with torch.no_grad():
            got = ours(x, timestep, context)
    finally:
        for block in ours.blocks:
            block.attn1.attention_fn = attention
        ours.set_ops(TORCH_OPS)
    assert seen == [(2, TINY.num_attention_heads, 2 * 2 * 2, TINY.attention_head_dim)] * TINY.num_layers
    # Block 0 starts with a plain norm; every later block adds the previous block's gated
    # feed-forward residual in its first norm; each block's cross-attention residual feeds the
    # feed-forward norm; the last block's residual is added alone, then the output norm.
    layers = TINY.num_layers
    assert norms == (["norm", "ungated residual+norm"] + ["residual+norm", "ungated residual+norm"] * (layers - 1)
                     + ["norm"])
    assert isinstance(ours.ops, DiTOps) and torch.equal(got, expected)


# --- input validation --------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors(models) -> None:
    _, ours = models
    x, timestep, context = _inputs((2, 4, 4), per_token=False)
    with pytest.raises(ValueError, match="multiples of patch_size"):
        ours(x[..., :3], timestep, context)
    with pytest.raises(ValueError, match=r"expected \[2\] .* or \[2, 8\]"):
        ours(x, timestep[:, None].repeat(1, 5), context)
    with pytest.raises(ValueError, match="context batch 1 != latent batch 2"):
        ours(x, timestep, context[:1])
    with pytest.raises(ValueError, match=r"expected \[B, S, 32\]"):
        ours(x, timestep, context[..., :16])


def test_self_attention_hands_a_grouping_attention_fn_its_send_layout() -> None:
    """An AttentionOp with ``head_groups`` G and ``accepts_lazy_v`` (Ulysses) gets q, k as
    [G, B, L, H/G, D] and v as a callable giving the same layout; regrouped, the result equals
    the plain call's."""
    from pan2render.models.dit import AttentionOp, SelfAttention

    torch.manual_seed(0)
    layer = SelfAttention(dim=48, num_heads=4, eps=1e-6).eval()
    h = torch.randn(2, 10, 48)
    rope = (torch.rand(10, 6) * 2 - 1, torch.rand(10, 6) * 2 - 1)
    seen: dict[str, object] = {}

    def ungroup(t: torch.Tensor) -> torch.Tensor:  # [G, B, L, H/G, D] -> [B, H, L, D]
        groups, batch, seq, per, dim = t.shape
        return t.permute(1, 2, 0, 3, 4).reshape(batch, seq, groups * per, dim).transpose(1, 2)

    class Grouping(AttentionOp):
        head_groups = 2
        accepts_lazy_v = True

        def __call__(self, q, k, v):
            seen["lazy"] = callable(v)
            v = v()
            seen["shapes"] = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
            seen["contiguous"] = q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
            return attention(ungroup(q), ungroup(k), ungroup(v))

    with torch.no_grad():
        plain = layer(h, rope=rope, ops=TORCH_OPS)
        layer.attention_fn = Grouping()
        got = layer(h, rope=rope, ops=TORCH_OPS)
    assert seen == {"lazy": True, "shapes": ((2, 2, 10, 2, 12),) * 3, "contiguous": True}
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)


def test_attention_ops_declare_their_layout_requests() -> None:
    """The layer reads ``head_groups`` / ``accepts_lazy_v`` from the `AttentionOp` interface only: a
    plain function becomes a `LocalAttention` (one group, v evaluated), and an object that merely
    carries such attributes without being an AttentionOp is not taken at its word."""
    from pan2render.models.dit import AttentionOp, LocalAttention, SelfAttention

    torch.manual_seed(0)
    layer = SelfAttention(dim=48, num_heads=4, eps=1e-6).eval()
    assert layer.attention_fn == LocalAttention(attention)  # the default: the local op
    assert (layer.attention_fn.head_groups, layer.attention_fn.accepts_lazy_v) == (1, False)
    h = torch.randn(2, 10, 48)
    rope = (torch.rand(10, 6) * 2 - 1, torch.rand(10, 6) * 2 - 1)
    seen: list[tuple[bool, tuple[int, ...]]] = []

    class LooksGrouped:  # not an AttentionOp: its attributes are not a request
        head_groups = 2
        accepts_lazy_v = True

        def __call__(self, q, k, v):
            seen.append((callable(v), tuple(q.shape)))
            return attention(q, k, v)

    with torch.no_grad():
        plain = layer(h, rope=rope, ops=TORCH_OPS)
        layer.attention_fn = LooksGrouped()
        assert isinstance(layer.attention_fn, LocalAttention) and isinstance(layer.attention_fn, AttentionOp)
        got = layer(h, rope=rope, ops=TORCH_OPS)
    assert seen == [(False, (2, 4, 10, 12))]
    torch.testing.assert_close(got, plain, rtol=0, atol=0)
    with pytest.raises(TypeError, match="attention_fn must be an AttentionOp or a function"):
        layer.attention_fn = "sdpa"


def test_building_on_the_meta_device_does_not_import_dynamo() -> None:
    """A load builds the DiT on the meta device; random ops there import torch._dynamo (~2 s of
    every load on a GPU host), so the modulation tables are left empty there."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from pan2render.models.dit import PAN2DiT, PAN2DiTConfig\n"
            "from pan2render.models.vae import WanVAE, WanVAEConfig\n"
            "with torch.device('meta'):\n"
            "    PAN2DiT(PAN2DiTConfig(num_layers=2)); WanVAE(WanVAEConfig())\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    # Off the meta device the tables are still drawn as diffusers draws them.
    from pan2render.models.dit import _random_table

    torch.manual_seed(0)
    table = _random_table(1, 6, TINY.inner_dim)
    torch.manual_seed(0)
    assert torch.equal(table, torch.randn(1, 6, TINY.inner_dim) / TINY.inner_dim**0.5)
