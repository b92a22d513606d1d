"""The text encoder's tokenizer, read with the `tokenizers` library (imports in ~0.1 s) as transformers'
``AutoTokenizer`` reads the same ``tokenizer/`` folder (transformers took ~10 s to import).

`load_tokenizer` returns a `PromptTokenizer`: ``tokenizer(prompts, max_length)`` -> ``(ids, mask)``,
``[B, max_length]`` int64 tensors, what ``AutoTokenizer(...)(prompts, padding="max_length",
max_length=max_length, truncation=True, add_special_tokens=True, return_attention_mask=True)`` gives.

How transformers (5.x) reads a folder, and so how we do (tests/models/test_tokenizer.py compares the two):

- ``tokenizer_class`` ``TokenizersBackend`` / ``PreTrainedTokenizerFast`` (the tiny checkpoint's):
  ``tokenizer.json`` as the tokenizers library reads it.
- ``T5Tokenizer`` / ``T5TokenizerFast`` (the released Wan2.2 checkpoints' umT5 tokenizer): transformers
  rebuilds the pipeline around ``tokenizer.json``'s Unigram vocabulary: its normalizer is only the
  SentencePiece ``Precompiled`` map found in the file (other normalizers are dropped), the
  pre-tokenizer is whitespace split + Metaspace (``▁`` prepended to every word), the Unigram model
  has ``unk_id`` 2 and no byte fallback (a character outside the vocabulary is ``<unk>``, even where
  the file asks for byte pieces), and ``$A </s>`` is the template. We make the same changes.
- Either way: the special tokens named in ``tokenizer_config.json`` (or, where it lists no
  ``added_tokens_decoder``, in ``special_tokens_map.json``, which then overrides it) are registered
  as special added tokens (split out of the text before normalisation); pad token, padding and
  truncation side come from there, then from the file's own padding/truncation settings.

Anything else (another tokenizer class, no ``tokenizer.json``, remote code, a special token the
vocabulary lacks, ``add_bos_token``/``add_eos_token`` overrides, ...) is read by transformers'
AutoTokenizer, imported only then, with the reason logged.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from .loading import ModelFolderError, read_json

log = logging.getLogger(__name__)

# tokenizer_class values whose reading we reproduce, and how.
AS_IS_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
T5_CLASSES = ("T5Tokenizer", "T5TokenizerFast")

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES): any other "*_token" key of the
# config is a model-specific special token, registered all the same.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# T5Tokenizer's defaults where its config names none; it also adds <extra_id_0..extra_ids-1>.
T5_DEFAULTS = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
T5_DEFAULT_EXTRA_IDS = 100
# Config keys that make transformers build something we do not reproduce.
UNSUPPORTED_KEYS = ("auto_map", "add_bos_token", "add_eos_token")

ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class Tokenize(Protocol):
    def __call__(self, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class Unsupported(Exception):
    """The folder asks for something `PromptTokenizer` does not reproduce: transformers reads it."""


class PromptTokenizer:
    """A `tokenizers.Tokenizer` set up as transformers sets it up for the same folder."""

    def __init__(self, backend: Any, *, pad_token: str, pad_id: int, padding_side: str = "right",
                 truncation_side: str = "right"):
        self.backend = backend
        self.pad_token = pad_token
        self.pad_id = pad_id
        self.padding_side = padding_side
        self.truncation_side = truncation_side

    def __call__(self, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # What transformers sets on its backend for padding="max_length", truncation=True. The
        # truncation leaves room for the template's special tokens: a long prompt keeps its </s>.
        self.backend.enable_truncation(max_length, stride=0, strategy="longest_first", direction=self.truncation_side)
        self.backend.enable_padding(direction=self.padding_side, pad_id=self.pad_id, pad_type_id=0,
                                    pad_token=self.pad_token, length=max_length, pad_to_multiple_of=None)
        encodings = self.backend.encode_batch(list(prompts), add_special_tokens=True)
        ids = torch.tensor([e.ids for e in encodings], dtype=torch.long)
        mask = torch.tensor([e.attention_mask for e in encodings], dtype=torch.long)
        return ids, mask


class TransformersTokenizer:
    """transformers' AutoTokenizer behind the `PromptTokenizer` call (the fallback)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def __call__(self, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokenizer(
            list(prompts), padding="max_length", max_length=max_length, truncation=True,
            add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
        )
        return tokens.input_ids, tokens.attention_mask


