"""Text conditioning: Wan2.2's umT5 encoder and its tokenizer, without importing transformers.

A prompt is tokenised to 512 tokens (padded, truncated), encoded, and the embeddings are cut to the
prompt's real length and zero-padded back to 512 — the same as Wan's reference code and diffusers'
WanPipeline, so the DiT sees zeros (not pad-token embeddings) past the prompt.

The encoder is our `umt5.UMT5Encoder` (transformers' ``UMT5EncoderModel`` computed op for op, its
checkpoint keys unchanged) and the tokenizer the `tokenizers` library set up as transformers'
AutoTokenizer sets it up (`tokenizer.load_tokenizer`): transformers took ~10 s to import in a fresh
process, on the critical path of every model load. transformers is imported only where the
tokenizer folder is one we do not reproduce (the reason is logged).
"""

from __future__ import annotations

import hashlib
import html
import json
import re
from pathlib import Path

import torch

from ..model_files import TEXT_ENCODER_DIR, TOKENIZER_DIR
from .loading import ModelFolderError, read_json, safetensors_files
from .tokenizer import PromptTokenizer, Tokenize, TransformersTokenizer, load_tokenizer
from .umt5 import UMT5Config, UMT5Encoder, load_umt5_encoder

__all__ = ["MAX_TEXT_TOKENS", "PromptTokenizer", "TextEncoder", "TransformersTokenizer", "UMT5Config",
           "UMT5Encoder", "clean_prompt", "load_tokenizer", "load_umt5_encoder"]

MAX_TEXT_TOKENS = 512


def clean_prompt(text: str) -> str:
    """Unescape HTML entities and fold whitespace (Wan's prompt_clean, without ftfy)."""
    text = html.unescape(html.unescape(text))
    return re.sub(r"\s+", " ", text).strip()


class TextEncoder:
    """Prompt -> embeddings ``[512, d_model]`` (float32 on the CPU), zero past the prompt's end."""

    def __init__(self, encoder: UMT5Encoder, tokenizer: Tokenize, *, encoder_id: str,
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
        """The encoder and tokenizer of a checkpoint root (``text_encoder/``, ``tokenizer/``). The
        encoder is built on the meta device and read by `load_umt5_encoder` onto ``device`` (streamed
        onto a GPU, tensor by tensor from the memory-mapped file on the CPU); the tokenizer by
        `load_tokenizer`."""
        root = Path(root)
        enc_dir, tok_dir = root / TEXT_ENCODER_DIR, root / TOKENIZER_DIR
        for d in (enc_dir, tok_dir):
            if not d.is_dir():
                raise ModelFolderError(f"{d}: folder is missing (the text encoder needs text_encoder/ and tokenizer/)")
        config = read_json(enc_dir / "config.json")
        safetensors_files(enc_dir, prefix="model")  # raises a clear error when weights are missing
        tokenizer = load_tokenizer(tok_dir)
        encoder = load_umt5_encoder(enc_dir, device=device, dtype=dtype)  # on device, eval, no grad
        # The id keys embeddings cached on disk: config.json's content and the weight files' names
        # and sizes, and the dtype (not which code computes the forward, which does not change it).
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
        ids, mask = self.tokenizer(batch, self.max_tokens)
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.encoder(ids, mask).float()  # [B, 512, D]
        lengths = mask.gt(0).sum(dim=1)
        # Cut to each prompt's real length, zero past it: [B, 512, D].
        keep = torch.arange(self.max_tokens, device=hidden.device)[None, :] < lengths[:, None]
        out = (hidden * keep[..., None]).cpu()
        return out[0] if single else out
