"""LoRA files that do not fit are refused from their header alone, naming the file and the keys;
the ones that do are planned as diffusers reads them (layout, alpha, PEFT's metadata)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pan2render.lora_plan import Layout, LoraFileError, dit_linears, plan_lora_file

TINY = {"num_attention_heads": 2, "attention_head_dim": 12, "text_dim": 16, "freq_dim": 8, "ffn_dim": 40,
        "num_layers": 2, "in_channels": 48, "out_channels": 48, "patch_size": [1, 2, 2]}
LINEARS = dit_linears(TINY)  # width 24


def _save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    save_file({k: v.clone() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def _pair(rank: int = 4, inp: int = 24, out: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rank, inp), torch.randn(out, rank)


def test_each_layout_is_recognised(tmp_path: Path) -> None:
    a, b = _pair()
    files = {
        Layout.DIFFUSERS: {"transformer.blocks.0.attn1.to_q.lora_A.weight": a,
                           "transformer.blocks.0.attn1.to_q.lora_B.weight": b},
        Layout.WAN: {"diffusion_model.blocks.0.self_attn.q.lora_down.weight": a,
                     "diffusion_model.blocks.0.self_attn.q.lora_up.weight": b,
                     "diffusion_model.blocks.0.self_attn.q.alpha": torch.tensor(2.0),
                     "diffusion_model.blocks.0.norm3.diff": torch.zeros(24),
                     "diffusion_model.blocks.0.self_attn.q.diff": torch.zeros(24, 24),
                     "diffusion_model.blocks.0.modulation.diff": torch.zeros(1, 6, 24)},
        Layout.KOHYA: {"lora_unet_blocks_0_self_attn_q.lora_down.weight": a,
                       "lora_unet_blocks_0_self_attn_q.lora_up.weight": b,
                       "lora_unet_blocks_0_self_attn_q.alpha": torch.tensor(2.0)},
    }
    for layout, tensors in files.items():
        plan = plan_lora_file(_save(tmp_path / f"{layout.name}.safetensors", tensors), LINEARS)
        assert plan.layout is layout
        assert [(t.module, t.rank) for t in plan.targets] == [("blocks.0.attn1.to_q", 4)]
    # The diffs diffusers leaves unread (a norm's, a .diff of another layer than head.head, the
    # modulation's) are dropped as it drops them.
    assert set(plan_lora_file(tmp_path / "WAN.safetensors", LINEARS).dropped) == {
        "diffusion_model.blocks.0.norm3.diff", "diffusion_model.blocks.0.self_attn.q.diff",
        "diffusion_model.blocks.0.modulation.diff"}


def test_peft_metadata_sets_each_modules_scale(tmp_path: Path) -> None:
    a, b = _pair()
    tensors = {f"transformer.blocks.{i}.attn1.to_q.{p}.weight": t
               for i in (0, 1) for p, t in (("lora_A", a), ("lora_B", b))}
    config = {"transformer.r": 4, "transformer.lora_alpha": 8, "transformer.alpha_pattern": {"blocks.1.attn1.to_q": 2}}
    path = _save(tmp_path / "m.safetensors", tensors, {"lora_adapter_metadata": json.dumps(config)})
    assert {t.module: t.config_scale for t in plan_lora_file(path, LINEARS).targets} == {
        "blocks.0.attn1.to_q": 2.0, "blocks.1.attn1.to_q": 0.5}
    config["transformer.r"] = 8  # the tensors say 4
    path = _save(tmp_path / "m.safetensors", tensors, {"lora_adapter_metadata": json.dumps(config)})
    with pytest.raises(LoraFileError, match="rank 8, its tensors rank 4"):
        plan_lora_file(path, LINEARS)


def test_rank_and_alpha_patterns_match_as_the_installed_peft_matches_them(tmp_path: Path) -> None:
    """PEFT's ``alpha_pattern`` / ``rank_pattern`` keys match the END of a module's name, as regexes
    (``get_pattern_key``): a key ``attn2.to_k`` sets every block's, ``blocks\\.1\\..*`` a whole block.
    Each module's scale is the one peft itself picks, checked against peft's own function."""
    from peft.utils.other import get_pattern_key

    modules = [m for m in LINEARS if m.startswith("blocks.")]
    tensors = {}
    for m in modules:
        out, inp = LINEARS[m]
        tensors |= {f"transformer.{m}.lora_A.weight": torch.randn(4, inp), f"transformer.{m}.lora_B.weight":
                    torch.randn(out, 4)}
    alpha = {"attn2.to_k": 2.0, r"blocks\.1\.ffn\..*": 16.0, "to_out.0": 12.0}
    config = {"transformer.r": 4, "transformer.lora_alpha": 4, "transformer.alpha_pattern": alpha}
    path = _save(tmp_path / "p.safetensors", tensors, {"lora_adapter_metadata": json.dumps(config)})
    scales = {t.module: t.config_scale for t in plan_lora_file(path, LINEARS).targets}
    expected = {m: alpha.get(get_pattern_key(alpha.keys(), m), 4.0) / 4 for m in modules}
    assert scales == expected
    assert scales["blocks.0.attn2.to_k"] == scales["blocks.1.attn2.to_k"] == 0.5  # a suffix, in every block
    assert scales["blocks.1.ffn.net.2"] == 4.0 and scales["blocks.0.ffn.net.2"] == 1.0  # a regex


def test_rslora_scales_by_alpha_over_the_square_root_of_the_rank(tmp_path: Path) -> None:
    a, b = _pair(rank=4)
    tensors = {"transformer.blocks.0.attn1.to_q.lora_A.weight": a, "transformer.blocks.0.attn1.to_q.lora_B.weight": b}
    for rslora, scale in ((True, 8 / 4 ** 0.5), (False, 8 / 4)):
        config = {"transformer.r": 4, "transformer.lora_alpha": 8, "transformer.use_rslora": rslora}
        path = _save(tmp_path / f"rs-{rslora}.safetensors", tensors, {"lora_adapter_metadata": json.dumps(config)})
        (target,) = plan_lora_file(path, LINEARS).targets
        assert target.config_scale == scale


def _refused(path: Path) -> str:
    with pytest.raises(LoraFileError) as info:
        plan_lora_file(path, LINEARS)
    message = str(info.value)
    print(message)
    assert str(path) in message
    return message


def test_pickles_are_never_read(tmp_path: Path) -> None:
    pt = tmp_path / "style.pt"
    torch.save({"blocks.0.attn1.to_q.lora_A.weight": torch.zeros(1)}, pt)
    assert "pickle" in _refused(pt)
    disguised = tmp_path / "style.safetensors"  # torch.save's zip under a safetensors name
    disguised.write_bytes(pt.read_bytes())
    assert "pickle" in _refused(disguised)
    raw = tmp_path / "raw.safetensors"
    raw.write_bytes(pickle.dumps({"a": 1}))
    assert "pickle" in _refused(raw)
    text = tmp_path / "notes.safetensors"
    text.write_text("just some text, long enough to hold a header length")
    assert "not a safetensors file" in _refused(text)


@pytest.mark.parametrize(("tensors", "expected"), [
    ({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 320),
      "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(320, 4)},
     "'lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight'"),  # an SDXL LoRA
    ({"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 24),
      "transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(24, 4)},
     "another model's module names"),  # a Flux LoRA
    ({"diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight": torch.zeros(4, 24),
      "diffusion_model.blocks.0.cross_attn.k_img.lora_B.weight": torch.zeros(24, 4)},
     "Wan2.1 image-to-video"),
    ({"diffusion_model.blocks.2.self_attn.q.lora_A.weight": torch.zeros(4, 24),
      "diffusion_model.blocks.2.self_attn.q.lora_B.weight": torch.zeros(24, 4)},
     "'diffusion_model.blocks.2.self_attn.q.lora_A.weight'"),  # more blocks than the model has
])
def test_another_models_lora_is_refused_naming_the_key(tmp_path: Path, tensors: dict, expected: str) -> None:
    message = _refused(_save(tmp_path / "x.safetensors", tensors))
    assert "not in this DiT" in message and expected in message


def test_shapes_that_do_not_fit_are_refused_naming_the_key(tmp_path: Path) -> None:
    a, b = _pair(inp=40, out=40)  # a LoRA for a 40-wide model
    message = _refused(_save(tmp_path / "wide.safetensors", {"blocks.0.attn1.to_q.lora_A.weight": a,
                                                             "blocks.0.attn1.to_q.lora_B.weight": b}))
    assert "'blocks.0.attn1.to_q.lora_A.weight' has shape [4, 40]" in message and "another width" in message


@pytest.mark.parametrize(("tensors", "expected"), [
    ({"blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 24)}, "no lora_B / lora_up partner"),
    ({"blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 24), "blocks.0.attn1.to_q.lora_B.weight": torch.zeros(24, 4),
      "blocks.0.attn1.to_q.lora_magnitude_vector": torch.zeros(24)}, "DoRA"),
    ({"blocks.0.attn1.to_q.weight": torch.zeros(24, 24)}, "not LoRA factors"),
    ({"blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 24), "blocks.0.attn1.to_q.lora_B.weight": torch.zeros(24, 4),
      "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": torch.zeros(4, 8)}, "text encoder"),
    ({"blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 24, dtype=torch.int8),
      "blocks.0.attn1.to_q.lora_B.weight": torch.zeros(24, 4)}, "is I8"),
])
def test_malformed_adapters_are_refused(tmp_path: Path, tensors: dict, expected: str) -> None:
    assert expected in _refused(_save(tmp_path / "bad.safetensors", tensors))
