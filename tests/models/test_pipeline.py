"""PAN2Pipeline: sampling parity with diffusers' WanPipeline, the tiny model, request validation."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pan2render.models import PAN2Pipeline, PAN2PipelineConfig, load_dit, load_vae
from pan2render.models.samplers import SchedulerConfig
from pan2render.models.tiny import SCHEDULER_CONFIG, TINY_DIT_CONFIG, TINY_VAE_CONFIG


def _max_rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).abs().max() / ref.double().abs().max())


# Weights ~N(0, 1.5^2/fan_in): large enough that the text and the guidance scale visibly move the
# latents (a guidance change of 0.1 moves them 1e-3 relative, 10x the parity tolerance).
SCALE = 1.5


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (SCALE / max(1, p.shape[-1]) ** 0.5) + (p.dim() == 1) * 0.1)


@pytest.fixture(scope="module")
def reference_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """diffusers' own models with random weights, saved by diffusers in its layout.

    Returns the folder and the diffusers modules themselves (diffusers' from_pretrained needs
    accelerate for these classes, which we do not depend on).
    """
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    root = tmp_path_factory.mktemp("ref-ckpt")
    dit_cfg = {k: v for k, v in TINY_DIT_CONFIG.items() if not k.startswith("_")}
    vae_cfg = {k: v for k, v in TINY_VAE_CONFIG.items() if not k.startswith("_")}
    # Non-trivial latent statistics, so the (de)normalisation is exercised.
    gen = torch.Generator().manual_seed(3)
    vae_cfg["latents_mean"] = (torch.randn(48, generator=gen) * 0.3).tolist()
    vae_cfg["latents_std"] = (torch.rand(48, generator=gen) + 0.5).tolist()
    dit = WanTransformer3DModel(**dit_cfg)
    _randomise(dit, seed=4)
    dit.save_pretrained(str(root / "transformer"))
    vae = AutoencoderKLWan(**vae_cfg)
    _randomise(vae, seed=5)
    vae.save_pretrained(str(root / "vae"))
    return root, dit.eval(), vae.eval()


def _ours(root: Path) -> PAN2Pipeline:
    config = PAN2PipelineConfig(device="cpu", dtype=torch.float32)
    return PAN2Pipeline(dit=load_dit(root), vae=load_vae(root), text_encoder=None,
                        scheduler_config=SchedulerConfig.from_dict(SCHEDULER_CONFIG), config=config,
                        model_id="reference-test", expand_timesteps=False)


def test_guided_sampling_matches_diffusers_wanpipeline(reference_checkpoint) -> None:
    from diffusers import UniPCMultistepScheduler, WanPipeline

    root, ref_dit, ref_vae = reference_checkpoint
    scheduler_kwargs = {k: v for k, v in SCHEDULER_CONFIG.items() if not k.startswith("_")}
    ref_pipe = WanPipeline(
        tokenizer=None, text_encoder=None,
        transformer=ref_dit, vae=ref_vae,
        scheduler=UniPCMultistepScheduler(**scheduler_kwargs),
    )
    gen = torch.Generator().manual_seed(11)
    cond = torch.randn(1, 512, TINY_DIT_CONFIG["text_dim"], generator=gen)
    uncond = torch.randn(1, 512, TINY_DIT_CONFIG["text_dim"], generator=gen)
    kwargs = dict(height=64, width=96, frames=17, steps=4, guidance=2.5, seed=7)
    ref = ref_pipe(prompt_embeds=cond, negative_prompt_embeds=uncond, height=64, width=96,
                   num_frames=17, num_inference_steps=4, guidance_scale=2.5,
                   generator=torch.Generator().manual_seed(7), output_type="latent").frames
    ours = _ours(root).sample(prompt_embeds=cond[0], negative_prompt_embeds=uncond[0], **kwargs)
    err = _max_rel(ours, ref[0])
    print(f"4-step guided UniPC sampling vs WanPipeline: max rel err {err:.2e}, shape {list(ours.shape)}")
    assert ours.shape == ref[0].shape == (48, 5, 4, 6)
    assert err <= 1e-4
    # The comparison can tell guidance apart: 2.4 instead of 2.5 is far outside the tolerance.
    off = _ours(root).sample(prompt_embeds=cond[0], negative_prompt_embeds=uncond[0],
                             **dict(kwargs, guidance=2.4))
    print(f"same with guidance 2.4 instead of 2.5: max rel err {_max_rel(off, ref[0]):.2e}")
    assert _max_rel(off, ref[0]) > 10 * 1e-4


def test_decode_matches_diffusers_decode(reference_checkpoint) -> None:
    root, _, ref_vae = reference_checkpoint
    pipe = _ours(root)
    latents = torch.randn(48, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    frames = pipe.decode(latents)
    mean = torch.tensor(ref_vae.config.latents_mean).view(1, 48, 1, 1, 1)
    std = torch.tensor(ref_vae.config.latents_std).view(1, 48, 1, 1, 1)
    with torch.no_grad():
        video = ref_vae.decode(latents[None] * std + mean).sample  # [1, 3, F, H, W]
    ref = ((video[0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0)
    diff = (frames.int() - ref.int()).abs().max().item()
    print(f"decode to uint8 vs diffusers: max abs diff {diff} (of 255), shape {list(frames.shape)}")
    assert frames.dtype == torch.uint8 and frames.shape == (9, 64, 64, 3)
    assert diff <= 1  # rounding boundary only


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> PAN2Pipeline:
    import os

    os.environ["PAN2_RENDER_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    t0 = time.perf_counter()
    pipe = PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cpu"))
    print(f"tiny model: first build + load {time.perf_counter() - t0:.2f} s")
    return pipe


def test_tiny_model_renders_in_seconds(tiny: PAN2Pipeline) -> None:
    from pan2render.models.tiny import tiny_model_folder

    root = tiny_model_folder()
    for part in ("model_index.json", "transformer/config.json", "vae/diffusion_pytorch_model.safetensors",
                 "text_encoder/config.json", "tokenizer/tokenizer.json", "scheduler/scheduler_config.json"):
        assert (root / part).is_file(), part
    t0 = time.perf_counter()
    reloaded = PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cpu"))
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    steps_seen = []
    latents = reloaded.sample(prompt="a red fox in the snow", height=64, width=64, frames=17, steps=8,
                              guidance=2.5, seed=3, progress=lambda i, n: steps_seen.append((i, n)))
    t_sample = time.perf_counter() - t0
    t0 = time.perf_counter()
    frames = reloaded.decode(latents)
    t_decode = time.perf_counter() - t0
    print(f"tiny model on CPU: load {t_load:.2f} s, 8-step guided sample {t_sample:.2f} s, "
          f"decode {t_decode:.2f} s (17x64x64)")
    assert latents.shape == (48, 5, 4, 4) and latents.dtype == torch.float32
    assert frames.shape == (17, 64, 64, 3) and frames.dtype == torch.uint8
    assert steps_seen == [(i, 8) for i in range(1, 9)]
    assert reloaded.model_id == tiny.model_id and reloaded.model_id.startswith("tiny-v")
    # Deterministic: the same request gives the same latents; another seed does not.
    again = tiny.sample(prompt="a red fox in the snow", height=64, width=64, frames=17, steps=8,
                        guidance=2.5, seed=3)
    other = tiny.sample(prompt="a red fox in the snow", height=64, width=64, frames=17, steps=8,
                        guidance=2.5, seed=4)
    assert torch.equal(again, latents)
    assert not torch.allclose(other, latents)


def test_prompt_embeddings_are_zero_past_the_prompt(tiny: PAN2Pipeline) -> None:
    emb = tiny.encode_prompt("a cat")
    assert emb.shape == (512, 32) and emb.dtype == torch.float32
    nonzero = emb.abs().sum(-1) > 0
    assert nonzero[:6].all() and not nonzero[6:].any()  # 5 byte tokens + </s>


def test_guidance_one_runs_one_forward_per_step(tiny: PAN2Pipeline, monkeypatch) -> None:
    calls = []
    forward = tiny.dit.forward
    monkeypatch.setattr(tiny.dit, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    tiny.sample(prompt="x", height=32, width=32, frames=5, steps=3, guidance=1.0, seed=0)
    assert len(calls) == 3
    calls.clear()
    tiny.sample(prompt="x", height=32, width=32, frames=5, steps=3, guidance=2.0, seed=0)
    assert len(calls) == 6


def test_non_finite_latents_name_the_step(tiny: PAN2Pipeline, monkeypatch) -> None:
    calls = []
    forward = tiny.dit.forward

    def poisoned(*a, **k):
        calls.append(1)
        out = forward(*a, **k)
        return out * float("nan") if len(calls) == 3 else out

    monkeypatch.setattr(tiny.dit, "forward", poisoned)
    with pytest.raises(FloatingPointError, match=r"non-finite latents at step 3 of 4"):
        tiny.sample(prompt="x", height=32, width=32, frames=5, steps=4, guidance=1.0, seed=0)


@pytest.mark.parametrize("bad, message", [
    (dict(frames=16), "frames=16: must be 4k+1"),
    (dict(height=48), "height=48: must be a positive multiple of 32"),
    (dict(width=0), "width=0: must be a positive multiple of 32"),
    (dict(steps=0), "steps=0: must be an integer >= 1"),
    (dict(guidance=0.5), "guidance=0.5: must be a number >= 1"),
    (dict(seed=-1), "seed=-1: must be a non-negative integer"),
    (dict(seed=1.5), "seed=1.5: must be a non-negative integer"),
    (dict(sampler="ddim"), "sampler='ddim': must be one of unipc, euler"),
])
def test_bad_requests_are_refused(tiny: PAN2Pipeline, bad: dict, message: str) -> None:
    req = dict(prompt="x", height=32, width=32, frames=5, steps=2, guidance=1.0, seed=0)
    req.update(bad)
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny.sample(**req)


def test_first_frame_image_is_imposed(tiny: PAN2Pipeline, monkeypatch) -> None:
    image = np.random.default_rng(0).integers(0, 256, size=(40, 50, 3), dtype=np.uint8)
    timesteps = []
    forward = tiny.dit.forward
    monkeypatch.setattr(tiny.dit, "forward", lambda x, t, c: timesteps.append(t.cpu()) or forward(x, t, c))
    latents = tiny.sample(prompt="x", image=image, height=32, width=64, frames=9, steps=3,
                          guidance=2.0, seed=1)
    monkeypatch.undo()
    # Per-token timesteps [1, L]: the first latent frame's (32/16/2)*(64/16/2) = 2 tokens are clean
    # (0), the other 2 latent frames' 4 tokens at the step's t (9 frames = 3 latent frames).
    assert len(timesteps) == 6 and all(t.shape == (1, 6) for t in timesteps)
    for t in timesteps:
        assert (t[0, :2] == 0).all() and (t[0, 2:] == t[0, 2]).all() and t[0, 2] > 0
    first = tiny.encode_image(image, height=32, width=64)[0, :, 0].cpu()
    assert torch.allclose(latents[:, 0], first)
    plain = tiny.sample(prompt="x", height=32, width=64, frames=9, steps=3, guidance=2.0, seed=1)
    assert not torch.allclose(plain[:, 1:], latents[:, 1:])  # the image conditions the rest


def test_euler_sampler_runs_and_differs(tiny: PAN2Pipeline) -> None:
    req = dict(prompt="x", height=32, width=32, frames=5, steps=4, guidance=2.0, seed=0)
    a = tiny.sample(sampler="unipc", **req)
    b = tiny.sample(sampler="euler", **req)
    assert torch.isfinite(b).all() and not torch.allclose(a, b)


def test_fused_kernel_switch_is_per_pipeline(tiny: PAN2Pipeline) -> None:
    from pan2render.models.dit_ops import ROUTED_OPS, TORCH_OPS

    plain = PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cpu", dit_fused_kernels=False))
    fused = PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cpu", dit_fused_kernels=True))
    assert plain.dit.ops is TORCH_OPS and fused.dit.ops is ROUTED_OPS  # loading one leaves the other


def test_image_refused_by_a_checkpoint_without_first_frame_conditioning(tiny: PAN2Pipeline) -> None:
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    tiny.expand_timesteps = False
    try:
        with pytest.raises(ValueError, match="not trained for first-frame conditioning"):
            tiny.sample(prompt="x", image=image, height=32, width=32, frames=5, steps=1, guidance=1.0, seed=0)
    finally:
        tiny.expand_timesteps = True


def test_fp32_residual_switch_is_per_pipeline_and_validated() -> None:
    from pan2render.models.dit import PAN2DiT, PAN2DiTConfig

    config = PAN2DiTConfig(num_attention_heads=2, attention_head_dim=6, text_dim=8, freq_dim=8, ffn_dim=8,
                           num_layers=1)
    dits = {}
    for on in (True, False):
        dits[on] = PAN2DiT(config)
        PAN2Pipeline(dit=dits[on], vae=None, text_encoder=None, scheduler_config=SchedulerConfig(),
                     config=PAN2PipelineConfig(device="cpu", dit_fp32_residual=on), model_id="residual-test")
    assert dits[True].residual_dtype is torch.float32 and dits[False].residual_dtype is None
    assert PAN2PipelineConfig(device="cpu").dit_fp32_residual is True  # on by default
    with pytest.raises(ValueError, match=r"dit_fp32_residual='no': expected True or False"):
        PAN2PipelineConfig(device="cpu", dit_fp32_residual="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dit_fused_kernels=1: expected True or False"):
        PAN2PipelineConfig(device="cpu", dit_fused_kernels=1)  # type: ignore[arg-type]


def test_strategies_come_from_the_config_or_the_caller(tiny: PAN2Pipeline) -> None:
    """The pipeline samples and decodes only through the denoiser and frame decoder it was built
    with: the single-process ones its config selects, or the caller's."""
    from pan2render.models.strategies import FastDecoder, ReferenceDecoder, SeparateGuidance

    assert type(tiny.frame_decoder) is FastDecoder  # vae_decode_kernel on by default (falls back on the CPU)
    off = PAN2Pipeline(dit=tiny.dit, vae=tiny.vae, text_encoder=None, scheduler_config=tiny.scheduler_config,
                       config=PAN2PipelineConfig(device="cpu", vae_decode_kernel=False), model_id="off")
    assert type(off.frame_decoder) is ReferenceDecoder
    assert off.describe()["decode"] == "reference decoder (vae_decode_kernel is off)"
    assert not any(hasattr(tiny, name) for name in ("process_group", "guidance_split", "parallelize"))

    class Counting(SeparateGuidance):
        def __init__(self, dit) -> None:
            super().__init__(dit)
            self.jobs: list[bool] = []
            self.steps = 0

        def prepare(self, cond, uncond, guidance):
            self.jobs.append(uncond is not None)
            velocity = super().prepare(cond, uncond, guidance)

            def counted(x, t):
                self.steps += 1
                return velocity(x, t)

            return counted

    class NoFrames:  # as on a rank that does not hold the frames
        def decode(self, z):
            self.shape = tuple(z.shape)
            return None

        def describe(self) -> str:
            return "elsewhere"

    denoiser, decoder = Counting(tiny.dit), NoFrames()
    custom = tiny.with_strategies(denoiser=denoiser, frame_decoder=decoder)
    assert custom.dit is tiny.dit and tiny.denoiser is not denoiser  # shared models, own strategies
    req = dict(prompt="x", height=32, width=32, frames=5, steps=3, seed=0)
    latents = custom.sample(guidance=2.0, **req)
    custom.sample(guidance=1.0, **req)
    assert denoiser.jobs == [True, False] and denoiser.steps == 6
    assert torch.equal(latents, tiny.sample(guidance=2.0, **req))
    assert custom.decode(latents) is None and decoder.shape == (1, 48, 2, 2, 2)
    assert custom.describe()["decode"] == "elsewhere"
    assert {k: tiny.describe()[k] for k in ("ranks", "guided_steps", "unguided_steps")} == \
        {"ranks": 1, "guided_steps": "one rank", "unguided_steps": "one rank"}


