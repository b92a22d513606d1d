"""Text conditioning: transformers' UMT5 encoder and its tokenizer, as Wan2.2 uses them.

A prompt is tokenised to 512 tokens (padded, truncated), encoded, and the embeddings are cut to the
prompt's real length and zero-padded back to 512 — the same as Wan's reference code and diffusers'
WanPipeline, so the DiT sees zeros (not pad-token embeddings) past the prompt.
"""

from __future__ import annotations

import hashlib
import html
import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from .checkpoint import CheckpointError, check_state_dict, read_json, read_state_dict, safetensors_files

log = logging.getLogger(__name__)

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
        """The encoder and tokenizer of a checkpoint root (``text_encoder/``, ``tokenizer/``). On a
        CUDA device the encoder is read by `load_umt5_encoder` (streamed onto the GPU), elsewhere by
        transformers' from_pretrained."""
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
        if torch.device(device).type == "cuda":
            encoder = load_umt5_encoder(enc_dir, device=device, dtype=dtype)
        else:
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


def load_umt5_encoder(folder: str | Path, *, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """transformers' ``UMT5EncoderModel`` from a ``text_encoder/`` folder, read by our own reader.

    The model is built from its config on the meta device (no memory, no random init) and its
    tensors are assigned from `read_state_dict` on ``device`` (streamed onto a GPU), floating ones
    cast to ``dtype`` there: no CPU copy of the 11 GB encoder. The result matches
    ``UMT5EncoderModel.from_pretrained(folder, dtype=dtype).to(device)``:

    - the modules transformers keeps in fp32 stay fp32 (``_keep_in_fp32_modules`` when ``dtype`` is
      fp16, ``_keep_in_fp32_modules_strict`` under fp16 and bf16);
    - tied weights: umT5's ``encoder.embed_tokens`` is its ``shared`` embedding (one tensor under two
      names), and a checkpoint holds it under either name or both. One name fills both; both with
      equal values are tied as one; both with different values are kept apart, as transformers does.

    Unlike from_pretrained, a key the model lacks or a missing key (which from_pretrained would
    initialise at random) is an error: CheckpointError naming the folder, as for our other models.
    """
    from transformers import UMT5Config, UMT5EncoderModel

    folder = Path(folder)
    device = torch.device(device)
    try:
        config = UMT5Config.from_pretrained(str(folder))
        with torch.device("meta"):
            model = UMT5EncoderModel(config)
    except Exception as e:
        raise CheckpointError(f"{folder}: cannot build the UMT5 encoder from its config.json ({e})") from e

    keep_fp32 = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) \
        if dtype in (torch.float16, torch.bfloat16) else set()
    if dtype == torch.float16:
        keep_fp32 |= set(getattr(model, "_keep_in_fp32_modules", None) or ())

    def cast(key: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        return t.to(torch.float32 if keep_fp32.intersection(key.split(".")) else dtype)

    state_dict, origin = read_state_dict(folder, prefix="model", device=device, cast=cast)
    tied = []
    for names in _tied_names(model):
        present = [n for n in names if n in state_dict]
        if not present:
            continue  # reported missing below
        first = state_dict[present[0]]
        if all(torch.equal(state_dict[n], first) for n in present[1:]):
            state_dict.update(dict.fromkeys(names, first))
            tied.append(names)
        else:
            log.warning("%s: tied weights %s hold different values in the checkpoint; kept apart",
                        folder, ", ".join(present))
    check_state_dict(model, state_dict, where=folder, origin=origin)
    model.load_state_dict(state_dict, strict=True, assign=True)
    for names in tied:  # assign=True gave each name its own Parameter: one again, as built
        owner, _, attr = names[0].rpartition(".")
        shared = getattr(model.get_submodule(owner), attr)
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)
    stale = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if stale:
        raise CheckpointError(f"{folder}: the UMT5 encoder has tensors its checkpoint does not fill: "
                              f"{', '.join(stale)}")
    return model.eval().requires_grad_(False)


def _tied_names(model: nn.Module) -> list[list[str]]:
    """The state-dict names that share one tensor in ``model`` as built (tied weights)."""
    by_tensor: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(t), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]
