"""LoRA adapters: our DiT with adapters merged equals diffusers' WanTransformer3DModel after
``load_lora_weights`` + ``fuse_lora`` (CPU, fp32, one random state dict), in every layout; switching
adapters restores the checkpoint's weights bit for bit.

Relative error is max|ours - ref| / max|ref| over the whole output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_files import block_modules, diffusers_dict, kohya_dict, random_factors, wan_dict, write

from pan2render.lora_plan import dit_linears
from pan2render.models import PAN2Pipeline, PAN2PipelineConfig
from pan2render.models.dit import PAN2DiT, PAN2DiTConfig
from pan2render.models.lora import MergedLoras, linear_shapes, read_lora
from pan2render.models.samplers import SchedulerConfig
from pan2render.models.tiny import SCHEDULER_CONFIG, TINY_VAE_CONFIG
from pan2render.models.vae import WanVAE, WanVAEConfig

pytest.importorskip("peft")  # diffusers' LoRA loading runs on PEFT
from diffusers import WanTransformer3DModel
from diffusers.loaders import WanLoraLoaderMixin

MAX_REL_ERR = 1e-4
TINY = PAN2DiTConfig(num_attention_heads=3, attention_head_dim=20, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)
SHAPES = dit_linears(TINY.to_dict())
TOP_MODULES = ["condition_embedder.time_proj", "proj_out", "condition_embedder.text_embedder.linear_1",
               "condition_embedder.text_embedder.linear_2", "condition_embedder.time_embedder.linear_1",
               "condition_embedder.time_embedder.linear_2"]


class DiffusersLoras(WanLoraLoaderMixin):
    """diffusers' Wan LoRA loading around a bare transformer: a WanPipeline without the components
    LoRA loading does not touch (text encoder, VAE, scheduler)."""

    hf_device_map = None

    def __init__(self, transformer: WanTransformer3DModel) -> None:
        self.transformer = transformer

    @property
    def components(self) -> dict[str, object]:
        return {"transformer": self.transformer}


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = PAN2DiT(TINY)
    with torch.no_grad():  # norms and tables off their initial values, so every weight matters
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    return {k: v.clone() for k, v in model.state_dict().items()}


def ours(state: dict[str, torch.Tensor]) -> PAN2DiT:
    model = PAN2DiT(TINY).eval()
    model.load_state_dict(state, strict=True)
    return model


def diffusers_model(state: dict[str, torch.Tensor]) -> WanTransformer3DModel:
    kwargs = {k: v for k, v in TINY.to_dict().items() if not k.startswith("_")}
    model = WanTransformer3DModel(**kwargs).eval()
    model.load_state_dict(state, strict=True)
    return model


def forward(model: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 48, 2, 4, 4, generator=g)  # 2 x 2 x 2 = 8 tokens
    context = torch.randn(1, 7, TINY.text_dim, generator=g)
    t = torch.tensor([700.0])
    with torch.no_grad():
        if isinstance(model, PAN2DiT):
            return model(x, t, context)
        return model(hidden_states=x, timestep=t, encoder_hidden_states=context, return_dict=False)[0]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max())


def _case_files(tmp: Path, case: str) -> list[tuple[Path, object, float]]:
    """(our file, what diffusers is given, scale) per adapter of a case."""
    blocks = block_modules(TINY.num_layers)
    if case == "diffusers, no prefix":
        f = random_factors(SHAPES, blocks + ["proj_out"], rank=4, seed=1)
        return [(write(tmp / "a.safetensors", diffusers_dict(f, prefix="")), diffusers_dict(f), 0.7)]
    if case == "diffusers, PEFT metadata":
        f = random_factors(SHAPES, blocks, rank=4, seed=2)
        config = {"r": 4, "lora_alpha": 8, "alpha_pattern": {"blocks.1.attn1.to_q": 2.0},
                  "target_modules": sorted(f.down)}
        path = write(tmp / "a.safetensors", diffusers_dict(f), peft_config=config)
        return [(path, str(path), 1.0)]
    if case == "wan lora_A/lora_B, alpha, biases, top-level modules":
        # diffusers reads an alpha on the blocks' layers only
        f = random_factors(SHAPES, blocks[:7], rank=3, seed=3, bias=True, alpha=1.5)
        top = random_factors(SHAPES, TOP_MODULES, rank=3, seed=13, bias=True)
        sd = {**wan_dict(f, names=("lora_A", "lora_B")), **wan_dict(top, names=("lora_A", "lora_B"))}
        # Diffs diffusers leaves unread (a norm's, a whole-weight one on another layer than the head):
        dim = TINY.inner_dim
        sd["diffusion_model.blocks.0.norm3.diff"] = torch.randn(dim)
        sd["diffusion_model.blocks.1.self_attn.q.diff"] = torch.randn(dim, dim)
        return [(write(tmp / "a.safetensors", sd), sd, 0.5)]
    if case == "wan head.head.diff (a whole proj_out delta) + diff_b":
        f = random_factors(SHAPES, blocks[:4], rank=2, seed=8)
        out, inp = SHAPES["proj_out"]
        g = torch.Generator().manual_seed(8)
        sd = {**wan_dict(f), "diffusion_model.head.head.diff": torch.randn(out, inp, generator=g) / inp ** 0.5,
              "diffusion_model.head.head.diff_b": torch.randn(out, generator=g) * 0.1}
        return [(write(tmp / "a.safetensors", sd), sd, 0.8)]
    if case == "wan lora_down/lora_up, alpha 3 at rank 8":
        f = random_factors(SHAPES, blocks, rank=8, seed=4, alpha=3.0)
        sd = wan_dict(f)
        return [(write(tmp / "a.safetensors", sd), sd, 1.3)]
    if case == "kohya/musubi, alpha 16 at rank 4, negative scale":
        f = random_factors(SHAPES, blocks, rank=4, seed=5, alpha=16.0, strength=0.2)
        sd = kohya_dict(f)
        return [(write(tmp / "a.safetensors", sd), sd, -0.5)]
    assert case == "two stacked: wan with alpha + diffusers"
    f1 = random_factors(SHAPES, blocks, rank=4, seed=6, alpha=2.0)
    f2 = random_factors(SHAPES, blocks[::2], rank=2, seed=7)
    return [(write(tmp / "a.safetensors", wan_dict(f1)), wan_dict(f1), 0.6),
            (write(tmp / "b.safetensors", diffusers_dict(f2)), diffusers_dict(f2), 1.4)]


CASES = ["diffusers, no prefix", "diffusers, PEFT metadata", "wan lora_A/lora_B, alpha, biases, top-level modules",
         "wan head.head.diff (a whole proj_out delta) + diff_b",
         "wan lora_down/lora_up, alpha 3 at rank 8", "kohya/musubi, alpha 16 at rank 4, negative scale",
         "two stacked: wan with alpha + diffusers"]


@pytest.mark.parametrize("case", CASES)
def test_merged_adapters_match_diffusers(case: str, state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    adapters = _case_files(tmp_path, case)
    ref_model = diffusers_model(state)
    base = forward(ref_model)
    loader = DiffusersLoras(ref_model)
    for i, (_, given, _) in enumerate(adapters):
        loader.load_lora_weights(given, adapter_name=f"a{i}")
    loader.set_adapters([f"a{i}" for i in range(len(adapters))], [s for *_, s in adapters])
    loader.fuse_lora(components=["transformer"])
    ref = forward(ref_model)

    model = ours(state)
    linears = linear_shapes(model)
    weights = [read_lora(path, linears=linears) for path, _, _ in adapters]
    merged = MergedLoras(model)
    merged.set([(w, s) for w, (_, _, s) in zip(weights, adapters)])
    err = rel_err(forward(model), ref)
    # Negative control: 1% off on one adapter's scale is outside the tolerance.
    merged.set([(w, s * (1.01 if i == 0 else 1.0)) for i, (w, (_, _, s)) in enumerate(zip(weights, adapters))])
    off = rel_err(forward(model), ref)
    moved = rel_err(base, ref)
    print(f"{case}: rel err {err:.2e}, 1% off {off:.2e}, the adapters move the output {moved:.2e}")
    assert err <= MAX_REL_ERR
    assert off > MAX_REL_ERR
    assert moved > 100 * MAX_REL_ERR


def test_config_derived_shapes_are_the_models_linears() -> None:
    """Batch validation checks a LoRA against shapes derived from config.json (no torch); they are
    exactly the built model's linear layers, at toy size and at Wan2.2-TI2V-5B's."""
    for config in (TINY, PAN2DiTConfig(), PAN2DiTConfig(out_channels=None, patch_size=(1, 1, 2), num_layers=3)):
        with torch.device("meta"):
            model = PAN2DiT(config)
        assert dit_linears(config.to_dict()) == linear_shapes(model)


# --- switching ----------------------------------------------------------------------------------


def _lora(tmp: Path, seed: int, rank: int = 4, modules: list[str] | None = None) -> Path:
    f = random_factors(SHAPES, modules or block_modules(TINY.num_layers), rank=rank, seed=seed, alpha=2.0)
    return write(tmp / f"lora{seed}.safetensors", wan_dict(f))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_switching_restores_the_checkpoint_bit_for_bit(dtype: torch.dtype, state: dict[str, torch.Tensor],
                                                        tmp_path: Path) -> None:
    model = ours(state).to(dtype)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    linears = linear_shapes(model)
    a = read_lora(_lora(tmp_path, 1), linears=linears)
    b = read_lora(_lora(tmp_path, 2, rank=2, modules=block_modules(1)), linears=linears)
    merged = MergedLoras(model)
    for adapters in ([(a, 0.5)], [(a, 1.0), (b, 0.3)], [(b, -2.0)], [(a, 0.25)]):
        assert merged.set(adapters)
    after_sweep = {k: v.clone() for k, v in model.state_dict().items()}
    assert not merged.set([(a, 0.25)])  # the same set again: nothing to do
    fresh = ours(state).to(dtype)
    MergedLoras(fresh).set([(a, 0.25)])
    assert all(torch.equal(after_sweep[k], v) for k, v in fresh.state_dict().items())
    assert any(not torch.equal(after_sweep[k], original[k]) for k in original)
    merged.set([])
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, original[k])]
    assert changed == []


def test_clear_forgets_the_set_so_the_same_set_merges_again(state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """After `clear` (the checkpoint's weights again) no adapter is marked merged: the same set asked
    for next is merged again, not taken for the one in place (which would sample without it)."""
    model = ours(state)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    a = read_lora(_lora(tmp_path, 1), linears=linear_shapes(model))
    merged = MergedLoras(model)
    assert merged.set([(a, 0.5)])
    with_a = {k: v.clone() for k, v in model.state_dict().items()}
    merged.clear()
    assert merged.active == () and all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
    assert merged.set([(a, 0.5)])
    assert all(torch.equal(v, with_a[k]) for k, v in model.state_dict().items())


def _tiny_pipeline() -> PAN2Pipeline:
    torch.manual_seed(0)
    dit = PAN2DiT(TINY).eval()
    vae = WanVAE(WanVAEConfig.from_dict(TINY_VAE_CONFIG)).eval()
    return PAN2Pipeline(dit=dit, vae=vae, text_encoder=None,
                        scheduler_config=SchedulerConfig.from_dict(SCHEDULER_CONFIG),
                        config=PAN2PipelineConfig(device="cpu", dtype=torch.float32), model_id="lora-test")


JOB = dict(height=64, width=64, frames=5, steps=3, guidance=2.5, seed=3, sampler="unipc")


def _sample(pipe: PAN2Pipeline) -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    return pipe.sample(prompt_embeds=torch.randn(7, TINY.text_dim, generator=g),
                       negative_prompt_embeds=torch.randn(7, TINY.text_dim, generator=g), **JOB)


def test_a_sweep_of_scales_on_one_pipeline_equals_fresh_loads(tmp_path: Path) -> None:
    path = _lora(tmp_path, 3)
    scales = [0.25, 0.5, 1.0, -0.5, 2.0]
    pipe = _tiny_pipeline()
    plain = _sample(pipe)
    adapter = pipe.read_lora(path)
    swept = {}
    for s in scales:
        assert pipe.set_loras([(adapter, s)])
        swept[s] = _sample(pipe)
    for s in scales:
        fresh = _tiny_pipeline()
        fresh.set_loras([(fresh.read_lora(path), s)])
        assert torch.equal(_sample(fresh), swept[s]), s
    assert len({float(v.abs().sum()) for v in swept.values()}) == len(scales)  # each scale renders its own
    pipe.set_loras([])
    assert torch.equal(_sample(pipe), plain)


def test_bytes_and_path_read_alike(tmp_path: Path) -> None:
    """A worker gets the file's bytes, not its path: same digest, same deltas."""
    path = _lora(tmp_path, 4)
    linears = dit_linears(TINY.to_dict())
    from_path, from_bytes = read_lora(path, linears=linears), read_lora(path.read_bytes(), linears=linears, name="x")
    assert from_path.sha256 == from_bytes.sha256
    assert [d.module for d in from_path.deltas] == [d.module for d in from_bytes.deltas]
    assert all(torch.equal(a.down, b.down) for a, b in zip(from_path.deltas, from_bytes.deltas))
