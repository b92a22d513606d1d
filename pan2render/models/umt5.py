"""umT5's encoder (the text encoder of Wan2.2), our own module with transformers' state-dict keys.

Importing transformers took ~10 s in a fresh process on the GPU host, on the critical path of every
model load, for a forward that is a few dozen lines. This module computes what transformers'
``UMT5EncoderModel`` computes, op for op in the same dtypes, and holds its tensors under the same
names, so a ``text_encoder/`` folder written for transformers loads unchanged:

    shared.weight                                              token embedding
    encoder.embed_tokens.weight                                the same tensor (tied)
    encoder.block.{i}.layer.0.layer_norm.weight                RMSNorm before self-attention
    encoder.block.{i}.layer.0.SelfAttention.{q,k,v,o}.weight   no biases
    encoder.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight
                                                               [num_buckets, num_heads], every layer its own
    encoder.block.{i}.layer.1.layer_norm.weight                RMSNorm before the FFN
    encoder.block.{i}.layer.1.DenseReluDense.{wi_0,wi_1,wo}.weight
                                                               gated-GELU FFN
    encoder.final_layer_norm.weight

The math, T5's: RMSNorm without mean or bias (variance in fp32); attention scores NOT scaled by
1/sqrt(d_kv) (T5 folds the scale into its initialisation), plus a learned bias per head indexed by a
bucketed relative position (exact buckets near, log-spaced buckets up to ``max_distance``, split by
direction); the padding mask added to the scores; FFN ``wo(gelu_tanh(wi_0 x) * wi_1 x)``. Inference
only: no dropout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .loading import ModelFolderError, instantiate, read_json

# transformers keeps these in fp32 when a umT5 is loaded in fp16 (its ``_keep_in_fp32_modules``; T5
# models' FFN outputs are known to overflow fp16). Under bf16 everything is bf16, as transformers
# loads it.
KEEP_FP32_UNDER_FP16 = ("wo",)

# The feed-forward kind our module implements (transformers' name for it in config.json).
GATED_GELU = "gated-gelu"


@dataclass(frozen=True)
class UMT5Config:
    """The fields of a umT5 ``config.json`` the encoder's forward depends on.

    A field config.json leaves out takes transformers' default (``UMT5Config``), as transformers
    would load the same file; a field of the wrong type or out of range is a ModelFolderError naming
    the file and the field."""

    vocab_size: int = 250112
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 1024
    num_layers: int = 8
    num_heads: int = 6
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = GATED_GELU

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str | Path = "config.json") -> "UMT5Config":
        def bad(name: str, why: str) -> ModelFolderError:
            return ModelFolderError(f"{where}: field '{name}' {why}, found {data.get(name)!r}")

        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if f.type == "int":
                if type(value) is not int or value <= 0:
                    raise bad(f.name, "must be a positive integer")
            elif f.type == "float":
                if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                    raise bad(f.name, "must be a finite number >= 0")
                value = float(value)
            values[f.name] = value
        config = cls(**values)
        if config.feed_forward_proj != GATED_GELU:
            raise bad("feed_forward_proj", f"must be '{GATED_GELU}' (the only FFN this encoder implements)")
        # transformers derives dense_act_fn and is_gated_act from feed_forward_proj, but a value
        # written in config.json overrides the derived one; is_decoder true makes its encoder stack
        # causal with one-directional buckets. Any of these would change the forward we compute.
        for name, want in (("dense_act_fn", "gelu_new"), ("is_gated_act", True), ("is_decoder", False)):
            if name in data and data[name] != want:
                raise bad(name, f"must be {want!r} for a umT5 encoder (or left out)")
        half = config.relative_attention_num_buckets // 2
        if half // 2 < 1:
            raise bad("relative_attention_num_buckets", "must be at least 4 (two directions, exact and log buckets)")
        if config.relative_attention_max_distance <= half // 2:
            raise bad("relative_attention_max_distance",
                      f"must exceed the exact buckets' range ({half // 2}) for the log-spaced buckets")
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "UMT5Config":
        path = Path(path)
        return cls.from_dict(read_json(path), where=path)


def embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding table left uninitialised: the checkpoint fills it. (nn.Embedding's own random
    init, on the meta device, goes through torch's reference ops and imports torch._dynamo: ~2 s of a
    fresh process's load on a 2-core machine.)"""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class RMSNorm(nn.Module):
    """T5's layer norm: scale by the root mean square (accumulated in fp32), no mean, no bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        # Back to the weight's dtype when that is half precision, as transformers does; an fp32
        # weight keeps the fp32 result (whatever the input's dtype was).
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation, written out as transformers' ``gelu_new`` computes it: the same
    elementwise ops in the input's dtype, so bf16 results round as they do there (a fused
    ``F.gelu(approximate="tanh")`` rounds once and can differ in the last bf16 bit)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Attention(nn.Module):
    def __init__(self, config: UMT5Config):
        super().__init__()
        self.num_heads = config.num_heads
        self.d_kv = config.d_kv
        self.q = nn.Linear(config.d_model, config.inner_dim, bias=False)
        self.k = nn.Linear(config.d_model, config.inner_dim, bias=False)
        self.v = nn.Linear(config.d_model, config.inner_dim, bias=False)
        self.o = nn.Linear(config.inner_dim, config.d_model, bias=False)
        self.relative_attention_bias = embedding(config.relative_attention_num_buckets, config.num_heads)

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """``x`` [B, L, D]; ``buckets`` [L, L] relative-position buckets; ``keep`` [B, 1, 1, L] bool,
        False at padded keys (None: no padding)."""
        b, n = x.shape[:2]
        q, k, v = (proj(x).view(b, n, self.num_heads, self.d_kv).transpose(1, 2) for proj in (self.q, self.k, self.v))
        bias = self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, H, L, L]
        if keep is not None:
            # Padded keys get the dtype's lowest value in place of their bias: exp() of it is 0.
            bias = torch.where(keep, bias, torch.finfo(k.dtype).min)
        # Bias and mask go in as SDPA's additive float mask; scale=1.0: T5 does not scale the scores.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.contiguous(), scale=1.0)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


class GatedGeluFFN(nn.Module):
    def __init__(self, config: UMT5Config):
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = gelu_tanh(self.wi_0(x)) * self.wi_1(x)
        # wo is fp32 in an fp16 model (KEEP_FP32_UNDER_FP16): its input goes up to fp32 with it.
        return self.wo(h.to(self.wo.weight.dtype))


class SelfAttentionLayer(nn.Module):
    def __init__(self, config: UMT5Config):
        super().__init__()
        self.SelfAttention = Attention(config)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        return x + self.SelfAttention(self.layer_norm(x), buckets, keep)


class FeedForwardLayer(nn.Module):
    def __init__(self, config: UMT5Config):
        super().__init__()
        self.DenseReluDense = GatedGeluFFN(config)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


def clamp_fp16(x: torch.Tensor) -> torch.Tensor:
    """transformers' guard after each sublayer of an fp16 umT5: an inf in the residual stream
    becomes a large finite value (max - 1000) so the next norm does not turn it into NaN."""
    if x.dtype != torch.float16:
        return x
    top = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(x).any(), top - 1000, top)
    return torch.clamp(x, min=-limit, max=limit)


class Block(nn.Module):
    def __init__(self, config: UMT5Config):
        super().__init__()
        self.layer = nn.ModuleList([SelfAttentionLayer(config), FeedForwardLayer(config)])

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        x = clamp_fp16(self.layer[0](x, buckets, keep))
        return clamp_fp16(self.layer[1](x))


class Stack(nn.Module):
    def __init__(self, config: UMT5Config):
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.d_model)
        self.block = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)


def relative_position_buckets(length: int, num_buckets: int, max_distance: int,
                              device: torch.device | None = None) -> torch.Tensor:
    """``[length, length]`` bucket of each (query, key) pair for a bidirectional encoder.

    Half the buckets are for keys after the query, half for keys at or before it. Within a half,
    distances below ``half // 2`` have a bucket each; longer ones share log-spaced buckets, the last
    holding every distance from about ``max_distance`` on. The float ops are transformers' own, in
    its order, so a distance on a bucket boundary truncates to the same bucket."""
    position = torch.arange(length, dtype=torch.long, device=device)
    relative = position[None, :] - position[:, None]  # key - query
    half = num_buckets // 2
    buckets = (relative > 0).to(torch.long) * half
    distance = relative.abs()
    exact = half // 2
    # Distances below `exact` would take log(0) here; torch.where below does not use them.
    log_ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact) * (half - exact)
    far = torch.clamp(exact + log_ratio.to(torch.long), max=half - 1)
    return buckets + torch.where(distance < exact, distance, far)


class UMT5Encoder(nn.Module):
    """umT5's encoder stack: token ids [B, L] (and a 0/1 attention mask) -> last hidden state
    [B, L, d_model], after the final norm. Build it on the meta device and fill it with
    `load_umt5_encoder`."""

    def __init__(self, config: UMT5Config):
        super().__init__()
        self.config = config
        self.shared = embedding(config.vocab_size, config.d_model)
        self.encoder = Stack(config)
        self.encoder.embed_tokens.weight = self.shared.weight  # tied, as in transformers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.encoder.embed_tokens(input_ids)
        length = input_ids.shape[1]
        buckets = relative_position_buckets(length, self.config.relative_attention_num_buckets,
                                            self.config.relative_attention_max_distance, device=input_ids.device)
        # [B, 1, 1, L]: every query, every head. A mask of all ones changes nothing (torch.where
        # keeps every bias) and is not checked for on the host, which would wait for the GPU.
        keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for block in self.encoder.block:
            x = block(x, buckets, keep)
        return self.encoder.final_layer_norm(x)


def load_umt5_encoder(folder: str | Path, *, device: str | torch.device, dtype: torch.dtype) -> UMT5Encoder:
    """`UMT5Encoder` from a ``text_encoder/`` folder (``config.json`` + ``model.safetensors`` or
    its shards), read by our reader (`checkpoint.instantiate`: built on the meta device, tensors
    streamed onto ``device`` and cast there, no CPU copy of the 11 GB encoder). Dtypes and ties are
    what ``UMT5EncoderModel.from_pretrained(folder, dtype=dtype)`` gives:

    - under fp16 the FFN output projections stay fp32 (KEEP_FP32_UNDER_FP16);
    - ``encoder.embed_tokens`` is the ``shared`` embedding (one tensor under two names), and a
      checkpoint holds it under either name or both (Wan's and save_pretrained's hold
      ``shared.weight``; the tiny one ``encoder.embed_tokens.weight``). One name fills both; both
      with equal values are tied as one; both with different values are kept apart (the encoder
      reads ``encoder.embed_tokens``), as transformers does.

    A key the model lacks, a missing key (which from_pretrained would initialise at random) or a
    shape that does not fit is a ModelFolderError naming the folder, as for our other models.
    """
    folder = Path(folder)
    try:
        config = UMT5Config.from_file(folder / "config.json")
    except ModelFolderError as e:
        raise ModelFolderError(f"{folder}: cannot build the UMT5 encoder from its config.json ({e})") from e
    return instantiate(lambda: UMT5Encoder(config), folder, device=device, dtype=dtype, prefix="model",
                       keep_in_fp32=KEEP_FP32_UNDER_FP16 if dtype == torch.float16 else ())