def load_tokenizer(folder: str | Path) -> PromptTokenizer | TransformersTokenizer:
    """The tokenizer of a ``tokenizer/`` folder: ours where we reproduce transformers' reading of it
    (see the module's docstring), else transformers' AutoTokenizer with the reason logged. A folder
    neither can read is a ModelFolderError naming it."""
    folder = Path(folder)
    try:
        return read_tokenizer(folder)
    except Unsupported as e:
        log.warning("%s: read by transformers' AutoTokenizer (slow to import): %s", folder, e)
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        return TransformersTokenizer(AutoTokenizer.from_pretrained(str(folder)))
    except Exception as e:
        raise ModelFolderError(f"{folder}: cannot load the tokenizer ({e})") from e


def read_tokenizer(folder: Path) -> PromptTokenizer:
    """`PromptTokenizer` for ``folder``; Unsupported where transformers would read it otherwise."""
    from tokenizers import Tokenizer

    file = folder / "tokenizer.json"
    if not file.is_file():
        raise Unsupported("no tokenizer.json")
    if (folder / "config.json").is_file():
        raise Unsupported("a config.json beside the tokenizer can change the class AutoTokenizer picks")
    config_file = folder / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    cls = config.get("tokenizer_class")
    if cls not in AS_IS_CLASSES + T5_CLASSES:
        raise Unsupported(f"tokenizer_class {cls!r} is not one of {', '.join(AS_IS_CLASSES + T5_CLASSES)}")
    for key in UNSUPPORTED_KEYS:
        if key in config:
            raise Unsupported(f"tokenizer_config.json sets {key!r}")
    t5 = cls in T5_CLASSES

    try:
        if t5:
            data = json.loads(file.read_text(encoding="utf-8"))
            backend = Tokenizer.from_str(json.dumps(_as_t5_reads_it(data)))
        else:
            backend = Tokenizer.from_file(str(file))
    except Unsupported:
        raise
    except Exception as e:
        raise ModelFolderError(f"{file}: cannot load the tokenizer ({e})") from e

    values = special_values(config, folder, t5=t5)
    added = {str(t.content): (i, t) for i, t in backend.get_added_tokens_decoder().items()}
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        _check_added_tokens(decoder, added, t5=t5)
    _register(backend, _special_tokens(values, config, t5=t5), added)
    if t5:
        backend.post_processor = _t5_template(backend, values)

    pad = _content(values.get("pad_token"))
    padding, truncation = backend.padding, backend.truncation
    if pad is None and padding is not None:
        pad = padding.get("pad_token")
    if pad is None:
        raise ModelFolderError(f"{folder}: the tokenizer has no pad token (tokenizer_config.json, "
                               f"special_tokens_map.json and tokenizer.json name none)")
    pad_id = backend.token_to_id(pad)
    if pad_id is None:
        raise Unsupported(f"pad token {pad!r} is not in the vocabulary")
    padding_side = config.get("padding_side") or (padding or {}).get("direction") or "right"
    truncation_side = config.get("truncation_side") or (truncation or {}).get("direction") or "right"
    for name, side in (("padding_side", padding_side), ("truncation_side", truncation_side)):
        if side not in ("right", "left"):
            raise ModelFolderError(f"{config_file}: {name} {side!r} is neither 'right' nor 'left'")
    if config.get("split_special_tokens"):
        backend.encode_special_tokens = True
    return PromptTokenizer(backend, pad_token=pad, pad_id=pad_id, padding_side=padding_side,
                           truncation_side=truncation_side)


def _as_t5_reads_it(data: dict[str, Any]) -> dict[str, Any]:
    """tokenizer.json's content changed as transformers' T5Tokenizer rebuilds it (module docstring)."""
    from tokenizers import pre_tokenizers

    model = data.get("model") or {}
    if model.get("type") != "Unigram":
        raise Unsupported(f"T5Tokenizer over a {model.get('type')!r} model (it builds a Unigram one)")
    normalizer = data.get("normalizer")
    parts = normalizer.get("normalizers", []) if isinstance(normalizer, dict) and normalizer.get("type") == "Sequence" \
        else [normalizer] if normalizer else []
    precompiled = next((n for n in parts if isinstance(n, dict) and n.get("type") == "Precompiled"
                        and "precompiled_charsmap" in n), None)
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), metaspace])
    return {
        **data,
        "normalizer": precompiled,
        "pre_tokenizer": json.loads(pre_tokenizer.__getstate__()),
        # Set by read_tokenizer once the eos token's id is known.
        "post_processor": None,
        "model": {**model, "unk_id": 2, "byte_fallback": False},
    }


def special_values(config: dict[str, Any], folder: Path, *, t5: bool) -> dict[str, Any]:
    """The special-token settings transformers reads: tokenizer_config.json's, overridden key by key
    by special_tokens_map.json's where the config lists no added_tokens_decoder; T5's defaults
    where neither names one."""
    values = {k: v for k, v in config.items()
              if k in NAMED_SPECIAL_TOKENS or k in ("additional_special_tokens", "extra_special_tokens")
              or (k.endswith("_token") and isinstance(v, (str, dict)))}
    map_file = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and map_file.is_file():
        values.update(read_json(map_file))
    if t5:
        for key, default in T5_DEFAULTS.items():
            if values.get(key) is None:
                values[key] = default
    return values


