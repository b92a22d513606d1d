"""Checkpoint loading: diffusers layout, sharded weights, and one test per loader error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pan2render.models import ModelFolderError, load_dit, load_vae
from pan2render.models.tiny import TINY_DIT_CONFIG, TINY_VAE_CONFIG


def _random_state_dict(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen, dtype=torch.float32) * 0.05
            for k, v in module.state_dict().items()}


def _write(folder: Path, config: dict, sd: dict[str, torch.Tensor], *, shards: int = 1) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(sd, str(folder / "diffusion_pytorch_model.safetensors"))
        return
    keys = sorted(sd)
    weight_map = {}
    for i in range(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(folder / name))
        weight_map.update({k: name for k in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def dit_state() -> dict[str, torch.Tensor]:
    from pan2render.models.dit import PAN2DiT, PAN2DiTConfig

    return _random_state_dict(PAN2DiT(PAN2DiTConfig.from_dict(TINY_DIT_CONFIG)), seed=1)


def test_sharded_checkpoint_loads_every_tensor(tmp_path: Path, dit_state) -> None:
    _write(tmp_path / "transformer", TINY_DIT_CONFIG, dit_state, shards=2)
    files = sorted(p.name for p in (tmp_path / "transformer").iterdir())
    assert files == ["config.json", "diffusion_pytorch_model-00001-of-00002.safetensors",
                     "diffusion_pytorch_model-00002-of-00002.safetensors",
                     "diffusion_pytorch_model.safetensors.index.json"]
    dit = load_dit(tmp_path)  # the checkpoint root works ...
    dit2 = load_dit(tmp_path / "transformer")  # ... and so does the component folder
    for key, value in dit_state.items():
        assert torch.equal(dit.state_dict()[key], value), key
        assert torch.equal(dit2.state_dict()[key], value), key
    assert not any(p.requires_grad for p in dit.parameters())


def test_bf16_load_keeps_modulation_and_norms_in_fp32(tmp_path: Path, dit_state) -> None:
    _write(tmp_path / "transformer", TINY_DIT_CONFIG, dit_state)
    from diffusers import WanTransformer3DModel

    dit = load_dit(tmp_path, dtype=torch.bfloat16)
    dtypes = {k: v.dtype for k, v in dit.state_dict().items()}
    assert dtypes["scale_shift_table"] == torch.float32
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    # Every key follows diffusers' own rule: a module named in _keep_in_fp32_modules stays fp32.
    keep = WanTransformer3DModel._keep_in_fp32_modules
    want = {k: torch.float32 if any(m in k.split(".") for m in keep) else torch.bfloat16 for k in dtypes}
    assert dtypes == want
    assert sum(d == torch.float32 for d in dtypes.values()) > 10  # norms, time embedder, tables


def test_vae_loads(tmp_path: Path) -> None:
    from pan2render.models.vae import WanVAE, WanVAEConfig

    sd = _random_state_dict(WanVAE(WanVAEConfig.from_dict(TINY_VAE_CONFIG)), seed=2)
    _write(tmp_path / "vae", TINY_VAE_CONFIG, sd)
    vae = load_vae(tmp_path)
    assert all(torch.equal(vae.state_dict()[k], v) for k, v in sd.items())


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match="does not exist"):
        load_dit(tmp_path / "nope")


def test_missing_component_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match=r"no 'transformer/' folder"):
        load_dit(tmp_path)


def test_missing_weights_names_pickles_it_refuses(tmp_path: Path) -> None:
    folder = tmp_path / "transformer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_DIT_CONFIG))
    (folder / "diffusion_pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelFolderError) as err:
        load_dit(tmp_path)
    msg = str(err.value)
    assert "no diffusion_pytorch_model.safetensors" in msg and "pickle files are not loaded" in msg


def test_missing_shard_listed_by_index(tmp_path: Path, dit_state) -> None:
    _write(tmp_path / "transformer", TINY_DIT_CONFIG, dit_state, shards=2)
    (tmp_path / "transformer" / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFolderError, match="00002-of-00002.safetensors"):
        load_dit(tmp_path)


def test_missing_and_unexpected_keys_are_listed(tmp_path: Path, dit_state) -> None:
    sd = dict(dit_state)
    sd.pop("proj_out.weight")
    sd.pop("blocks.1.ffn.net.2.bias")
    sd["blocks.7.extra.weight"] = torch.zeros(3)
    _write(tmp_path / "transformer", TINY_DIT_CONFIG, sd)
    with pytest.raises(ModelFolderError) as err:
        load_dit(tmp_path)
    msg = str(err.value)
    print(msg)
    assert "2 missing key(s)" in msg and "proj_out.weight" in msg and "blocks.1.ffn.net.2.bias" in msg
    assert "1 unexpected key(s): blocks.7.extra.weight" in msg
    assert str(tmp_path / "transformer") in msg


def test_shape_mismatch_names_key_expected_found(tmp_path: Path, dit_state) -> None:
    sd = dict(dit_state)
    sd["proj_out.bias"] = torch.zeros(7)
    _write(tmp_path / "transformer", TINY_DIT_CONFIG, sd)
    with pytest.raises(ModelFolderError) as err:
        load_dit(tmp_path)
    want = list(dit_state["proj_out.bias"].shape)
    assert "shape mismatch for 'proj_out.bias'" in str(err.value)
    assert f"expected {want}, found [7]" in str(err.value)


def test_unsupported_config_value(tmp_path: Path, dit_state) -> None:
    config = dict(TINY_DIT_CONFIG, qk_norm="layer_norm")
    _write(tmp_path / "transformer", config, dit_state)
    with pytest.raises(ModelFolderError) as err:
        load_dit(tmp_path)
    assert "config.json" in str(err.value) and "qk_norm" in str(err.value)


def test_invalid_json(tmp_path: Path) -> None:
    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match=r"config.json: not valid JSON"):
        load_vae(tmp_path)


def test_truncated_safetensors(tmp_path: Path, dit_state) -> None:
    _write(tmp_path / "transformer", TINY_DIT_CONFIG, dit_state)
    weights = tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelFolderError, match="cannot read safetensors file"):
        load_dit(tmp_path)


def test_a_key_in_two_shards_names_both_files(tmp_path: Path, dit_state) -> None:
    folder = tmp_path / "transformer"
    _write(folder, TINY_DIT_CONFIG, dit_state, shards=2)
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    second = folder / "diffusion_pytorch_model-00002-of-00002.safetensors"
    key = next(k for k, f in index["weight_map"].items() if f.endswith("00001-of-00002.safetensors"))
    from safetensors.torch import load_file

    save_file({**load_file(second), key: dit_state[key]}, second)
    twice = rf"00002-of-00002.safetensors: key '{key}' also appears in .*00001-of-00002"
    with pytest.raises(ModelFolderError, match=twice):
        load_dit(tmp_path)
