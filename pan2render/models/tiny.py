"""The embedded ``tiny`` model: a deterministic random-weight PAN2 of the real architecture.

``model: tiny`` must render on a laptop CPU in seconds with no download. It is built once from a
fixed seed, written as a real diffusers-layout checkpoint (model_index.json, transformer/, vae/,
text_encoder/, tokenizer/, scheduler/) in the cache folder, and then loaded through exactly the same
loader as a real checkpoint — so the tiny model exercises the loading path too.

Cache folder: ``$PAN2_RENDER_CACHE`` (default ``~/.cache/pan2-render``), ``models/tiny-v<N>``.
Bump ``TINY_VERSION`` whenever the configs below change.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file, save_model

# (re-exported: the worker and the benchmarks find the cache through here)
from ..cache import cache_root as cache_root

# The DiT's config lives torch-free beside the packages (batch validation checks a job's LoRAs
# against it before any model loads); a change there is a change of TINY_VERSION too.
from ..tiny_dit import TINY_DIT_CONFIG, TINY_VERSION, tiny_folder

TINY_SEED = 20261130

TINY_VAE_CONFIG = {
    "_class_name": "AutoencoderKLWan",
    "base_dim": 8,
    "decoder_base_dim": 8,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 16,
    # Unit statistics: the tiny model's latents need no re-centring.
    "latents_mean": [0.0] * 48,
    "latents_std": [1.0] * 48,
}

TINY_TEXT_CONFIG = {
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 32,
    "dropout_rate": 0.0,
    "feed_forward_proj": "gated-gelu",
}

# Wan2.2's released scheduler settings (flow UniPC), with the shift of the PAN2 presets.
SCHEDULER_CONFIG = {
    "_class_name": "UniPCMultistepScheduler",
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 5.0,
    "solver_order": 2,
    "solver_type": "bh2",
    "predict_x0": True,
    "lower_order_final": True,
    "final_sigmas_type": "zero",
}


# model_index.json of a Wan2.2-TI2V-5B-Diffusers folder (what diffusers' WanPipeline loads).
MODEL_INDEX = {
    "_class_name": "WanPipeline",
    "expand_timesteps": True,
    "boundary_ratio": None,
    "scheduler": ["diffusers", "UniPCMultistepScheduler"],
    "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
    "transformer": ["diffusers", "WanTransformer3DModel"],
    "transformer_2": [None, None],
    "vae": ["diffusers", "AutoencoderKLWan"],
}


# What a complete tiny checkpoint holds; checked before it is published and when it is found.
TINY_FILES = (
    "model_index.json",
    "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
    "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json", "text_encoder/model.safetensors",
    "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
)


def missing_tiny_files(root: Path) -> list[str]:
    return [name for name in TINY_FILES if not (root / name).is_file()]


def tiny_model_folder() -> Path:
    """The tiny model's folder, written on first use (atomically: build aside, check, rename).

    A folder found incomplete (e.g. written by an older version under a library that skipped some
    files) is moved aside and built again rather than failing every job that loads it."""
    final = tiny_folder()
    if (final / "model_index.json").is_file():
        if not missing_tiny_files(final):
            return final
        _move_aside(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tiny-v{TINY_VERSION}-", dir=final.parent))
    try:
        write_tiny_model(staging)
        missing = missing_tiny_files(staging)
        if missing:
            raise RuntimeError(f"writing the tiny checkpoint left out {missing} (in {staging})")
        try:
            os.rename(staging, final)  # atomic; fails if another process won the race
        except OSError:
            if missing_tiny_files(final):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _move_aside(folder: Path) -> None:
    """Rename an incomplete cache folder out of the way and delete it (another process may be
    doing the same: losing that race is fine)."""
    aside = folder.with_name(f".{folder.name}-incomplete-{os.getpid()}")
    try:
        os.rename(folder, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def write_tiny_model(root: Path) -> None:
    """Write the tiny model's folder in the diffusers layout."""
    from .dit import PAN2DiT, PAN2DiTConfig
    from .vae import WanVAE, WanVAEConfig

    root.mkdir(parents=True, exist_ok=True)
    _write_json(root / "model_index.json", {**MODEL_INDEX, "pan2_render_tiny": TINY_VERSION})
    torch.manual_seed(TINY_SEED)
    dit = PAN2DiT(PAN2DiTConfig.from_dict(TINY_DIT_CONFIG))
    _save_component(root / "transformer", TINY_DIT_CONFIG, dit.state_dict())
    vae = WanVAE(WanVAEConfig.from_dict(TINY_VAE_CONFIG))
    _save_component(root / "vae", TINY_VAE_CONFIG, vae.state_dict())
    _write_json(root / "scheduler" / "scheduler_config.json", SCHEDULER_CONFIG)
    _write_text_encoder(root)


def _save_component(folder: Path, config: dict, state_dict: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", config)
    tensors = {k: v.detach().contiguous().clone() for k, v in state_dict.items()}
    save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"))


def build_tokenizer(vocab_size: int | None = None) -> Any:
    """A byte-level tokenizer with no merges (every string has a tokenisation, no files to fetch):
    <pad> = 0, </s> = 1, <unk> = 2, then the 256 byte symbols; ``vocab_size`` pads the vocabulary
    with unused tokens up to a real encoder's size (umT5's 256384)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(f"vocab_size={vocab_size}: the byte-level vocabulary needs {len(vocab)}")
        vocab.update({f"<unused_{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=512)


def _write_text_encoder(root: Path) -> None:
    from transformers import UMT5Config, UMT5EncoderModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in a render log

    fast = build_tokenizer()
    fast.save_pretrained(str(root / "tokenizer"))

    config = UMT5Config(vocab_size=len(fast), pad_token_id=0, eos_token_id=1,
                        decoder_start_token_id=0, is_encoder_decoder=False, use_cache=False,
                        **TINY_TEXT_CONFIG)
    torch.manual_seed(TINY_SEED + 1)
    encoder = UMT5EncoderModel(config).eval()
    # Not encoder.save_pretrained: under an initialised torch.distributed group (the workers of a
    # GPU group load the model after joining it) transformers writes nothing on ranks other than
    # 0, and a rank > 0 that won the publish race left a checkpoint without its text encoder.
    folder = root / "text_encoder"
    folder.mkdir(parents=True, exist_ok=True)
    config.architectures = ["UMT5EncoderModel"]
    config.to_json_file(str(folder / "config.json"))
    save_model(encoder, str(folder / "model.safetensors"), metadata={"format": "pt"})  # tied weights once


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
