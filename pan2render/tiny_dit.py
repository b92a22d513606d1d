"""The embedded tiny model's name (``model: tiny``), version, folder and DiT config
(``transformer/config.json``), torch-free.

Here rather than in ``pan2render.models.tiny`` because batch validation (``pan2render.jobs``, in a
driver that never imports torch) knows the name, checks a job's LoRAs against the DiT's layers and
looks up the model's MagCache calibration (kept by its model id, which names the folder's version)
before any model loads. ``pan2render.models.tiny`` builds the model from the config into
`tiny_folder`; bump ``TINY_VERSION`` when the config changes.
"""

from __future__ import annotations

from pathlib import Path

from pan2render.cache import cache_root

# What a batch's ``model`` says for the tiny model (instead of a model folder), everywhere it is read.
TINY_MODEL = "tiny"

# The version of the tiny checkpoint's configs and weights: its folder's name and its model id's.
TINY_VERSION = 2
TINY_NAME = f"tiny-v{TINY_VERSION}"


def tiny_folder() -> Path:
    """Where the tiny checkpoint is (or will be) written: ``<cache>/models/tiny-v<N>``."""
    return cache_root() / "models" / TINY_NAME


# Same architecture as Wan2.2-TI2V-5B (48 latent channels, 16x spatial / 4x temporal VAE, patch
# (1,2,2), Q/K RMSNorm across heads, 3-D RoPE), at toy widths.
TINY_DIT_CONFIG = {
    "_class_name": "WanTransformer3DModel",
    "patch_size": [1, 2, 2],
    # 8 heads so sequence-parallel groups of 2, 4 and 8 can split them (Ulysses needs heads % N == 0).
    "num_attention_heads": 8,
    "attention_head_dim": 12,
    "in_channels": 48,
    "out_channels": 48,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 192,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
    "pos_embed_seq_len": None,
}
