"""The text encoder's own loader (`load_umt5_encoder`, what a CUDA load uses) against transformers'
from_pretrained, on the CPU over the tiny checkpoint's umT5."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pan2render.models.checkpoint import CheckpointError
from pan2render.models.text import TextEncoder, load_umt5_encoder
from pan2render.models.tiny import tiny_checkpoint_path


@pytest.fixture(scope="module")
def tiny_text_encoder() -> Path:
    return tiny_checkpoint_path() / "text_encoder"


def reference(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import UMT5EncoderModel

    return UMT5EncoderModel.from_pretrained(str(folder), dtype=dtype, use_safetensors=True).eval()


def outputs(model: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a shorter second prompt
    with torch.no_grad():
        return model(ids, mask).last_hidden_state


def assert_same_model(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    want = ref.state_dict()
    got = ours.state_dict()
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert got[key].dtype == w.dtype and torch.equal(got[key], w), key
    assert not any(p.requires_grad for p in ours.parameters())
    assert torch.equal(outputs(ours), outputs(ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_meta_built_encoder_equals_from_pretrained(tiny_text_encoder: Path, dtype: torch.dtype) -> None:
    ours = load_umt5_encoder(tiny_text_encoder, device="cpu", dtype=dtype)
    ref = reference(tiny_text_encoder, dtype)
    assert_same_model(ours, ref)
    # Tied as transformers ties them: one Parameter under both names.
    assert ours.encoder.embed_tokens.weight is ours.shared.weight
    assert len(list(ours.parameters())) == len(list(ref.parameters()))
    if dtype == torch.float16:  # transformers keeps the FFN output projections in fp32 under fp16
        assert ours.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32


@pytest.mark.parametrize("names", [["shared.weight"], ["encoder.embed_tokens.weight"],
                                   ["shared.weight", "encoder.embed_tokens.weight"]])
def test_the_embedding_under_either_name_or_both(tmp_path: Path, tiny_text_encoder: Path, names: list[str]) -> None:
    """The tiny checkpoint holds it as encoder.embed_tokens.weight; Wan's and save_pretrained's hold
    shared.weight; a checkpoint may hold both."""
    folder = tmp_path / "text_encoder"
    shutil.copytree(tiny_text_encoder, folder)
    sd = load_file(str(folder / "model.safetensors"))
    embedding = sd.pop("encoder.embed_tokens.weight")
    sd.update({name: embedding.clone() for name in names})
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ours = load_umt5_encoder(folder, device="cpu", dtype=torch.float32)
    assert ours.encoder.embed_tokens.weight is ours.shared.weight
    assert torch.equal(ours.shared.weight, embedding)
    assert_same_model(ours, reference(tiny_text_encoder, torch.float32))


def test_two_different_embeddings_are_kept_apart_as_transformers_does(tmp_path: Path, tiny_text_encoder: Path) -> None:
    folder = tmp_path / "text_encoder"
    shutil.copytree(tiny_text_encoder, folder)
    sd = load_file(str(folder / "model.safetensors"))
    sd["shared.weight"] = torch.randn_like(sd["encoder.embed_tokens.weight"])
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ours = load_umt5_encoder(folder, device="cpu", dtype=torch.float32)
    assert torch.equal(ours.shared.weight, sd["shared.weight"])
    assert torch.equal(ours.encoder.embed_tokens.weight, sd["encoder.embed_tokens.weight"])
    assert torch.equal(outputs(ours), outputs(reference(folder, torch.float32)))


@pytest.mark.parametrize("change, message", [
    (lambda sd: sd.pop("encoder.final_layer_norm.weight"), r"1 missing key\(s\): encoder.final_layer_norm.weight"),
    (lambda sd: sd.pop("encoder.embed_tokens.weight"),
     r"2 missing key\(s\): encoder.embed_tokens.weight, shared.weight"),
    (lambda sd: sd.update({"decoder.extra.weight": torch.zeros(2)}), r"1 unexpected key\(s\): decoder.extra.weight"),
    (lambda sd: sd.update({"encoder.final_layer_norm.weight": torch.zeros(5)}),
     r"shape mismatch for 'encoder.final_layer_norm.weight' in .*model.safetensors: expected \[32\], found \[5\]"),
])
def test_weights_that_do_not_fit_name_the_folder(tmp_path: Path, tiny_text_encoder: Path, change, message: str) -> None:
    folder = tmp_path / "text_encoder"
    shutil.copytree(tiny_text_encoder, folder)
    sd = load_file(str(folder / "model.safetensors"))
    change(sd)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{folder}: weights do not fit the model config:\n(.|\n)*{message}"):
        load_umt5_encoder(folder, device="cpu", dtype=torch.float32)


def test_a_config_transformers_cannot_build_names_the_folder(tmp_path: Path, tiny_text_encoder: Path) -> None:
    folder = tmp_path / "text_encoder"
    shutil.copytree(tiny_text_encoder, folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"{folder}: cannot build the UMT5 encoder"):
        load_umt5_encoder(folder, device="cpu", dtype=torch.float32)


@pytest.mark.gpu
def test_cuda_text_encoder_encodes_as_the_cpu_one() -> None:
    root = tiny_checkpoint_path()
    cpu = TextEncoder.from_pretrained(root, device="cpu", dtype=torch.float32)
    gpu = TextEncoder.from_pretrained(root, device="cuda", dtype=torch.float32)
    assert gpu.device.type == "cuda" and gpu.encoder_id == cpu.encoder_id
    assert gpu.encoder.encoder.embed_tokens.weight is gpu.encoder.shared.weight
    prompts = ["a fox in the snow", "a much longer prompt about a lighthouse at dusk, waves, gulls"]
    torch.testing.assert_close(gpu.encode(prompts), cpu.encode(prompts), rtol=1e-4, atol=1e-5)