@pytest.mark.parametrize("batched, forwards", [(False, [1]), (True, [2])])
def test_the_warm_up_decodes_first_then_steps_once_with_the_cheapest_covering_guidance(
        tiny: PAN2Pipeline, monkeypatch, batched: bool, forwards: list[int]) -> None:
    """`warm_up`'s steps (run on the CPU here; `warm_up` itself skips them there): the decode of
    zero latents first (it needs only the VAE, so it overlaps FlashAttention-4's import on a GPU),
    then the attention's compile, then one euler step at the job's size, then one more conditioned
    on a frame (its encode, its per-token timesteps). A guided job's step on
    one process is two batch-1 forwards, so one unguided forward covers its shapes; a denoiser whose
    guided step is one batch-2 forward (as a group's guidance split has shapes of its own) says so
    through ``warm_up_guidance``, and the warm-up then runs a guided step."""
    from pan2render.models.strategies import SeparateGuidance, apply_guidance
    from pan2render.phases import recording

    class OneBatchGuidance(SeparateGuidance):
        def prepare(self, cond, uncond, guidance):
            if uncond is None:
                return super().prepare(cond, None, guidance)
            both = self.dit.prepare_context(torch.cat([cond, uncond]))
            return lambda x, t: apply_guidance(*self.dit(torch.cat([x, x]), t.expand(2, *t.shape[1:]), both)
                                               .chunk(2), guidance)

        def warm_up_guidance(self, guidance):
            return guidance

    pipe = tiny.with_strategies(denoiser=(OneBatchGuidance if batched else SeparateGuidance)(tiny.dit))
    batches: list[int] = []
    real_forward = type(tiny.dit).forward

    def counting(self, x, *args, **kwargs):
        batches.append(x.shape[0])
        return real_forward(self, x, *args, **kwargs)

    monkeypatch.setattr(type(tiny.dit), "forward", counting)
    attention: list[bool] = []
    monkeypatch.setattr(PAN2Pipeline, "warm_up_attention", lambda self: attention.append(True))
    decoded: list[torch.Tensor] = []
    with recording() as record:
        pipe._warm_up(height=32, width=64, frames=17, guidance=2.5, image=True, decode=decoded.append)
    assert [p.name for p in record.phases] == ["warm-up decode", "attention warm-up", "warm-up sampling",
                                               "warm-up image sampling"]
    assert [tuple(x.shape) for x in decoded] == [(48, 2, 2, 4)] and not decoded[0].any()
    assert attention == [True]
    # one step without a frame, one with: each one forward, of batch 1 unguided or 2 batched-guided
    assert batches == forwards * 2
    pipe.warm_up(height=32, width=64, frames=17, guidance=2.5, image=True, decode=decoded.append)  # CPU: nothing
    assert len(decoded) == 1 and batches == forwards * 2
    with recording() as text_only:  # a job of text alone: no step on a frame
        pipe._warm_up(height=32, width=64, frames=17, guidance=2.5, decode=decoded.append)
    assert [p.name for p in text_only.phases] == ["warm-up decode", "attention warm-up", "warm-up sampling"]
