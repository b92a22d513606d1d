"""Our umT5 encoder (pan2render.models.umt5) against transformers' UMT5EncoderModel holding the same
state dict, on the CPU: the tiny checkpoint's and a random one of several layers whose prompts are
longer than max_distance (so the log-spaced position buckets are used), batched with padding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model

from pan2render.models.loading import ModelFolderError
from pan2render.models.tiny import tiny_model_folder
from pan2render.models.umt5 import UMT5Config, load_umt5_encoder, relative_position_buckets

# Per dtype: the largest difference allowed, relative to the reference's largest magnitude.
# fp32 is the bound asked of the port; bf16/fp16 allow about one rounding of the output (2**-7 is
# bf16's epsilon, 2**-10 fp16's). On this CPU build the outputs are in fact bit-identical.
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}

# Several layers; 16 buckets (8 a direction: 4 exact, 4 log-spaced up to 20 tokens), 70 tokens.
RANDOM_CONFIG = {
    "vocab_size": 300, "d_model": 64, "d_kv": 16, "d_ff": 96, "num_layers": 4, "num_heads": 4,
    "relative_attention_num_buckets": 16, "relative_attention_max_distance": 20,
    "layer_norm_epsilon": 1e-6, "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0,
}


def reference(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import UMT5EncoderModel

    return UMT5EncoderModel.from_pretrained(str(folder), dtype=dtype, use_safetensors=True).eval()


def write_random_encoder(folder: Path, config: dict, seed: int = 0) -> Path:
    """A transformers UMT5EncoderModel of ``config`` with random weights, written as a
    ``text_encoder/`` folder. Norm scales and position biases are drawn wider than transformers'
    init (ones, std d_model**-0.5) so that getting either wrong shows in the output."""
    from transformers import UMT5Config as HFConfig
    from transformers import UMT5EncoderModel

    torch.manual_seed(seed)
    hf_config = HFConfig(is_encoder_decoder=False, use_cache=False, **config)
    model = UMT5EncoderModel(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.uniform_(0.5, 1.5)
            elif "relative_attention_bias" in name:
                p.normal_(0.0, 2.0)
    folder.mkdir(parents=True)
    hf_config.architectures = ["UMT5EncoderModel"]
    hf_config.to_json_file(str(folder / "config.json"))
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def prompts(vocab_size: int, length: int, lengths: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, length] and a mask with ones over each prompt's first ``lengths[b]`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (len(lengths), length), generator=gen)
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def compare(folder: Path, dtype: torch.dtype, ids: torch.Tensor, mask: torch.Tensor) -> float:
    ours = load_umt5_encoder(folder, device="cpu", dtype=dtype)
    ref = reference(folder, dtype)
    with torch.no_grad():
        got, want = ours(ids, mask), ref(ids, mask).last_hidden_state
    assert got.shape == want.shape and got.dtype == want.dtype
    err = relative_error(got, want)
    assert err <= BOUNDS[dtype], f"{dtype}: largest difference {err:.3g} of the largest value"
    return err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tiny_encoder_matches_transformers(dtype: torch.dtype) -> None:
    folder = tiny_model_folder() / "text_encoder"
    max_distance = json.loads((folder / "config.json").read_text())["relative_attention_max_distance"]
    ids, mask = prompts(259, 2 * max_distance + 16, (2 * max_distance + 16, max_distance - 5))
    compare(folder, dtype, ids, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_encoder_of_several_layers_matches_transformers(tmp_path: Path, dtype: torch.dtype) -> None:
    folder = write_random_encoder(tmp_path / "text_encoder", RANDOM_CONFIG, seed=1)
    assert 70 > 3 * RANDOM_CONFIG["relative_attention_max_distance"]
    ids, mask = prompts(RANDOM_CONFIG["vocab_size"], 70, (70, 33), seed=2)  # batch of 2, the second padded
    compare(folder, dtype, ids, mask)
    # No mask at all is every token kept.
    ours = load_umt5_encoder(folder, device="cpu", dtype=dtype)
    with torch.no_grad():
        assert torch.equal(ours(ids), ours(ids, torch.ones_like(mask)))


def test_padding_does_not_reach_the_prompt(tmp_path: Path) -> None:
    """A prompt's states are the same alone and padded in a batch (the mask hides the pad keys)."""
    folder = write_random_encoder(tmp_path / "text_encoder", RANDOM_CONFIG, seed=3)
    ours = load_umt5_encoder(folder, device="cpu", dtype=torch.float32)
    ids, mask = prompts(RANDOM_CONFIG["vocab_size"], 64, (64, 25), seed=4)
    with torch.no_grad():
        batched = ours(ids, mask)[1, :25]
        alone = ours(ids[1:, :25])[0]
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 32), (16, 20), (6, 7)])
def test_position_buckets_are_transformers(num_buckets: int, max_distance: int) -> None:
    """Every (query, key) pair of 600 tokens: umT5-XXL's (32, 128), the tiny model's (8, 32) and
    small ones where most distances are past max_distance."""
    from transformers import UMT5Config as HFConfig
    from transformers.models.umt5.modeling_umt5 import UMT5Attention

    hf = UMT5Attention(HFConfig(relative_attention_num_buckets=num_buckets,
                                relative_attention_max_distance=max_distance, d_model=8, d_kv=2, num_heads=2),
                       has_relative_attention_bias=True)
    position = torch.arange(600)
    want = hf._relative_position_bucket(position[None, :] - position[:, None])
    got = relative_position_buckets(600, num_buckets, max_distance)
    assert torch.equal(got, want)
    # Every bucket is used but the one of "after the query, distance 0", which cannot be.
    assert set(got.unique().tolist()) == set(range(num_buckets)) - {num_buckets // 2}


@pytest.mark.parametrize("change, field", [
    ({"feed_forward_proj": "relu"}, "feed_forward_proj"),
    ({"feed_forward_proj": "gated-silu"}, "feed_forward_proj"),
    ({"dense_act_fn": "relu"}, "dense_act_fn"),
    ({"is_gated_act": False}, "is_gated_act"),
    ({"is_decoder": True}, "is_decoder"),
    ({"d_model": "32"}, "d_model"),
    ({"num_heads": 0}, "num_heads"),
    ({"num_layers": 2.0}, "num_layers"),
    ({"vocab_size": True}, "vocab_size"),
    ({"layer_norm_epsilon": "1e-6"}, "layer_norm_epsilon"),
    ({"relative_attention_num_buckets": 2}, "relative_attention_num_buckets"),
    ({"relative_attention_max_distance": 2, "relative_attention_num_buckets": 8}, "relative_attention_max_distance"),
])
def test_a_config_we_cannot_compute_names_the_file_and_field(tmp_path: Path, change: dict, field: str) -> None:
    folder = tmp_path / "text_encoder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**RANDOM_CONFIG, **change}))
    with pytest.raises(ModelFolderError, match=rf"{folder}: cannot build the UMT5 encoder from its config.json "
                                              rf"\({folder / 'config.json'}: field '{field}' "):
        load_umt5_encoder(folder, device="cpu", dtype=torch.float32)


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import UMT5Config as HFConfig

    ours, theirs = UMT5Config.from_dict({}), HFConfig()
    for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "relative_attention_num_buckets",
                 "relative_attention_max_distance", "layer_norm_epsilon", "feed_forward_proj"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_fp16_overflow_is_clamped_as_transformers_does(tmp_path: Path) -> None:
    """First block's attention output scaled past fp16's range: transformers turns the inf into
    max - 1000 (and so do we) instead of letting the next norm make NaN of it."""
    folder = write_random_encoder(tmp_path / "text_encoder", RANDOM_CONFIG, seed=5)
    sd = load_file(str(folder / "model.safetensors"))
    sd["encoder.block.0.layer.0.SelfAttention.v.weight"] *= 100  # large, still finite in fp16
    sd["encoder.block.0.layer.0.SelfAttention.o.weight"] *= 2e4
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ids, mask = prompts(RANDOM_CONFIG["vocab_size"], 40, (40, 21), seed=6)
    ours = load_umt5_encoder(folder, device="cpu", dtype=torch.float16)
    ref = reference(folder, torch.float16)
    with torch.no_grad():
        attn = ours.encoder.block[0].layer[0]
        x = ours.encoder.embed_tokens(ids)
        assert torch.isinf(attn(x, relative_position_buckets(40, 16, 20), mask.bool()[:, None, None, :])).any()
        got, want = ours(ids, mask), ref(ids, mask).last_hidden_state
    assert torch.isfinite(want).all()
    assert relative_error(got, want) <= BOUNDS[torch.float16]
