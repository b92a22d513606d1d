"""The DiT replayed from CUDA graphs (`pan2render.models.graphs`): who gets graphs, and on a GPU,
that a replay gives the eager forward's output bit for bit, per context, with old graphs dropped."""

from __future__ import annotations

import pytest
import torch

from pan2render.models.dit import PAN2DiT, PAN2DiTConfig
from pan2render.models.graphs import CUDAGraphDiT, local_dit
from pan2render.models.pipeline import PAN2PipelineConfig, default_denoiser

TINY = PAN2DiTConfig(num_attention_heads=3, attention_head_dim=20, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)


def _model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> PAN2DiT:
    torch.manual_seed(0)
    return PAN2DiT(TINY).to(device, dtype).eval()


def test_only_a_cuda_model_with_graphs_on_is_wrapped() -> None:
    model = _model()
    assert local_dit(model, graphs=True) is model  # CPU weights: nothing to capture
    assert local_dit(model, graphs=False) is model
    cpu = PAN2PipelineConfig(device="cpu")
    assert default_denoiser(model, cpu).dit is model


def test_the_wrapper_runs_the_model_eagerly_off_cuda() -> None:
    model = _model()
    graphed = CUDAGraphDiT(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, TINY.in_channels, 2, 4, 4, generator=g)
    cache = graphed.prepare_context(torch.randn(1, 7, TINY.text_dim, generator=g))
    t = torch.tensor([500.0])
    with torch.no_grad():
        assert torch.equal(graphed(x, t, cache), model(x, t, cache))
        graphed(x, t, cache)
    assert graphed.captures == 0 and graphed.disabled_because is None


@pytest.mark.gpu
def test_replays_equal_the_eager_forward_bit_for_bit() -> None:
    model = _model("cuda", torch.bfloat16)
    model.set_residual_dtype(torch.float32)
    graphed = CUDAGraphDiT(model, max_graphs=2)
    g = torch.Generator().manual_seed(1)

    def inputs(seed: int):
        g.manual_seed(seed)
        return (torch.randn(1, TINY.in_channels, 3, 8, 6, generator=g).cuda().bfloat16(),
                torch.randn(1, 7, TINY.text_dim, generator=g).cuda().bfloat16())

    x, text = inputs(1)
    _, text_u = inputs(2)
    cond, uncond = graphed.prepare_context(text), graphed.prepare_context(text_u)
    with torch.no_grad():
        for step, t in enumerate((999.0, 750.5, 500.0)):
            ts = torch.tensor([t], device="cuda")
            xs = x * (step + 1)
            got_c, got_u = graphed(xs, ts, cond), graphed(xs, ts, uncond)
            assert torch.equal(got_c, model(xs, ts, cond)) and torch.equal(got_u, model(xs, ts, uncond))
        # step 0: cond eager (first call at the shape), uncond captured; step 1: cond captured
        assert graphed.captures == 2 and graphed.disabled_because is None
        # A new job's context: a third graph, the oldest dropped.
        _, text_n = inputs(3)
        new = graphed.prepare_context(text_n)
        ts = torch.tensor([250.0], device="cuda")
        assert torch.equal(graphed(x, ts, new), model(x, ts, new))
        assert graphed.captures == 3 and len(graphed._graphs) == 2
        # Per-token timesteps sync (torch.unique): run eagerly, nothing captured.
        per_token = torch.full((1, 3 * 4 * 3), 500.0, device="cuda")
        per_token[:, :12] = 0.0
        assert torch.equal(graphed(x, per_token, new), model(x, per_token, new))
        assert graphed.captures == 3
