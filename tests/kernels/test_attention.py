"""Attention backend choice: every backend usable here gives the same result, and a forced backend
that cannot run here (cuDNN / mem-efficient on CPU) falls back to the device's order."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn.attention import SDPBackend

from pan2render.kernels import attention as attn_mod
from pan2render.kernels.attention import AttentionConfig, attention, attention_backends, set_attention_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


@pytest.fixture(autouse=True)
def _auto():
    yield
    set_attention_backend("auto", short_kv_backend="auto")


def _qkv(batch: int = 2, heads: int = 3, lq: int = 37, lk: int = 11, dim: int = 64):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, dim, generator=g).to(DEVICE, DTYPE) for n in (lq, lk, lk))
    return q, k, v


def _math(q, k, v):
    scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.softmax(-1) @ v.float()


def test_auto_order_on_this_device() -> None:
    q, k, v = _qkv()
    order = attention_backends(q, k, v)
    print("order:", [b.name for b in order])
    assert order[-1] == SDPBackend.MATH
    if DEVICE == "cpu":
        assert SDPBackend.CUDNN_ATTENTION not in order and SDPBackend.EFFICIENT_ATTENTION not in order
    elif torch.cuda.get_device_capability()[0] == 9:
        assert order[0] == SDPBackend.CUDNN_ATTENTION


@pytest.mark.parametrize("backend", ["auto", "cudnn", "flash", "efficient", "math"])
def test_every_backend_gives_the_same_result(backend: str, caplog) -> None:
    q, k, v = _qkv()
    set_attention_backend(backend)
    with caplog.at_level(logging.WARNING, logger=attn_mod.__name__):
        out = attention(q, k, v)
    want = _math(q, k, v)
    rel = float((out.float() - want).abs().max() / want.abs().max())
    print(f"{backend}: rel {rel:.3g}")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel < (2e-2 if DTYPE == torch.bfloat16 else 1e-5)


def test_forced_backend_falls_back_cleanly_on_cpu(caplog) -> None:
    q, k, v = (t.cpu().float() for t in _qkv())
    attn_mod._warned.clear()
    set_attention_backend("cudnn")
    with caplog.at_level(logging.WARNING, logger=attn_mod.__name__):
        order = attention_backends(q, k, v)
        out = attention(q, k, v)
        attention(q, k, v)
    assert order == [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    warnings = [r for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warnings) == 1, "the fallback is logged once, not per call"
    assert torch.allclose(out, _math(q, k, v), atol=1e-5)


def test_config_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown"):
        AttentionConfig(backend="fa3")