def _special_tokens(values: dict[str, Any], config: dict[str, Any], *, t5: bool) -> list[dict[str, Any]]:
    """The special tokens transformers registers (``values``: `special_values`), in its order, as
    added-token dicts."""
    names = [k for k in NAMED_SPECIAL_TOKENS if values.get(k) is not None]
    names += [k for k in values if k.endswith("_token") and k not in NAMED_SPECIAL_TOKENS and values[k] is not None]
    tokens = []
    for name in names:
        token = _added_token(values[name], special=True)
        if token is None:
            raise Unsupported(f"{name} {values[name]!r} is not a token")
        tokens.append(token)
    extra = values.get("extra_special_tokens", values.get("additional_special_tokens"))
    if isinstance(extra, dict):
        extra = list(extra.values())
    if t5:
        extra_ids = config.get("extra_ids", T5_DEFAULT_EXTRA_IDS)
        if type(extra_ids) is not int or extra_ids < 0:
            raise Unsupported(f"extra_ids {extra_ids!r} is not a count")
        extra = list(extra or [])
        if not any("<extra_id_" in str(_content(t)) for t in extra):
            extra += [f"<extra_id_{i}>" for i in range(extra_ids)]
    for value in extra or []:
        token = _added_token(value, special=True)
        if token is None:
            raise Unsupported(f"extra special token {value!r} is not a token")
        tokens.append(token)
    return tokens


def _check_added_tokens(decoder: dict[str, Any], added: dict[str, tuple[int, Any]], *, t5: bool) -> None:
    """tokenizer_config.json's added_tokens_decoder must say what tokenizer.json's added tokens say
    (transformers re-adds the config's; for T5 only those): else Unsupported."""
    listed = set()
    for index, entry in decoder.items():
        token = _added_token(entry)
        if token is None:
            raise Unsupported(f"added_tokens_decoder[{index}] is not a token")
        content = token["content"]
        listed.add(content)
        if content not in added:
            raise Unsupported(f"added_tokens_decoder lists {content!r}, tokenizer.json's added tokens do not")
        have_id, have = added[content]
        differ = [flag for flag in ADDED_TOKEN_FLAGS if flag in token and token[flag] != getattr(have, flag)]
        if str(have_id) != str(index) or differ:
            raise Unsupported(f"added token {content!r}: tokenizer_config.json and tokenizer.json disagree on "
                              f"{'its id' if str(have_id) != str(index) else ', '.join(differ)}")
    if t5 and set(added) - listed:
        raise Unsupported(f"tokenizer.json's added tokens {sorted(set(added) - listed)} are not in "
                          f"added_tokens_decoder (T5Tokenizer would drop them)")


def _register(backend: Any, special: list[dict[str, Any]], added: dict[str, tuple[int, Any]]) -> None:
    """Register the special tokens transformers registers, as it does (added tokens matched in the
    raw text, ids from the vocabulary); one neither the vocabulary nor the added tokens know would
    get a new id: Unsupported."""
    from tokenizers import AddedToken

    new: list[dict[str, Any]] = []
    for token in special:
        content = token["content"]
        if content in added or any(t["content"] == content for t in new):
            continue
        if backend.token_to_id(content) is None:
            raise Unsupported(f"special token {content!r} is not in the vocabulary")
        new.append(token)
    if new:
        backend.add_tokens([AddedToken(**t) for t in new])


def _t5_template(backend: Any, values: dict[str, Any]) -> Any:
    """T5Tokenizer's post-processor: ``$A </s>``, the eos token's id under the name ``</s>``."""
    from tokenizers import processors

    eos_id = backend.token_to_id(_content(values.get("eos_token")) or "")
    if eos_id is None:
        raise Unsupported(f"eos token {values.get('eos_token')!r} is not in the vocabulary")
    return processors.TemplateProcessing(single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"],
                                         special_tokens=[("</s>", eos_id)])


def _added_token(value: Any, *, special: bool | None = None) -> dict[str, Any] | None:
    if isinstance(value, str):
        token: dict[str, Any] = {"content": value}
    elif isinstance(value, dict) and isinstance(value.get("content"), str):
        token = {k: value[k] for k in ("content", *ADDED_TOKEN_FLAGS) if k in value}
    else:
        return None
    if special is not None:
        token["special"] = special
    if token.get("special") and "normalized" not in token:
        token["normalized"] = False
    return token


def _content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
