"""The text encoder: `load_umt5_encoder` (our umT5, on every device) against transformers'
from_pretrained, on the CPU over the tiny checkpoint's umT5; `TextEncoder.encode` against the path it
replaced (transformers' UMT5EncoderModel and AutoTokenizer); and loading it without transformers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import pan2render
from pan2render.models.loading import ModelFolderError
from pan2render.models.text import TextEncoder, TransformersTokenizer, load_umt5_encoder
from pan2render.models.tiny import tiny_model_folder


@pytest.fixture(scope="module")
def tiny_text_encoder() -> Path:
    return tiny_model_folder() / "text_encoder"


def reference(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import UMT5EncoderModel

    return UMT5EncoderModel.from_pretrained(str(folder), dtype=dtype, use_safetensors=True).eval()


def outputs(model: torch.nn.Module) -> torch.Tensor:
    """Last hidden states of a batch of two (the second padded): ours returns them, transformers'
    model a ModelOutput holding them."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a shorter second prompt
    with torch.no_grad():
        out = model(ids, mask)
    return getattr(out, "last_hidden_state", out)


def assert_same_model(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    want = ref.state_dict()
    got = ours.state_dict()
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert got[key].dtype == w.dtype and torch.equal(got[key], w), key
    assert not any(p.requires_grad for p in ours.parameters())
    torch.testing.assert_close(outputs(ours), outputs(ref))  # the dtype's default tolerances


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


def test_two_different_embeddings_are_kept_apart_as_transformers_does(tmp_path: Path, tiny_text_encoder: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "text_encoder"
    shutil.copytree(tiny_text_encoder, folder)
    sd = load_file(str(folder / "model.safetensors"))
    sd["shared.weight"] = torch.randn_like(sd["encoder.embed_tokens.weight"])
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        ours = load_umt5_encoder(folder, device="cpu", dtype=torch.float32)
    assert any("tied weights" in r.getMessage() and "kept apart" in r.getMessage() for r in caplog.records)
    assert torch.equal(ours.shared.weight, sd["shared.weight"])
    assert torch.equal(ours.encoder.embed_tokens.weight, sd["encoder.embed_tokens.weight"])
    torch.testing.assert_close(outputs(ours), outputs(reference(folder, torch.float32)))


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
    with pytest.raises(ModelFolderError, match=rf"{folder}: weights do not fit the model config:\n(.|\n)*{message}"):
        load_umt5_encoder(folder, device="cpu", dtype=torch.float32)


def test_a_config_that_is_not_json_names_the_folder(tmp_path: Path, tiny_text_encoder: Path) -> None:
    folder = tmp_path / "text_encoder"
    shutil.copytree(tiny_text_encoder, folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match=rf"{folder}: cannot build the UMT5 encoder"):
        load_umt5_encoder(folder, device="cpu", dtype=torch.float32)


class TransformersEncoder(torch.nn.Module):
    """transformers' UMT5EncoderModel behind our encoder's call (ids, mask -> last hidden state)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(ids, mask).last_hidden_state


def transformers_text_encoder(root: Path, ours: TextEncoder, device: str = "cpu",
                              dtype: torch.dtype = torch.float32) -> TextEncoder:
    """The TextEncoder as it was built before: UMT5EncoderModel.from_pretrained and AutoTokenizer."""
    from transformers import AutoTokenizer

    encoder = TransformersEncoder(reference(root / "text_encoder", dtype).to(device))
    tokenizer = TransformersTokenizer(AutoTokenizer.from_pretrained(str(root / "tokenizer")))
    return TextEncoder(encoder, tokenizer, encoder_id=ours.encoder_id)


ENCODE_PROMPTS = [
    "a red fox in the snow",
    "A lighthouse at dusk &amp; waves,\n\tgulls  overhead — 灯台, 🌊",  # entities, whitespace, non-ASCII
    "word " * 600,  # past 512 tokens
]


def test_encode_is_unchanged_from_the_transformers_path() -> None:
    root = tiny_model_folder()
    ours = TextEncoder.from_pretrained(root, device="cpu", dtype=torch.float32)
    theirs = transformers_text_encoder(root, ours)
    got, want = ours.encode(ENCODE_PROMPTS), theirs.encode(ENCODE_PROMPTS)
    assert got.shape == want.shape == (3, 512, ours.dim) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.encode(ENCODE_PROMPTS[0]), theirs.encode(ENCODE_PROMPTS[0]), rtol=1e-5, atol=1e-6)
    lengths = got.abs().sum(-1).gt(0).sum(-1)
    assert lengths[2] == 512 and 0 < lengths[0] < lengths[1] < 512  # zero past each prompt


def test_loading_and_encoding_do_not_import_transformers() -> None:
    """In a fresh process (the tiny checkpoint already written, which uses transformers): nor
    torch._dynamo, which nn.Embedding's random init on the meta device imports (~2 s)."""
    root = tiny_model_folder()
    code = (
        "import sys\n"
        "import torch\n"
        "dynamo_before = 'torch._dynamo' in sys.modules\n"
        "from pan2render.models.text import TextEncoder\n"
        f"te = TextEncoder.from_pretrained({str(root)!r}, device='cpu')\n"
        "emb = te.encode('a red fox in the snow')\n"
        "assert emb.shape == (512, te.dim) and emb.abs().sum() > 0\n"
        "assert 'transformers' not in sys.modules, sorted(m for m in sys.modules if m.startswith('transformers'))[:5]\n"
        "assert dynamo_before or 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
        "print('ok', te.encoder_id)\n"
    )
    repo = Path(pan2render.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok umt5-")


@pytest.mark.gpu
def test_cuda_text_encoder_encodes_as_the_cpu_one() -> None:
    root = tiny_model_folder()
    cpu = TextEncoder.from_pretrained(root, device="cpu", dtype=torch.float32)
    gpu = TextEncoder.from_pretrained(root, device="cuda", dtype=torch.float32)
    assert gpu.device.type == "cuda" and gpu.encoder_id == cpu.encoder_id
    assert gpu.encoder.encoder.embed_tokens.weight is gpu.encoder.shared.weight
    prompts = ["a fox in the snow", "a much longer prompt about a lighthouse at dusk, waves, gulls"]
    torch.testing.assert_close(gpu.encode(prompts), cpu.encode(prompts), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_cuda_text_encoder_encodes_as_the_transformers_path() -> None:
    root = tiny_model_folder()
    ours = TextEncoder.from_pretrained(root, device="cuda", dtype=torch.float32)
    theirs = transformers_text_encoder(root, ours, device="cuda", dtype=torch.float32)
    torch.testing.assert_close(ours.encode(ENCODE_PROMPTS), theirs.encode(ENCODE_PROMPTS), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_cuda_bf16_text_encoder_is_as_accurate_as_the_transformers_path() -> None:
    """In bf16 the two paths may run different attention kernels on CUDA (ours: SDPA with the
    position bias as a float mask; transformers: its own matmuls), so they differ by rounding; what
    must hold is that ours is no further from the fp32 result than transformers' bf16 is."""
    root = tiny_model_folder()
    ref = TextEncoder.from_pretrained(root, device="cuda", dtype=torch.float32).encode(ENCODE_PROMPTS)
    ours = TextEncoder.from_pretrained(root, device="cuda", dtype=torch.bfloat16)
    theirs = transformers_text_encoder(root, ours, device="cuda", dtype=torch.bfloat16)

    def rel(x: torch.Tensor) -> float:
        return float((x.float() - ref).norm() / ref.norm())

    ours_err, theirs_err = rel(ours.encode(ENCODE_PROMPTS)), rel(theirs.encode(ENCODE_PROMPTS))
    print(f"rel L2 vs fp32: ours bf16 {ours_err:.3e}, transformers bf16 {theirs_err:.3e}")
    assert ours_err <= 1.25 * theirs_err + 1e-3 and ours_err < 2e-2


def test_encoder_id_is_computed_as_before(tmp_path: Path) -> None:
    """The id keys the embeddings cached on disk: config.json's content, the weight files' names and
    sizes, the dtype; a change here would orphan every cache."""
    import hashlib
    import json

    root = tiny_model_folder()
    folder = root / "text_encoder"
    digest = hashlib.sha256(json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True).encode())
    digest.update(f"model.safetensors:{(folder / 'model.safetensors').stat().st_size}".encode())
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        te = TextEncoder.from_pretrained(root, device="cpu", dtype=dtype)
        assert te.encoder_id == f"umt5-{digest.hexdigest()[:12]}-{name}"
