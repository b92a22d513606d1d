"""PAN2 DiT: the Wan2.2-TI2V-5B video transformer as a plain torch module.

Same parameters, checkpoint keys and math as diffusers' ``WanTransformer3DModel``
(diffusers/models/transformers/transformer_wan.py, 0.42.1): a diffusers ``transformer/`` folder
loads with ``load_state_dict(strict=True)`` and the forward matches it (tests/models/test_dit.py).
Two numerics choices differ from diffusers, both for inference in bf16 and both measured on an H200
at 704x1248x121 (docs/performance.md, "DiT fused kernels"):

- ``PAN2DiT.set_residual_dtype(torch.float32)`` (``PAN2PipelineConfig.dit_fp32_residual``, on by
  default) keeps the residual stream in fp32 and rounds only what enters a linear. diffusers rounds
  the stream to bf16 after each of the 4 residual adds per block: rel. L2 vs a strict fp32
  forward 1.46e-2, over the 1e-2 we hold the bf16 DiT to; the fp32 stream gives 3.35e-3 for +7.5-9 ms per
  forward. The default (None) is diffusers' rounding, bit for bit.

What differs otherwise is the structure around the math, for the follow-up work:

- Per-token timesteps (first-frame conditioning): the time embedding and the 6-row modulation are
  computed once per DISTINCT timestep value and indexed per token (``TimestepConditioning``);
  diffusers builds a ``[B, L, 6, dim]`` fp32 table, 0.65 GB per block at 26,598 tokens, batch 2.
- The block's fusable steps go through a ``DiTOps`` table (``dit_ops.py``): the fused-kernel
  switch replaces it with ``PAN2DiT.set_ops``.
- Sequence parallelism (Ulysses) plugs in from outside: RoPE tables are computable for any token
  slice (``RotaryPosEmbed(start=, length=)``), the timestep index slices per token
  (``TimestepConditioning.for_tokens``), and self-attention has one call site
  (``SelfAttention.attention_fn``, an `AttentionOp`; by default `LocalAttention` over
  ``dit_ops.attention``) taking ``[B, heads, L, head_dim]``.
- Guidance: the cross-attention K/V depend only on the text; ``prepare_context`` computes them
  once per job into a ``ContextCache`` that ``forward`` accepts in place of the context.
- Fast lanes plug in through two declared seams, never by patching: ``forward(..., blocks=)``
  hands the block stack of one forward to a `BlockStack` (a step cache runs it and keeps the
  residual, or stands in for it with a kept one), and each per-token linear (`TokenLinear`) takes
  a `LinearOp` in place of its own matmul while one is set (FP8, ``pan2render.models.precision``).

Read bottom-up: config, RoPE, leaf modules, block, model.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan2render.models.dit_ops import ROUTED_OPS, TORCH_OPS, DiTOps, attention, rms_norm_heads
from pan2render.sampling import WAN22, is_int

__all__ = [
    "AttentionOp",
    "BlockStack",
    "ContextCache",
    "LinearOp",
    "LocalAttention",
    "PAN2DiT",
    "PAN2DiTBlock",
    "PAN2DiTConfig",
    "RotaryPosEmbed",
    "TimestepConditioning",
    "TokenLinear",
    "TokenWindow",
]

# diffusers' class name, written into config.json so diffusers can load what we save.
DIFFUSERS_CLASS_NAME = "WanTransformer3DModel"
SUPPORTED_QK_NORM = "rms_norm_across_heads"
ROPE_THETA = 10000.0  # WanRotaryPosEmbed's default; not a config key
TIMESTEP_MAX_PERIOD = 10000  # diffusers get_timestep_embedding's default


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PAN2DiTConfig:
    """DiT hyperparameters. Field names are diffusers' ``transformer/config.json`` keys (permanent
    API); defaults reproduce Wan2.2-TI2V-5B."""

    patch_size: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) latent cells per token
    num_attention_heads: int = 24
    attention_head_dim: int = 128  # RoPE splits it t/h/w = 44/42/42 (see rope_split)
    in_channels: int = 48  # latent channels (Wan2.2 VAE z_dim)
    out_channels: int | None = 48  # None means in_channels, as in diffusers
    text_dim: int = 4096  # umT5-XXL hidden size
    freq_dim: int = 256  # sinusoidal timestep embedding width
    ffn_dim: int = 14336
    num_layers: int = 30
    cross_attn_norm: bool = True  # affine LayerNorm before cross-attention (norm2)
    qk_norm: str | None = SUPPORTED_QK_NORM  # only RMSNorm across all heads is implemented
    eps: float = 1e-6  # every LayerNorm / RMSNorm
    image_dim: int | None = None  # Wan2.1-I2V CLIP image embedder: not supported
    added_kv_proj_dim: int | None = None  # Wan2.1-I2V image K/V: not supported
    rope_max_seq_len: int = WAN22.rope_extent  # largest token-grid extent per axis
    pos_embed_seq_len: int | None = None  # FLF2V image position embedding: not supported

    def __post_init__(self) -> None:
        patch = self.patch_size
        if not (isinstance(patch, (list, tuple)) and len(patch) == 3 and all(is_int(p) and p > 0 for p in patch)):
            raise ValueError(f"patch_size={patch!r}: expected 3 positive ints (t, h, w), e.g. [1, 2, 2]")
        object.__setattr__(self, "patch_size", tuple(patch))  # config.json holds a list
        for key in ("num_attention_heads", "attention_head_dim", "in_channels", "text_dim", "freq_dim",
                    "ffn_dim", "num_layers", "rope_max_seq_len"):
            value = getattr(self, key)
            if not (is_int(value) and value > 0):
                raise ValueError(f"{key}={value!r}: expected a positive int")
        if self.out_channels is not None and not (is_int(self.out_channels) and self.out_channels > 0):
            raise ValueError(f"out_channels={self.out_channels!r}: expected a positive int or null")
        if self.attention_head_dim % 2 or self.attention_head_dim < 6:
            raise ValueError(
                f"attention_head_dim={self.attention_head_dim}: 3-D RoPE needs an even head dim >= 6 "
                f"(it is split into even t/h/w parts); Wan2.2-TI2V-5B uses 128"
            )
        if self.freq_dim < 2:
            raise ValueError(f"freq_dim={self.freq_dim}: the sinusoidal embedding needs freq_dim >= 2")
        if not isinstance(self.cross_attn_norm, bool):
            raise ValueError(f"cross_attn_norm={self.cross_attn_norm!r}: expected true or false")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not self.eps > 0:
            raise ValueError(f"eps={self.eps!r}: expected a positive float, e.g. 1e-6")
        # diffusers ignores qk_norm and always builds across-heads RMSNorm; a checkpoint that names
        # another norm was not trained for this layout, so refuse it rather than run it wrong.
        if self.qk_norm != SUPPORTED_QK_NORM:
            raise ValueError(
                f"qk_norm={self.qk_norm!r} is not supported: only {SUPPORTED_QK_NORM!r} (RMSNorm over "
                f"all heads, the Wan2.2 layout) is implemented; set qk_norm to {SUPPORTED_QK_NORM!r}"
            )
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            value = getattr(self, key)
            if value is not None:
                raise ValueError(
                    f"{key}={value!r} is not supported: PAN2 implements the text-conditioned "
                    f"Wan2.2-TI2V-5B transformer, without the Wan2.1 I2V/FLF2V image branch; "
                    f"{key} must be null"
                )

    @property
    def inner_dim(self) -> int:
        """Model width: heads x head_dim (3072 for Wan2.2-TI2V-5B)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def num_out_channels(self) -> int:
        return self.in_channels if self.out_channels is None else self.out_channels

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Head-dim lanes given to t / h / w RoPE, as diffusers: h = w = 2 * (D // 6), t the rest."""
        hw = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - 2 * hw, hw, hw

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PAN2DiTConfig:
        """Build from a diffusers ``config.json`` dict; ``_``-prefixed metadata keys
        (``_class_name``, ``_diffusers_version``, ...) are ignored, unknown keys raise."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if not k.startswith("_") and k not in known)
        if unknown:
            listed = ", ".join(f"{k}={data[k]!r}" for k in unknown)
            raise ValueError(
                f"unknown DiT config key(s) {listed}: supported keys are {sorted(known)} "
                f"(the WanTransformer3DModel config.json layout)"
            )
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        """The diffusers ``config.json`` dict (loads in diffusers' WanTransformer3DModel too)."""
        out: dict[str, Any] = {"_class_name": DIFFUSERS_CLASS_NAME}
        out.update(dataclasses.asdict(self))
        out["patch_size"] = list(self.patch_size)
        return out



# ---------------------------------------------------------------------------------------------
# Positional and timestep embeddings
# ---------------------------------------------------------------------------------------------


class RotaryPosEmbed(nn.Module):
    """3-D RoPE angles for the flattened token grid, for any contiguous slice of the sequence.

    Token n of a (frames, height, width) grid sits at (n // (h*w), (n // w) % h, n % w); its
    head-dim pairs get t / h / w angles in `rope_split` proportions. Angles are computed in float64
    and rounded to fp32 once, exactly as diffusers' WanRotaryPosEmbed tables, so a sequence shard
    (``start``, ``length``) gets bit-identical values to the same rows of the full table. No
    parameters or buffers: nothing in the state dict, nothing a ``.to(bfloat16)`` can degrade.
    """

    def __init__(self, *, split: tuple[int, int, int], max_seq_len: int, theta: float = ROPE_THETA) -> None:
        super().__init__()
        self.split = split
        self.max_seq_len = max_seq_len
        self.theta = theta

    def forward(
        self,
        grid: tuple[int, int, int],
        *,
        start: int = 0,
        length: int | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Returns (cos, sin), each ``[length, head_dim // 2]`` fp32, for tokens [start, start+length)."""
        frames, height, width = grid
        total = frames * height * width
        length = total - start if length is None else length
        if start < 0 or length < 0 or start + length > total:
            raise ValueError(f"token slice [{start}, {start + length}) is outside the {total} tokens of grid {grid}")
        if max(grid) > self.max_seq_len:
            raise ValueError(
                f"token grid {grid} exceeds rope_max_seq_len={self.max_seq_len} on an axis; "
                f"render a smaller latent or raise rope_max_seq_len in the config"
            )
        n = torch.arange(start, start + length, device=device)
        positions = (n // (height * width), (n // width) % height, n % width)
        angles = [
            torch.outer(pos, self._inv_freq(dim, n.device)) for pos, dim in zip(positions, self.split)
        ]  # each [length, dim/2] float64
        angle = torch.cat(angles, dim=1)
        return angle.cos().float(), angle.sin().float()

    def _inv_freq(self, dim: int, device: torch.device) -> Tensor:
        # Same float64 expression as diffusers get_1d_rotary_pos_embed, so the angles agree bit-wise.
        return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))


def timestep_sinusoid(timesteps: Tensor, *, dim: int) -> Tensor:
    """[cos | sin] embedding of 1-D timesteps ``[U]`` -> ``[U, dim]`` fp32 (diffusers Timesteps with
    flip_sin_to_cos=True, downscale_freq_shift=0)."""
    half = dim // 2
    exponent = -math.log(TIMESTEP_MAX_PERIOD) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / half)
    args = timesteps[:, None].float() * freqs[None, :]  # [U, half]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


@dataclass(frozen=True)
class TimestepConditioning:
    """Time embedding per timestep row, and the map from tokens to those rows.

    ``temb`` ``[U, dim]`` and ``projection`` ``[U, 6, dim]`` (compute dtype) hold one row per
    sample (per-sample timesteps, ``index`` ``[B]``) or per distinct value (per-token timesteps,
    ``index`` ``[B, L]``); ``index`` is int64. U is 1-3 in practice (0 for the image tokens, t per
    sample), so per-block modulation is ``[U, 6, dim]`` instead of diffusers' ``[B, L, 6, dim]``.
    """

    temb: Tensor
    projection: Tensor
    index: Tensor

    def for_tokens(self, start: int, length: int) -> TimestepConditioning:
        """The same conditioning for a slice of the sequence (a sequence-parallel shard)."""
        if self.index.ndim == 1:
            return self
        return dataclasses.replace(self, index=self.index[:, start : start + length])


@dataclass(frozen=True)
class PendingResidual:
    """A gated residual add not yet done: ``x + update * gate`` (gate ``[U, dim]`` fp32, per token
    through the conditioning's index), left for the next step to fuse with its norm."""

    update: Tensor
    gate: Tensor

    def apply(self, x: Tensor, *, index: Tensor, ops: DiTOps) -> Tensor:
        return ops.gated_residual(x, self.update, gate=self.gate, index=index)


@dataclass(frozen=True)
class ContextCache:
    """Cross-attention K/V of one text context, for every block: computed once per job.

    ``keys_values[i]`` is block i's (k, v), each ``[B, heads, S, head_dim]``; ``dtype`` is the
    dtype of the context it came from (the time embedding is cast to it, as diffusers does).
    At Wan2.2-TI2V-5B sizes (S=512, bf16) it is 189 MB per batch row.
    """

    keys_values: tuple[tuple[Tensor, Tensor], ...]
    dtype: torch.dtype

    @property
    def batch_size(self) -> int:
        return self.keys_values[0][0].shape[0]


@dataclass(frozen=True)
class TokenWindow:
    """Which rows of the whole token sequence one forward's tokens hold: all of them, or a
    sequence-parallel shard (``start``, ``length`` real rows, padded to ``rows``), with the
    collective that assembles the whole sequence from every rank's shard. What a `BlockStack`
    needs to keep a block residual any layout of the same sequence can use."""

    num_tokens: int  # L, the whole sequence
    start: int = 0
    length: int | None = None  # real rows here (None: all L)
    rows: int | None = None  # rows of the tensor, padding included (None: ``length``)
    # Every rank's shard rows [B, rows, d] -> the whole [B, L, d] (collective); None: nothing to gather.
    gather: Callable[[Tensor], Tensor] | None = None

    def whole(self, part: Tensor) -> Tensor:
        """This forward's rows ``[B, rows, d]`` -> the whole sequence ``[B, L, d]``."""
        return part if self.gather is None else self.gather(part)

    def part(self, whole: Tensor) -> Tensor:
        """The whole sequence ``[B, L, d]`` -> this forward's rows ``[B, rows, d]`` (padding: zeros)."""
        length = self.num_tokens - self.start if self.length is None else self.length
        rows = length if self.rows is None else self.rows
        mine = whole[:, self.start : self.start + length]
        return mine if rows == length else F.pad(mine, (0, 0, 0, rows - length))


class BlockStack(Protocol):
    """Runs the DiT's blocks for one forward, or stands in for them (a step cache):
    ``tokens`` ``[B, rows, dim]`` (residual dtype) -> ``[B, rows, dim]``; ``run(tokens)`` runs every
    block; ``window`` says which rows of the whole sequence these are."""

    def __call__(self, tokens: Tensor, run: Callable[[Tensor], Tensor], window: TokenWindow) -> Tensor: ...


class LinearOp(Protocol):
    """What a `TokenLinear` computes with while one is set (``pan2render.kernels.fp8.Fp8Linear``)."""

    def __call__(self, x: Tensor, *, features: slice | None = None, gelu_input: bool = False) -> Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]`` in x's dtype; ``features``: those output features only;
        ``gelu_input``: of tanh-GELU(x) (the feed-forward's activation, fused into the op's input)."""


class TokenLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters and keys) that runs once per token per step: the ones a
    precision switch replaces. While ``op`` is set it computes instead of the bf16 weight."""

    op: LinearOp | None = None

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) if self.op is None else self.op(x)


