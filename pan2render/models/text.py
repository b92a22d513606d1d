"""Text conditioning: transformers' UMT5 encoder and its tokenizer, as Wan2.2 uses them.

A prompt is tokenised to 512 tokens (padded, truncated), encoded, and the embeddings are cut to the
prompt's real length and zero-padded back to 512 — the same as Wan's reference code and diffusers'
WanPipeline, so the DiT sees zeros (not pad-token embeddings) past the prompt.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
from pathlib import Path

import torch

from .checkpoint import CheckpointError, read_json, safetensors_files

MAX_TEXT_TOKENS = 512


def clean_prompt(text: str) -> str:
    """Unescape HTML entities and fold whitespace (Wan's prompt_clean, without ftfy)."""
    text = html.unescape(html.unescape(text))
    return re.sub(r"\s+", " ", text).strip()


class TextEncoder:
    """Prompt -> embeddings ``[512, d_model]`` (float32 on the CPU), zero past the prompt's end."""

    def __init__(self, encoder: torch.nn.Module, tokenizer, *, encoder_id: str,
                 max_tokens: int = MAX_TEXT_TOKENS):
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.encoder_id = encoder_id
        self.max_tokens = max_tokens

    @property
    def device(self) -> torch.device:
        return next(self.encoder.parameters()).device

    @property
    def dim(self) -> int:
        return int(self.encoder.config.d_model)

    @classmethod
    def from_pretrained(cls, root: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "TextEncoder":
        from transformers import AutoTokenizer, UMT5EncoderModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a per-load bar is noise in a render log
        root = Path(root)
        enc_dir, tok_dir = root / "text_encoder", root / "tokenizer"
        for d in (enc_dir, tok_dir):
            if not d.is_dir():
                raise CheckpointError(f"{d}: folder is missing (the text encoder needs text_encoder/ and tokenizer/)")
        config = read_json(enc_dir / "config.json")
        safetensors_files(enc_dir, prefix="model")  # raises a clear error when weights are missing
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
        except Exception as e:
            raise CheckpointError(f"{tok_dir}: cannot load the tokenizer ({e})") from e
        try:
            encoder = UMT5EncoderModel.from_pretrained(str(enc_dir), dtype=dtype, use_safetensors=True)
        except Exception as e:
            raise CheckpointError(f"{enc_dir}: cannot load the UMT5 encoder ({e})") from e
        encoder = encoder.to(device).eval().requires_grad_(False)
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
        for f in sorted(enc_dir.glob("*.safetensors")):
            digest.update(f"{f.name}:{f.stat().st_size}".encode())
        dtype_name = str(dtype).removeprefix("torch.")
        return cls(encoder, tokenizer, encoder_id=f"umt5-{digest.hexdigest()[:12]}-{dtype_name}")

    @torch.no_grad()
    def encode(self, prompts: str | list[str]) -> torch.Tensor:
        """``[B, 512, d_model]`` float32 on the CPU for a list, ``[512, d_model]`` for one prompt."""
        single = isinstance(prompts, str)
        batch = [clean_prompt(p) for p in ([prompts] if single else prompts)]
        tokens = self.tokenizer(
            batch, padding="max_length", max_length=self.max_tokens, truncation=True,
            add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
        )
        ids = tokens.input_ids.to(self.device)
        mask = tokens.attention_mask.to(self.device)
        hidden = self.encoder(ids, mask).last_hidden_state.float()  # [B, 512, D]
        lengths = mask.gt(0).sum(dim=1)
        # Cut to each prompt's real length, zero past it: [B, 512, D].
        keep = torch.arange(self.max_tokens, device=hidden.device)[None, :] < lengths[:, None]
        out = (hidden * keep[..., None]).cpu()
        return out[0] if single else out
