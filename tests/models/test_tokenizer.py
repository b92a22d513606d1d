"""The text encoder's tokenizer (pan2render.models.tokenizer) against transformers' AutoTokenizer on
the same folder: ids and attention masks as TextEncoder.encode asks for them (padded to 512,
truncated, special tokens added), for the tiny checkpoint's tokenizer and for T5-like Unigram ones
built here; and the folders it leaves to transformers."""

from __future__ import annotations

import base64
import json
import logging
import struct
from pathlib import Path

import pytest
import torch

from pan2render.models.loading import ModelFolderError
from pan2render.models.tiny import tiny_model_folder
from pan2render.models.tokenizer import PromptTokenizer, TransformersTokenizer, load_tokenizer

MAX = 512
PROMPTS = [
    "a fox in the snow",
    "A FOX IN THE SNOW AT DAWN",  # "A" is in the T5-like tokenizer's normalisation map
    "the fox 🦊 and the ｆｏｘ, é",  # characters outside the T5-like vocabulary
    "x </s> y <extra_id_1> <pad>z",  # special tokens written in a prompt
    "  spaced   out  \t words ",
    "",
    " ".join(["snow"] * 700),  # longer than 512 tokens: truncated
    "the fox " * 300 + "at dawn",
]

WORDS = ["▁a", "▁fox", "▁in", "▁the", "▁snow", "▁at", "▁dawn", "▁and", "▁x", "▁y", "▁spaced", "▁out",
         "▁words", "▁sno", "w", "▁", ",", "é"]


def reference(folder: Path, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    out = tok(prompts, padding="max_length", max_length=MAX, truncation=True, add_special_tokens=True,
              return_attention_mask=True, return_tensors="pt")
    return out.input_ids, out.attention_mask


def assert_as_transformers(folder: Path, prompts: list[str] = PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer = load_tokenizer(folder)
    assert isinstance(tokenizer, PromptTokenizer), "read without transformers"
    ids, mask = tokenizer(prompts, MAX)
    want_ids, want_mask = reference(folder, prompts)
    assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape == (len(prompts), MAX)
    for i, prompt in enumerate(prompts):
        assert ids[i].tolist() == want_ids[i].tolist(), prompt[:60]
        assert mask[i].tolist() == want_mask[i].tolist(), prompt[:60]
    return ids, mask


def charsmap(mapping: dict[str, str]) -> bytes:
    """A SentencePiece precompiled normalisation map (what T5 tokenizer.json files carry) taking
    each single-byte character of ``mapping`` to its string: a darts-clone double-array trie of
    one-byte keys, then the NUL-terminated replacements."""
    units = [0] * 512
    strings = b""
    for n, (key, value) in enumerate(sorted(mapping.items())):
        byte = key.encode()
        assert len(byte) == 1
        (c,) = byte
        leaf = 256 + n  # the key's node (at c from the root, offset 0) points to its leaf here
        units[c] = ((c ^ leaf) << 10) | (1 << 8) | c  # offset to the leaf, has a leaf, label
        units[leaf] = (1 << 31) | len(strings)  # a leaf: where the replacement starts
        strings += value.encode() + b"\0"
    trie = b"".join(struct.pack("<I", u) for u in units)
    return struct.pack("<I", len(trie)) + trie + strings


def t5_like(folder: Path, *, tokenizer_class: str = "T5Tokenizer", config_style: str = "decoder",
            byte_fallback: bool = True, extra_ids: int = 3, json_added: bool = True) -> Path:
    """A umT5-shaped tokenizer folder: Unigram over pieces, byte pieces and sentinel ids (in the
    vocabulary, last, as transformers' converter writes them), a normalizer of a precompiled map
    (A -> a) and a Replace, Metaspace, ``$A </s>``, <pad>/</s>/<unk> = 0/1/2. ``config_style``:
    the tokens listed in tokenizer_config.json's added_tokens_decoder (as transformers >= 4.34
    saves it, and Wan's folders hold), or in special_tokens_map.json (older saves).
    ``json_added=False``: tokenizer.json lists no added tokens (the special ones are only in the
    vocabulary), so only the config makes "</s>" in a prompt the special token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = ["<pad>", "</s>", "<unk>"]
    sentinels = [f"<extra_id_{i}>" for i in reversed(range(extra_ids))]
    pieces = [(p, 0.0) for p in specials]
    pieces += [(w, -1.0 - i / 10) for i, w in enumerate(WORDS)]
    pieces += [(c, -5.0 - i / 10) for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")]
    pieces += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    pieces += [(s, 0.0) for s in sentinels]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=byte_fallback))
    tok.normalizer = normalizers.Sequence([normalizers.Precompiled(charsmap({"A": "a"})),
                                           normalizers.Replace(Regex(" {2,}"), "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"],
                                                       special_tokens=[("</s>", 1)])
    if json_added:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials + sentinels])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    names = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    config: dict = {"tokenizer_class": tokenizer_class, "model_max_length": 1000000000000000019884624838656,
                    "extra_ids": extra_ids, "additional_special_tokens": sorted(sentinels),
                    "clean_up_tokenization_spaces": True, "legacy": True}
    if config_style == "decoder":
        added = tok.get_added_tokens_decoder()
        config["added_tokens_decoder"] = {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special} for i, t in sorted(added.items())}
        config.update(names)
    else:
        (folder / "special_tokens_map.json").write_text(json.dumps({**names, "additional_special_tokens": sentinels}))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_the_tiny_tokenizer_is_transformers() -> None:
    assert_as_transformers(tiny_model_folder() / "tokenizer")


@pytest.mark.parametrize("tokenizer_class", ["T5Tokenizer", "T5TokenizerFast", "PreTrainedTokenizerFast"])
@pytest.mark.parametrize("config_style", ["decoder", "special_tokens_map"])
def test_a_t5_like_tokenizer_is_transformers(tmp_path: Path, tokenizer_class: str, config_style: str) -> None:
    folder = t5_like(tmp_path / "tokenizer", tokenizer_class=tokenizer_class, config_style=config_style)
    ids, mask = assert_as_transformers(folder)
    # What transformers does with a prompt past 512 tokens: cut to 511 and </s> last.
    for i in (PROMPTS.index(" ".join(["snow"] * 700)), len(PROMPTS) - 1):
        assert mask[i].all() and ids[i, -1].item() == 1
    # A short prompt: its tokens, </s>, then <pad> with mask 0.
    assert ids[0, :6].tolist() == [3, 4, 5, 6, 7, 1] and mask[0].sum().item() == 6 and not ids[0, 6:].any()


@pytest.mark.parametrize("tokenizer_class", ["T5Tokenizer", "PreTrainedTokenizerFast"])
def test_special_tokens_only_the_config_names_are_registered(tmp_path: Path, tokenizer_class: str) -> None:
    folder = t5_like(tmp_path / "tokenizer", tokenizer_class=tokenizer_class, config_style="special_tokens_map",
                     json_added=False)
    ids, mask = assert_as_transformers(folder)
    i = PROMPTS.index("x </s> y <extra_id_1> <pad>z")
    row = ids[i, : mask[i].sum()].tolist()
    # </s> from the prompt and the template's; <extra_id_1> (vocabulary id 304) and <pad> as themselves.
    assert row.count(1) == 2 and 304 in row and 0 in row


def test_t5tokenizer_reads_the_file_as_transformers_5_does(tmp_path: Path) -> None:
    """The classes differ where transformers' T5Tokenizer rebuilds the file's pipeline: characters
    outside the vocabulary are <unk> (no byte pieces) and the Replace normalizer is dropped, the
    precompiled map kept. Both still agree with AutoTokenizer (test above); here they differ."""
    t5 = load_tokenizer(t5_like(tmp_path / "t5", tokenizer_class="T5Tokenizer"))
    as_is = load_tokenizer(t5_like(tmp_path / "fast", tokenizer_class="PreTrainedTokenizerFast"))
    prompt = ["A fox 🦊"]
    t5_ids, as_is_ids = t5(prompt, 16)[0][0].tolist(), as_is(prompt, 16)[0][0].tolist()
    assert t5_ids[:5] == [3, 4, 18, 2, 1]  # ▁a ▁fox ▁ <unk> </s>
    assert as_is_ids[:3] == [3, 4, 18] and len([i for i in as_is_ids if i]) == 8  # then the emoji's 4 bytes, </s>


def test_padding_and_truncation_sides_are_the_configs(tmp_path: Path) -> None:
    folder = t5_like(tmp_path / "tokenizer")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(padding_side="left", truncation_side="left")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ids, mask = assert_as_transformers(folder)
    assert mask[0, -1] == 1 and mask[0, 0] == 0


def test_a_folder_without_tokenizer_json_is_read_by_transformers(tmp_path: Path, caplog) -> None:
    """vocab.json + merges.txt only (a GPT-2 BPE): the reason is logged, the tokens are AutoTokenizer's."""
    from tokenizers import pre_tokenizers

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({ch: i + 3 for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    vocab.update({"Ġf": len(vocab), "ox": len(vocab) + 1})
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\nĠ f\no x\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
         "bos_token": "</s>"}))
    with caplog.at_level(logging.WARNING, logger="pan2render.models.tokenizer"):
        tokenizer = load_tokenizer(folder)
    assert isinstance(tokenizer, TransformersTokenizer)
    assert f"{folder}: read by transformers' AutoTokenizer (slow to import): no tokenizer.json" in caplog.text
    ids, mask = tokenizer(PROMPTS[:3], MAX)
    want_ids, want_mask = reference(folder, PROMPTS[:3])
    assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask)