# ---------------------------------------------------------------------------------------------
# Leaf modules (submodule names are diffusers' so the state-dict keys match)
# ---------------------------------------------------------------------------------------------


def _random_table(*shape: int) -> Tensor:
    """A modulation table as diffusers initialises it (``randn / sqrt(dim)``), or left empty when
    built on the meta device for a checkpoint to fill: random ops there import torch._dynamo, ~2 s
    of every model load."""
    if torch.get_default_device().type == "meta":
        return torch.empty(*shape)
    return torch.randn(*shape) / shape[-1] ** 0.5


class _TwoLayerMLP(nn.Module):
    """linear_1 -> activation -> linear_2 (diffusers TimestepEmbedding / PixArtAlphaTextProjection)."""

    def __init__(self, in_dim: int, dim: int, *, activation: nn.Module) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.act = activation
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ConditionEmbedder(nn.Module):
    """Timestep MLP + 6-row modulation projection, and the text projection (keys of diffusers'
    WanTimeTextImageEmbedding without the image branch)."""

    def __init__(self, config: PAN2DiTConfig) -> None:
        super().__init__()
        dim = config.inner_dim
        self.freq_dim = config.freq_dim
        self.time_embedder = _TwoLayerMLP(config.freq_dim, dim, activation=nn.SiLU())
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = _TwoLayerMLP(config.text_dim, dim, activation=nn.GELU(approximate="tanh"))

    def embed_time(self, values: Tensor, *, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Distinct timestep values ``[U]`` -> (temb ``[U, dim]``, projection ``[U, 6, dim]``) in dtype."""
        sinusoid = timestep_sinusoid(values, dim=self.freq_dim)
        temb = self.time_embedder(sinusoid.to(self.time_embedder.linear_1.weight.dtype)).to(dtype)
        projection = self.time_proj(F.silu(temb))  # [U, 6 * dim]
        return temb, projection.unflatten(1, (6, -1))


class AttentionOp(abc.ABC):
    """What an attention layer calls: q, k, v ``[B, H, L, D]`` -> ``[B, H, L, D]``, plus the two
    layout requests a sequence-parallel op makes of `SelfAttention` (declared here, with the
    local defaults, so the layer reads them from the interface rather than probing the op):

    - ``head_groups`` G > 1: q, k, v wanted in the all-to-all's send layout ``[G, B, L, H/G, D]``
      contiguous (the Q/K kernel and the v projection write it, so nothing is repacked);
    - ``accepts_lazy_v``: v may come as a zero-argument callable, so the op can start moving q and
      k before the v projection has run.
    """

    head_groups: int = 1
    accepts_lazy_v: bool = False

    @abc.abstractmethod
    def __call__(self, q: Tensor, k: Tensor, v: Tensor | Callable[[], Tensor]) -> Tensor:
        """Attend; ``v`` is a callable only when ``accepts_lazy_v``."""


@dataclass(frozen=True)
class LocalAttention(AttentionOp):
    """A plain attention function as an `AttentionOp`: the whole sequence on this process, the
    layer's own layout, v evaluated before the call."""

    fn: Callable[[Tensor, Tensor, Tensor], Tensor] = attention
    head_groups: ClassVar[int] = 1
    accepts_lazy_v: ClassVar[bool] = False

    def __call__(self, q: Tensor, k: Tensor, v: Tensor | Callable[[], Tensor]) -> Tensor:
        return self.fn(q, k, v)  # type: ignore[arg-type]  # never lazy: accepts_lazy_v is False


def as_attention_op(fn: AttentionOp | Callable[[Tensor, Tensor, Tensor], Tensor]) -> AttentionOp:
    """``fn`` itself when it is an `AttentionOp`, else a `LocalAttention` around the function."""
    if isinstance(fn, AttentionOp):
        return fn
    if not callable(fn):
        raise TypeError(f"attention_fn must be an AttentionOp or a function (q, k, v) -> out, got {fn!r}")
    return LocalAttention(fn)


class _AttentionParams(nn.Module):
    """Parameters of one Wan attention layer: to_q/to_k/to_v/to_out.0 and the across-heads
    RMSNorms norm_q/norm_k (to_out.1 is diffusers' no-op Dropout; kept so indices match)."""

    # to_k / to_v: per token in self-attention; over the text, once per job, in cross-attention.
    kv_linear: ClassVar[type[nn.Linear]] = TokenLinear

    def __init__(self, *, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.to_q = TokenLinear(dim, dim)
        self.to_k = self.kv_linear(dim, dim)
        self.to_v = self.kv_linear(dim, dim)
        self.to_out = nn.ModuleList([TokenLinear(dim, dim), nn.Identity()])
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)
        # The one attention call site; sequence parallelism wraps it (self-attention only).
        self.attention_fn = attention

    @property
    def attention_fn(self) -> AttentionOp:
        """The attention op; a plain function assigned here becomes a `LocalAttention`."""
        return self._attention_op

    @attention_fn.setter
    def attention_fn(self, fn: AttentionOp | Callable[[Tensor, Tensor, Tensor], Tensor]) -> None:
        self._attention_op = as_attention_op(fn)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # [B, L, H*D] -> [B, H, L, D]

    def _output(self, out: Tensor, *, dtype: torch.dtype) -> Tensor:
        return self.to_out[0](out.transpose(1, 2).flatten(2).to(dtype))  # [B, H, L, D] -> [B, L, dim]


class SelfAttention(_AttentionParams):
    def forward(self, h: Tensor, *, rope: tuple[Tensor, Tensor], ops: DiTOps) -> Tensor:
        """h ``[B, L, dim]``, rope (cos, sin) ``[L, head_dim // 2]`` -> ``[B, L, dim]``.

        A sequence-parallel `AttentionOp` may ask for q, k, v in its all-to-all's send layout
        (``head_groups`` G: ``[G, B, L, H/G, D]`` contiguous, written so by the Q/K kernel and the
        v projection, so nothing is repacked) and for v unevaluated (``accepts_lazy_v``: q's and
        k's exchanges then overlap the v projection). Same math either way.
        """
        op = self.attention_fn
        groups = op.head_groups
        extra = {"head_groups": groups} if groups > 1 else {}
        q, k = ops.qk_norm_rope(
            self.to_q(h),
            self.to_k(h),
            norm_q_weight=self.norm_q.weight,
            norm_k_weight=self.norm_k.weight,
            freqs_cos=rope[0],
            freqs_sin=rope[1],
            num_heads=self.num_heads,
            eps=self.norm_q.eps,
            **extra,
        )  # [B, H, L, D] each (or [G, B, L, H/G, D])

        def value() -> Tensor:
            if groups > 1:
                return self._grouped_projection(self.to_v, h, groups)
            return self._heads(self.to_v(h))

        out = op(q, k, value if op.accepts_lazy_v else value())
        return self._output(out, dtype=q.dtype)

    def _grouped_projection(self, linear: nn.Linear, h: Tensor, groups: int) -> Tensor:
        """``linear(h)`` as ``[G, B, L, H/G, D]`` contiguous: one GEMM per head group, each
        writing its group's slot (no repacking copy afterwards)."""
        batch, seq, dim = h.shape
        part = linear.out_features // groups
        out = h.new_empty(groups, batch * seq, part)
        rows = h.reshape(batch * seq, dim)
        op = linear.op if isinstance(linear, TokenLinear) else None
        for g in range(groups):
            if op is not None:
                out[g].copy_(op(rows, features=slice(g * part, (g + 1) * part)))
                continue
            weight = linear.weight[g * part : (g + 1) * part]
            if linear.bias is None:
                torch.mm(rows, weight.t(), out=out[g])
            else:
                torch.addmm(linear.bias[g * part : (g + 1) * part], rows, weight.t(), out=out[g])
        return out.view(groups, batch, seq, self.num_heads // groups, -1)


class CrossAttention(_AttentionParams):
    kv_linear: ClassVar[type[nn.Linear]] = nn.Linear

    def project_context(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """Embedded text ``[B, S, dim]`` -> (k, v) ``[B, heads, S, head_dim]`` (cacheable)."""
        k = rms_norm_heads(self.to_k(context), weight=self.norm_k.weight, num_heads=self.num_heads, eps=self.norm_k.eps)
        return k.transpose(1, 2), self._heads(self.to_v(context))

    def forward(self, h: Tensor, *, kv: tuple[Tensor, Tensor]) -> Tensor:
        """h ``[B, L, dim]`` attends to the cached text (k, v) -> ``[B, L, dim]``."""
        q = rms_norm_heads(self.to_q(h), weight=self.norm_q.weight, num_heads=self.num_heads, eps=self.norm_q.eps)
        q = q.transpose(1, 2)  # [B, H, L, D]
        return self._output(self.attention_fn(q, *kv), dtype=q.dtype)


class _GELUProj(nn.Module):
    """Linear + tanh-GELU under the name ``proj`` (diffusers activations.GELU)."""

    def __init__(self, dim: int, inner_dim: int) -> None:
        super().__init__()
        self.proj = TokenLinear(dim, inner_dim)

    def forward(self, x: Tensor) -> Tensor:
        # (cuBLASLt's GELU epilogue, through torch's private _addmm_activation, measured -10 ms per
        # forward once and within the run-to-run spread in a second run: not worth a private op;
        # docs/performance.md, DiT fused kernels.)
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """``net.0.proj`` -> GELU(tanh) -> ``net.2`` (``net.1`` is diffusers' no-op Dropout)."""

    def __init__(self, dim: int, inner_dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([_GELUProj(dim, inner_dim), nn.Identity(), TokenLinear(inner_dim, dim)])

    def forward(self, x: Tensor) -> Tensor:
        up, down = self.net[0].proj, self.net[2]
        if up.op is not None and down.op is not None:
            # The GELU runs inside the down projection's input quantisation (FP8): one pass less
            # over the [B, L, ffn_dim] activations, the bf16 path's fused epilogue lost.
            return down.op(up.op(x), gelu_input=True)
        return down(self.net[0](x))


# ---------------------------------------------------------------------------------------------
# Block and model
# ---------------------------------------------------------------------------------------------


class PAN2DiTBlock(nn.Module):
    """AdaLN self-attention (RoPE) -> LayerNorm cross-attention -> AdaLN feed-forward.

    The 6 modulation rows are (shift, scale, gate) for self-attention and for the feed-forward,
    ``scale_shift_table`` + the timestep projection, in fp32. The residual stream ``x`` stays in
    its own dtype (the compute dtype, or fp32 under ``PAN2DiT.set_residual_dtype``); each norm
    hands its linear the linear's dtype.
    """

    def __init__(self, config: PAN2DiTConfig) -> None:
        super().__init__()
        dim = config.inner_dim
        self.eps = config.eps
        self.attn1 = SelfAttention(dim=dim, num_heads=config.num_attention_heads, eps=config.eps)
        self.attn2 = CrossAttention(dim=dim, num_heads=config.num_attention_heads, eps=config.eps)
        # diffusers: FP32LayerNorm(affine) if cross_attn_norm else Identity (no keys).
        self.norm2 = nn.LayerNorm(dim, eps=config.eps) if config.cross_attn_norm else None
        self.ffn = FeedForward(dim, config.ffn_dim)
        self.scale_shift_table = nn.Parameter(_random_table(1, 6, dim))

    def forward(
        self,
        x: Tensor,
        *,
        time: TimestepConditioning,
        kv: tuple[Tensor, Tensor],
        rope: tuple[Tensor, Tensor],
        ops: DiTOps = TORCH_OPS,
    ) -> Tensor:
        """x ``[B, L, dim]`` -> ``[B, L, dim]``; L may be a sequence shard (time, rope sliced to it)."""
        x, last = self.run(x, time=time, kv=kv, rope=rope, ops=ops)
        return last.apply(x, index=time.index, ops=ops)

    def run(
        self,
        x: Tensor,
        *,
        time: TimestepConditioning,
        kv: tuple[Tensor, Tensor],
        rope: tuple[Tensor, Tensor],
        ops: DiTOps = TORCH_OPS,
        pending: PendingResidual | None = None,
    ) -> tuple[Tensor, PendingResidual]:
        """The block with its last residual add left to the caller: returns (x, the feed-forward's
        gated residual not yet added). ``pending``: the previous block's, added here in the same pass
        as this block's first norm, so the stream is read and written once less per block (the same
        values as adding it first: `residual_modulated_norm` is that add followed by the norm)."""
        index = time.index
        modulation = self.scale_shift_table.float() + time.projection.float()  # [U, 6, dim] fp32
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = modulation.unbind(1)  # [U, dim] each
        norm2_weight = None if self.norm2 is None else self.norm2.weight
        norm2_bias = None if self.norm2 is None else self.norm2.bias
        compute = self.attn1.to_q.weight.dtype  # every linear of the block (to_*, ffn) has it

        if pending is None:
            h = ops.modulated_norm(x, shift=shift_sa, scale=scale_sa, index=index, eps=self.eps, out_dtype=compute)
        else:
            x, h = ops.residual_modulated_norm(x, pending.update, gate=pending.gate, index=index, shift=shift_sa,
                                               scale=scale_sa, eps=self.eps, out_dtype=compute)
        y = self.attn1(h, rope=rope, ops=ops)
        x, h = ops.residual_layer_norm(
            x, y, gate=gate_sa, index=index, weight=norm2_weight, bias=norm2_bias, eps=self.eps, out_dtype=compute
        )
        y = self.attn2(h, kv=kv)
        x, h = ops.residual_modulated_norm(
            x, y, gate=None, index=index, shift=shift_ff, scale=scale_ff, eps=self.eps, out_dtype=compute
        )
        return x, PendingResidual(update=self.ffn(h), gate=gate_ff)


class PAN2DiT(nn.Module):
    """The PAN2 DiT (Wan2.2-TI2V-5B transformer); state-dict keys are WanTransformer3DModel's.

    ``forward(x, timestep, context)`` equals ``WanTransformer3DModel(x, timestep, context,
    return_dict=False)[0]``. The pieces (`patchify`, `embed_timesteps`, `prepare_context`,
    `rope`, `blocks`, `head`, `unpatchify`) are public so sequence parallelism can run the same
    steps on a shard of the tokens.
    """

    def __init__(self, config: PAN2DiTConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.rope = RotaryPosEmbed(split=config.rope_split, max_seq_len=config.rope_max_seq_len)
        self.patch_embedding = nn.Conv3d(
            config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.condition_embedder = ConditionEmbedder(config)
        self.blocks = nn.ModuleList([PAN2DiTBlock(config) for _ in range(config.num_layers)])
        self.proj_out = nn.Linear(dim, config.num_out_channels * math.prod(config.patch_size))
        self.scale_shift_table = nn.Parameter(_random_table(1, 2, dim))  # norm_out (shift, scale)
        self.ops = ROUTED_OPS  # fused kernels where the switch allows, references otherwise
        # None: the residual stream in the compute dtype (diffusers' numerics); see set_residual_dtype.
        self.residual_dtype: torch.dtype | None = None

    def set_ops(self, ops: DiTOps) -> None:
        """Route the block steps through another op table (the fused-kernel switch)."""
        self.ops = ops

    def set_residual_dtype(self, dtype: torch.dtype | None) -> None:
        """Keep the residual stream (the tokens between and inside blocks) in ``dtype``; None keeps
        it in the compute dtype, rounded after every residual add as diffusers does.

        ``torch.float32`` on a bf16 model: only the norms' outputs (what enters a linear) are
        rounded to bf16. Measured on an H200 (docs/performance.md): rel. L2 vs a strict fp32
        forward 1.46e-2 -> 3.35e-3, +7.5-9 ms per forward. A no-op on an fp32 model.
        """
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"residual dtype {dtype!r}: expected a floating-point torch.dtype "
                             f"(e.g. torch.float32) or None for the compute dtype")
        self.residual_dtype = dtype

    # -- pieces ---------------------------------------------------------------------------------

    def token_grid(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int]:
        """Latent shape ``[B, C, T, h, w]`` -> token grid (T / pt, h / ph, w / pw), validated."""
        if len(shape) != 5 or shape[1] != self.config.in_channels:
            raise ValueError(
                f"latent shape {tuple(shape)}: expected [B, {self.config.in_channels}, T, h, w]"
            )
        dims = shape[2:]
        if any(d % p for d, p in zip(dims, self.config.patch_size)) or min(dims) == 0:
            raise ValueError(
                f"latent (T, h, w)={tuple(dims)} must be non-empty multiples of patch_size="
                f"{list(self.config.patch_size)}; pad or crop the latent"
            )
        return tuple(d // p for d, p in zip(dims, self.config.patch_size))  # type: ignore[return-value]

    def patchify(self, x: Tensor) -> Tensor:
        """``[B, C, T, h, w]`` -> tokens ``[B, L, dim]`` in (t, h, w) raster order."""
        return self.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()

    def unpatchify(self, out: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """``[B, L, C * pt * ph * pw]`` -> ``[B, C, T, h, w]`` (proj_out features are (pt, ph, pw, C))."""
        frames, height, width = grid
        pt, ph, pw = self.config.patch_size
        batch = out.shape[0]
        out = out.reshape(batch, frames, height, width, pt, ph, pw, -1)
        out = out.permute(0, 7, 1, 4, 2, 5, 3, 6)  # [B, C, T', pt, h', ph, w', pw]
        return out.reshape(batch, -1, frames * pt, height * ph, width * pw)

    def embed_timesteps(
        self, timestep: Tensor, *, batch_size: int, num_tokens: int, dtype: torch.dtype
    ) -> TimestepConditioning:
        """timestep ``[B]`` or ``[B, L]`` -> conditioning computed once per row (see TimestepConditioning)."""
        if tuple(timestep.shape) not in ((batch_size,), (batch_size, num_tokens)):
            raise ValueError(
                f"timestep shape {tuple(timestep.shape)}: expected [{batch_size}] (one per sample) "
                f"or [{batch_size}, {num_tokens}] (one per token)"
            )
        if timestep.ndim == 1:
            # One value per sample: each sample its own row, with no device sync (a CUDA graph can
            # capture this path). A batch repeating a value computes its row twice: U is <= B.
            values, index = timestep, torch.arange(batch_size, device=timestep.device)
        else:
            # Per token: torch.unique syncs with the device once per forward; U is tiny (see
            # TimestepConditioning).
            values, inverse = torch.unique(timestep.flatten(), return_inverse=True)
            index = inverse.reshape(timestep.shape)
        temb, projection = self.condition_embedder.embed_time(values, dtype=dtype)
        return TimestepConditioning(temb=temb, projection=projection, index=index)

    def prepare_context(self, context: Tensor) -> ContextCache:
        """Text embeddings ``[B, S, text_dim]`` -> every block's cross-attention K/V.

        Do it once per job (both guidance branches batched or one cache each) and pass the cache
        to `forward` at every step in place of the context.
        """
        if context.ndim != 3 or context.shape[2] != self.config.text_dim:
            raise ValueError(
                f"context shape {tuple(context.shape)}: expected [B, S, {self.config.text_dim}] text embeddings"
            )
        text = self.condition_embedder.text_embedder(context)  # [B, S, dim]
        kv = tuple(block.attn2.project_context(text) for block in self.blocks)
        return ContextCache(keys_values=kv, dtype=context.dtype)

    def run_blocks(
        self,
        tokens: Tensor,
        *,
        time: TimestepConditioning,
        context: ContextCache,
        rope: tuple[Tensor, Tensor],
        blocks: BlockStack | None = None,
        window: TokenWindow | None = None,
    ) -> Tensor:
        """All transformer blocks on tokens ``[B, L, dim]`` (L: the whole sequence or a shard), or
        what ``blocks`` makes of them (``window``: which rows these are; default all of them).

        Returns the residual stream in ``residual_dtype`` (the tokens' dtype when None).
        """
        if self.residual_dtype is not None:
            tokens = tokens.to(self.residual_dtype)  # once; the blocks keep it

        def run(stream: Tensor) -> Tensor:
            pending = None  # each block's last residual add is done by the next block's first norm
            for block, kv in zip(self.blocks, context.keys_values, strict=True):
                stream, pending = block.run(stream, time=time, kv=kv, rope=rope, ops=self.ops, pending=pending)
            return stream if pending is None else pending.apply(stream, index=time.index, ops=self.ops)

        if blocks is None:
            return run(tokens)
        return blocks(tokens, run, window or TokenWindow(num_tokens=tokens.shape[1]))

    def token_linears(self) -> list[tuple[str, TokenLinear]]:
        """The linears that run once per token per step, with their state-dict names (what a
        precision switch replaces; the text's cross-attention K/V and the embedders are not)."""
        return [(name, m) for name, m in self.named_modules() if isinstance(m, TokenLinear)]

    def head(self, tokens: Tensor, *, time: TimestepConditioning) -> Tensor:
        """Final AdaLN + proj_out: ``[B, L, dim]`` (any residual dtype) -> ``[B, L, C * pt * ph * pw]``
        in the compute dtype."""
        shift, scale = (self.scale_shift_table.float() + time.temb.float()[:, None, :]).unbind(1)  # [U, dim]
        h = self.ops.modulated_norm(tokens, shift=shift, scale=scale, index=time.index, eps=self.config.eps,
                                    out_dtype=self.proj_out.weight.dtype)
        return self.proj_out(h)

    # -- forward --------------------------------------------------------------------------------

    def forward(self, x: Tensor, timestep: Tensor, context: Tensor | ContextCache, *,
                blocks: BlockStack | None = None) -> Tensor:
        """Predict the flow velocity.

        x ``[B, in_channels, T, h, w]`` latents; timestep ``[B]`` or ``[B, L]`` with
        L = (T/pt)(h/ph)(w/pw) tokens; context ``[B, S, text_dim]`` or its `ContextCache`;
        ``blocks``: what runs the block stack this once (a step cache; default the blocks).
        Returns ``[B, out_channels, T, h, w]``.
        """
        grid = self.token_grid(x.shape)
        batch, num_tokens = x.shape[0], math.prod(grid)
        cache = context if isinstance(context, ContextCache) else self.prepare_context(context)
        if cache.batch_size != batch:
            raise ValueError(
                f"context batch {cache.batch_size} != latent batch {batch}: give one context row per "
                f"latent (batch both guidance branches on both, or neither)"
            )
        time = self.embed_timesteps(timestep, batch_size=batch, num_tokens=num_tokens, dtype=cache.dtype)
        rope = self.rope(grid, device=x.device)
        tokens = self.run_blocks(self.patchify(x), time=time, context=cache, rope=rope, blocks=blocks)
        return self.unpatchify(self.head(tokens, time=time), grid)