@pytest.mark.parametrize("change, reason", [
    ({"add_eos_token": True}, "tokenizer_config.json sets 'add_eos_token'"),
    ({"tokenizer_class": "LlamaTokenizer"}, "tokenizer_class 'LlamaTokenizer' is not one of"),
    ({"pad_token": "<never seen>"}, "special token '<never seen>' is not in the vocabulary"),
])
def test_what_we_do_not_reproduce_is_left_to_transformers(tmp_path: Path, caplog, change: dict, reason: str) -> None:
    folder = t5_like(tmp_path / "tokenizer")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    with caplog.at_level(logging.WARNING, logger="pan2render.models.tokenizer"):
        tokenizer = load_tokenizer(folder)
    assert isinstance(tokenizer, TransformersTokenizer) and reason in caplog.text


def test_a_tokenizer_json_that_does_not_parse_names_the_file(tmp_path: Path) -> None:
    folder = t5_like(tmp_path / "tokenizer", tokenizer_class="PreTrainedTokenizerFast")
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match=rf"{folder / 'tokenizer.json'}: cannot load the tokenizer"):
        load_tokenizer(folder)


def test_no_pad_token_is_an_error_at_load(tmp_path: Path) -> None:
    folder = t5_like(tmp_path / "tokenizer", tokenizer_class="PreTrainedTokenizerFast")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=rf"{folder}: the tokenizer has no pad token"):
        load_tokenizer(folder)


def test_the_charsmap_helper_builds_a_working_map() -> None:
    from tokenizers import normalizers

    assert normalizers.Precompiled(charsmap({"A": "a", "B": "bb"})).normalize_str("ABC A") == "abbC a"
    assert base64.b64encode(charsmap({"A": "a"}))  # what tokenizer.json stores
