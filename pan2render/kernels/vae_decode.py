"""Fast, memory-lean Wan2.2 VAE decoder for Hopper GPUs.

Same math as diffusers' ``AutoencoderKLWan.decode`` / our ``WanVAE.decode`` (weights read from the
``decoder.*`` / ``post_quant_conv.*`` state-dict keys), organised for speed and memory:

- bf16 storage, fp32 accumulation (cuDNN) and fp32 norms (Triton, ``vae_ops``); every activation
  is channels-last ``[B, T, H, W, C]`` from the first conv to the last, so no layout flips.
- A causal 3x3x3 conv reads one buffer ``[B, 2 + T, H, W, C]``: its 2-frame history (copied in,
  zeros at the video start) followed by the chunk, which the fused RMS-norm + SiLU kernel writes
  straight into it (the previous conv's bias folded in) while also storing the chunk's last 2
  frames as the next history. cuDNN pads H and W itself. No per-conv ``torch.cat``.
- Upsampling (nearest x2, 3x3 conv) as four 2x2 phase convs in one cuDNN call, interleaved by one
  Triton pass that also adds the bias and the duplicate-upsample shortcut (2.25x fewer FLOPs
  there, no x2 frames in memory). The (3, 1, 1) time conv is one GEMM over its three taps.
- ``frames_per_pass`` latent frames per pass through conv_in, the mid block and the first up
  blocks; the last two up blocks (176x312 -> 352x624 at 704x1248, where activations are big)
  and the head then run over sub-chunks of ``hires_frames`` frames. Causality makes any frame
  chunking exact: a frame only ever sees earlier frames through the histories.
- The mid-block attention (one head, C=1024) as two batched GEMMs with an fp32 softmax between.
- Each resnet's closing add (conv2 bias + residual) is folded into the next RMS-norm kernel, which
  writes the sum back (it is the next residual); small phase convs run as im2col + one GEMM (cuDNN
  picks a slow sm80 kernel there); the head conv (12 output channels) runs as a 2-D conv with its
  three time taps side by side in the output, summed in fp32.
- The decoder is a list of named units (`unit_names`, `run_unit`): this decode and the split
  decode over a GPU group (`pan2render.parallel.decode`) run the same ones.
- Intermediates are dropped as soon as they are consumed; each decoded chunk is written straight
  into the preallocated output (uint8 ``[F, H, W, 3]`` or bf16 ``[B, 3, F, H, W]``).

Measured on one H200 (docs/performance.md): 2.78-2.81 s at 704x1248x121, 2.04x diffusers bf16
in the same run, 5.75 GiB peak above the resident weights (uint8 output included), PSNR 53.5 dB
against strict fp32.

The first latent frame is special, as in the reference: the temporal upsamplers skip their time
conv on it (one frame out, not two) and the duplicate-upsample shortcut keeps only its last
temporal copy. Pass 0 is that frame alone; the time convs' histories start at zeros on pass 1.

Entry points: ``fast_decode(vae, z)`` (falls back to ``vae.decode`` where the fast path cannot
run, logging why once) and ``fast_decode_available(device)``.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import vae_ops

log = logging.getLogger(__name__)

CACHE_T = 2  # frames of history of a causal 3x3x3 conv (kernel 3 in time, padded 2 in front)
RGB = 3
_OUT_CHANNEL_ALIGN = 16  # conv_out's 12 channels padded to 16: bf16 rows of 32 B keep cuDNN fast
_IN_CHANNEL_ALIGN = 64  # conv_in's input channels padded to a multiple of this


@dataclass(frozen=True)
class FastDecodeConfig:
    """How a decode is chunked (results are identical for every valid choice)."""

    frames_per_pass: int = 1  # latent frames per pass after the first (which is always 1)
    # frames per sub-chunk through the last two up blocks and the head: 4 (one latent frame)
    # measured 2.6% faster than 2 for ~1 GiB more peak (docs/performance.md)
    hires_frames: int = 4
    # nearest-x2 + 3x3 conv as four 2x2 phase convs (one cuDNN call) + one Triton pass that
    # interleaves them with the bias and the shortcut; False: materialise the x2 frames (slower)
    phase_upsample: bool = True
    # cuDNN engines timed per conv shape on its first call (torch.backends.cudnn.benchmark_limit,
    # torch's default 10); 0 = every engine (a slower first decode per shape, then cached).
    # None leaves torch's setting alone.
    cudnn_benchmark_limit: int | None = 10
    # the head conv (256 -> 12 channels, 3x3x3) as one 2-D conv per frame with the three time taps
    # side by side in its output (N = 48 instead of 16: cuDNN runs N=16 at ~130 TFLOP/s), then a
    # sum of three shifted slices in fp32; 1.5x the head's FLOPs at 4 frames per sub-chunk, yet
    # measured 2.810 vs 2.834 s per 704x1248x121 decode on an H200 (docs/performance.md)
    head_frame_taps: bool = True

    def __post_init__(self) -> None:
        for name in ("frames_per_pass", "hires_frames"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"FastDecodeConfig.{name}={value!r}: must be an int in 1..64")
        limit = self.cudnn_benchmark_limit
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise ValueError(f"FastDecodeConfig.cudnn_benchmark_limit={limit!r}: must be None or an int >= 0")


# ---- weights in compute layout -------------------------------------------------------------


@dataclass
class _Conv:
    weight: torch.Tensor  # conv weight in the compute dtype, channels-last (or [Cout, Cin] for 1x1)
    bias: torch.Tensor  # [Cout] compute dtype (for torch ops)
    bias32: torch.Tensor  # [Cout] fp32 (folded into the Triton kernels)


@dataclass
class _ResBlock:
    gamma1: torch.Tensor  # [Cin] fp32
    conv1: _Conv
    gamma2: torch.Tensor  # [Cout] fp32
    conv2: _Conv
    shortcut: _Conv | None  # 1x1x1 conv as a [Cout, Cin] matrix, when Cin != Cout


@dataclass
class _Attention:
    gamma: torch.Tensor  # [C] fp32
    qkv: _Conv  # [3C, C]
    proj: _Conv  # [C, C]


@dataclass
class _UpBlock:
    resnets: list[_ResBlock]
    time_conv: _Conv | None  # temporal upsamplers: the [2C, C, 3, 1, 1] conv as a [2C, 3C] matrix
    up_conv: _Conv | None  # [C, C, 3, 3] after nearest x2 (None: no upsampling)
    phase_conv: _Conv | None  # the same as four 2x2 phase kernels [4C, C, 2, 2] (vae_ops)
    dup_index: torch.Tensor | None  # [factor_t, 2, 2, Cout] int32: the shortcut's channel map
    factor_t: int  # duplicate-upsample shortcut factors (1 or 2 in time, 2 in space)
    factor_s: int


@dataclass
class _Sum:
    """A resnet's output before its closing add: ``y + bias + residual``. The consumer's RMS norm
    folds the add in (``vae_ops.rms_norm_act(residual=...)`` writes the sum into ``y`` while it
    normalises), saving a read and a write of the activation; consumers without a norm call
    `materialize`. Holding y and the residual until then costs no peak: the same two tensors
    and a conv buffer are alive during the resnet's second conv."""

    y: torch.Tensor
    bias32: torch.Tensor
    residual: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.y.shape

    def materialize(self) -> torch.Tensor:
        return vae_ops.add_bias_residual_(self.y, bias=self.bias32, residual=self.residual)


def _materialized(x: torch.Tensor | _Sum) -> torch.Tensor:
    return x.materialize() if isinstance(x, _Sum) else x


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


class FastWanDecoder:
    """The Wan2.2 decoder (``post_quant_conv`` + ``decoder``) in the fast layout.

    Build with ``from_vae(vae)`` (ours or diffusers': same keys) or from a state dict and config.
    Holds its own copy of the decoder weights in ``dtype`` on ``device`` (~0.75 GiB in bf16 for
    Wan2.2), taken at construction: rebuild it after changing the VAE's weights. Runs on CPU too
    (fp32, Triton interpreted) for tests; ``fast_decode`` only uses it on Hopper GPUs.
    """

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        config: Any,
        *,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self._check_supported(config)
        self.z_dim = int(_cfg_get(config, "z_dim"))
        self.patch = int(_cfg_get(config, "patch_size") or 1)
        self.out_channels = int(_cfg_get(config, "out_channels", RGB * self.patch**2))
        base = _cfg_get(config, "decoder_base_dim") or _cfg_get(config, "base_dim")
        dim_mult = list(_cfg_get(config, "dim_mult"))
        num_res = int(_cfg_get(config, "num_res_blocks"))
        t_up = list(_cfg_get(config, "temperal_downsample"))[::-1]
        dims = [base * dim_mult[-1]] + [base * m for m in dim_mult[::-1]]

        g = self._loader(state)
        self.post_quant = g.linear("post_quant_conv")
        # conv_in's 48 input channels padded to 64 (zeros) for aligned channels-last rows.
        self.z_width = -(-self.z_dim // _IN_CHANNEL_ALIGN) * _IN_CHANNEL_ALIGN
        self.conv_in = g.conv("decoder.conv_in", pad_in_to=self.z_width)
        self.mid_resnets = [g.resblock(f"decoder.mid_block.resnets.{i}") for i in range(2)]
        self.mid_attn = _Attention(
            gamma=g.gamma("decoder.mid_block.attentions.0.norm"),
            qkv=g.linear("decoder.mid_block.attentions.0.to_qkv"),
            proj=g.linear("decoder.mid_block.attentions.0.proj"),
        )
        self.up_blocks: list[_UpBlock] = []
        n_up = len(dim_mult)
        for i in range(n_up):
            p = f"decoder.up_blocks.{i}"
            up = i != n_up - 1
            temporal = up and bool(t_up[i])
            ft = 2 if temporal else 1
            index = None
            if up:
                index = torch.tensor(
                    _dup_channel_index(dims[i], dims[i + 1], ft, 2), dtype=torch.int32, device=self.device
                ).view(ft, 2, 2, dims[i + 1])
            self.up_blocks.append(
                _UpBlock(
                    resnets=[g.resblock(f"{p}.resnets.{r}") for r in range(num_res + 1)],
                    time_conv=g.time_linear(f"{p}.upsampler.time_conv") if temporal else None,
                    up_conv=g.conv(f"{p}.upsampler.resample.1") if up else None,
                    phase_conv=g.phase_conv(f"{p}.upsampler.resample.1") if up else None,
                    dup_index=index,
                    factor_t=ft,
                    factor_s=2,
                )
            )
        assert dims[-1] == self.up_blocks[-1].resnets[-1].conv2.weight.shape[0]
        self.gamma_out = g.gamma("decoder.norm_out")
        self.conv_out = g.conv("decoder.conv_out", pad_out_to=_OUT_CHANNEL_ALIGN)
        # The same weights as three 2-D kernels stacked in the output: [3 * 16, C, 3, 3], block dt.
        w = self.conv_out.weight  # [16, C, 3, 3, 3]
        self.conv_out_taps = w.permute(2, 0, 1, 3, 4).reshape(-1, *w.shape[1:2], *w.shape[3:]).contiguous(
            memory_format=torch.channels_last
        )
        self.time_factor = 2 ** sum(b.factor_t == 2 for b in self.up_blocks)
        self.space_factor = 2 ** sum(b.up_conv is not None for b in self.up_blocks) * self.patch
        # The high-resolution tail (the last two up blocks + head) runs over frame sub-chunks; it
        # must hold no temporal upsampler (first-chunk semantics live in the per-pass part).
        self.split = max(0, n_up - 2)
        while any(b.factor_t != 1 for b in self.up_blocks[self.split :]):
            self.split += 1
        self._units, self._tail_start = self._list_units()
        self._history: dict[str, torch.Tensor] = {}  # conv key -> [B, 2, H, W, C] history
        self._phase = True
        self._head_taps = False
        self._busy = False

    # ---- construction ----------------------------------------------------------------------

    @staticmethod
    def _check_supported(config: Any) -> None:
        if _cfg_get(config, "is_residual") is not True:
            raise ValueError("the fast decoder supports the Wan2.2 VAE only (is_residual=True)")
        if list(_cfg_get(config, "attn_scales") or []):
            raise ValueError("the fast decoder supports attn_scales=[] only (Wan2.2)")
        if int(_cfg_get(config, "num_res_blocks")) < 1:
            raise ValueError("num_res_blocks must be >= 1")

    @classmethod
    def from_vae(
        cls, vae: torch.nn.Module, *, device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> FastWanDecoder:  # fmt: skip
        """From ``WanVAE`` or diffusers' ``AutoencoderKLWan`` (reads ``vae.config`` and the
        ``post_quant_conv.*`` / ``decoder.*`` parameters; the encoder is not copied)."""
        if device is None:
            device = next(vae.parameters()).device
        state = {
            k: v for k, v in vae.state_dict().items() if k.startswith(("decoder.", "post_quant_conv."))
        }
        return cls(state, vae.config, device=device, dtype=dtype)

    def _loader(self, state: Mapping[str, torch.Tensor]) -> _Loader:
        return _Loader(state, device=self.device, dtype=self.dtype)

    # ---- decode --------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(
        self,
        z: torch.Tensor,
        *,
        out_dtype: torch.dtype = torch.uint8,
        config: FastDecodeConfig | None = None,
    ) -> torch.Tensor:
        """Raw latents ``[B, z, T, h, w]`` -> uint8 ``[F, H, W, 3]`` (B must be 1) or
        ``[B, 3, F, H, W]`` in ``out_dtype``, clamped to [-1, 1], F = 1 + 4 (T - 1)."""
        cfg = config or FastDecodeConfig()
        if z.dim() != 5 or z.shape[1] != self.z_dim or z.shape[2] < 1:
            raise ValueError(f"latents of shape {tuple(z.shape)}: expected [B, {self.z_dim}, T>=1, h, w]")
        b, _, n, h, w = z.shape
        if out_dtype == torch.uint8 and b != 1:
            raise ValueError(f"uint8 output is one video [F, H, W, 3]: got batch {b}; decode one at a time")
        frames = 1 + self.time_factor * (n - 1)
        hh, ww = h * self.space_factor, w * self.space_factor
        if out_dtype == torch.uint8:
            out = torch.empty(frames, hh, ww, RGB, dtype=torch.uint8, device=self.device)
        else:
            out = torch.empty(b, RGB, frames, hh, ww, dtype=out_dtype, device=self.device)

        self.begin_decode(cfg)
        saved_limit = None  # torch's setting, restored after the call
        if cfg.cudnn_benchmark_limit is not None and self.device.type == "cuda":
            saved_limit = torch.backends.cudnn.benchmark_limit
            torch.backends.cudnn.benchmark_limit = cfg.cudnn_benchmark_limit
        try:
            zp = self._post_quant(z)  # [B, 2 + T, h, w, z]: 2 zero frames = conv_in's history
            with torch.backends.cudnn.flags(
                enabled=True, benchmark=True, deterministic=False,
                allow_tf32=torch.backends.cudnn.allow_tf32,
            ):  # fmt: skip
                start = 0
                for t0, t1 in self._passes(n, cfg.frames_per_pass):
                    x = self._lowres(zp, t0, t1)  # [B, f, H', W', C] before the tail
                    # One sub-chunk: hand the tensor over so the tail can free it after up block
                    # `split` (it is big: 1024 ch at 176x312); several: they are views of it.
                    subs = [x] if x.shape[1] <= cfg.hires_frames else list(x.split(cfg.hires_frames, dim=1))
                    del x
                    while subs:
                        y = self._tail(subs.pop(0).contiguous())
                        self._write(y, out, start)
                        start += y.shape[1]
                        del y
            assert start == frames, (start, frames)
        finally:
            if saved_limit is not None:
                torch.backends.cudnn.benchmark_limit = saved_limit
            self.end_decode()
        return out

    def begin_decode(self, config: FastDecodeConfig | None = None) -> None:
        """Start a decode (fresh causal histories, the config's layer variants); one at a time.
        `decode` calls it; a caller running the units itself (the split decode) calls it and
        `end_decode` around its own loop."""
        cfg = config or FastDecodeConfig()
        if self._busy:
            raise RuntimeError("FastWanDecoder is already decoding; calls must not overlap")
        self._busy = True
        self._history = {}
        self._phase = cfg.phase_upsample
        self._head_taps = cfg.head_frame_taps

    def end_decode(self) -> None:
        self._history = {}
        self._busy = False

    @staticmethod
    def _passes(n: int, k: int) -> list[tuple[int, int]]:
        return [(0, 1)] + [(s, min(s + k, n)) for s in range(1, n, k)]

    def _post_quant(self, z: torch.Tensor) -> torch.Tensor:
        b, c, n, h, w = z.shape
        zp = torch.zeros(b, CACHE_T + n, h, w, self.z_width, dtype=self.dtype, device=self.device)
        zr = z.to(self.device, self.dtype).permute(0, 2, 3, 4, 1)  # [B, T, h, w, z]
        zp[:, CACHE_T:, :, :, :c] = F.linear(zr, self.post_quant.weight, self.post_quant.bias)
        return zp

    def _lowres(self, zp: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Latent frames [t0, t1) through conv_in, the mid block and the up blocks before the
        high-resolution tail. ``zp`` holds 2 zero frames in front, so frame t's history is
        ``zp[t : t + 2]`` and conv_in needs no cache of its own."""
        state: dict[str, Any] = {"x": zp[:, t0 : t1 + CACHE_T]}
        for name in self._units[: self._tail_start]:
            state = self.run_unit(name, state, first=t0 == 0)
        return self.settle(state)["x"]

    def _tail(self, x0: torch.Tensor) -> torch.Tensor:
        state: dict[str, Any] = {"x": x0}
        del x0
        for name in self._units[self._tail_start :]:
            state = self.run_unit(name, state, first=False)
        return state["x"]  # [B, f, H, W, 16]

    # ---- the decoder as named units (this decode and the split decode both run these) ----------

    def unit_names(self) -> list[str]:
        """The decoder's steps in call order, as `pan2render.parallel.decode.plan_layers` names
        them: "conv_in", "mid", "up{i}.res{j}.a" / ".b" (a residual block's two convs),
        "up{i}.up" (upsampler + the block's duplicate-upsample shortcut), "head"."""
        return list(self._units)

    def _list_units(self) -> tuple[list[str], int]:
        """(unit names, index of the first unit of up block `split`: where the tail starts)."""
        names = ["conv_in", "mid"]
        for i, blk in enumerate(self.up_blocks):
            if i == self.split:
                tail = len(names)
            names += [f"up{i}.res{j}.{half}" for j in range(len(blk.resnets)) for half in "ab"]
            if blk.up_conv is not None:
                names.append(f"up{i}.up")
        if self.split >= len(self.up_blocks):
            tail = len(names)
        return names + ["head"], tail

    def run_unit(self, name: str, state: dict[str, Any], *, first: bool) -> dict[str, Any]:
        """Run one unit on a chunk's state and return it. ``state["x"]``: the activation rows
        ``[B, T, H, W, C]`` (for "conv_in": the post-quant latents with their 2 history frames in
        front), or a pending resnet sum (`_Sum`) that the next norm adds; ``"res"`` carries a
        residual block's residual between its halves, ``"x_in"`` an up block's input to its
        shortcut. ``first``: the chunk holds the video's first latent frame (the temporal
        upsamplers' first-chunk rule). The input is consumed (popped), so it can be freed early.
        Call `settle` before the state leaves this decoder (another rank, the output)."""
        x = state.pop("x")
        if name == "conv_in":
            return {**state, "x": _conv3d(x.contiguous(), self.conv_in, pad=1, bias=True)}
        if name == "mid":
            x = self._resnet_pending([x], self.mid_resnets[0], "mid.0")
            x = self._attention([x], self.mid_attn)
            return {**state, "x": self._resnet_pending([x], self.mid_resnets[1], "mid.1")}
        if name == "head":
            buf = self._fill([x], "head", gamma=self.gamma_out, bias=None)
            del x
            y = self._head_by_frame_taps(buf) if self._head_taps else _conv3d(buf, self.conv_out, pad=1, bias=True)
            return {**state, "x": y}
        block_id, part, *half = name.split(".")
        i = int(block_id[2:])
        blk = self.up_blocks[i]
        if part == "up":  # upsampler + duplicate-upsample shortcut (+ bias)
            holder = [_materialized(x)]  # the callee pops it and frees it once consumed
            del x
            x_in = state.pop("x_in")
            if self._phase:
                return {**state, "x": self._upsample_phase(holder, blk, f"up.{i}", first=first, x_in=x_in)}
            y = self._upsample(holder, blk, f"up.{i}", first=first)
            _add_dup_shortcut_(y, x_in, blk.up_conv.bias32, factor_t=blk.factor_t, factor_s=blk.factor_s,
                               first=first)  # fmt: skip
            return {**state, "x": y}
        j = int(part[3:])
        res, key = blk.resnets[j], f"up.{i}.resnets.{j}"
        if half == ["a"]:
            if j == 0 and blk.up_conv is not None:  # the block's input, kept for its shortcut
                x = _materialized(x)
                state["x_in"] = x
            buf = self._fill([x], f"{key}.conv1", gamma=res.gamma1, bias=None)  # adds a pending sum
            x = x.y if isinstance(x, _Sum) else x
            state["res"] = x if res.shortcut is None else F.linear(x, res.shortcut.weight, res.shortcut.bias)
            del x
            state["x"] = _conv3d(buf, res.conv1, pad=1, bias=False)  # conv1's bias folds into norm2
            return state
        buf = self._fill([x], f"{key}.conv2", gamma=res.gamma2, bias=res.conv1.bias32)
        del x
        y = _conv3d(buf, res.conv2, pad=1, bias=False)
        del buf
        state["x"] = _Sum(y, res.conv2.bias32, state.pop("res"))  # added by the next unit's norm
        return state

    @staticmethod
    def settle(state: dict[str, Any]) -> dict[str, Any]:
        """Add a pending resnet sum, so ``state["x"]`` is a tensor (before it is sent or written)."""
        state["x"] = _materialized(state["x"])
        return state

    def _head_by_frame_taps(self, buf: torch.Tensor) -> torch.Tensor:
        """conv_out over ``buf [B, 2 + T, H, W, C]`` as a 2-D conv of every frame with the three
        time taps' kernels side by side (N = 48), then out[t] = P[t, tap 0] + P[t+1, tap 1] +
        P[t+2, tap 2] + bias, summed in fp32 -> ``[B, T, H, W, 16]`` fp32."""
        b, tt, h, w, c = buf.shape
        t = tt - CACHE_T
        p = F.conv2d(buf.view(b * tt, h, w, c).permute(0, 3, 1, 2), self.conv_out_taps, None, padding=1)
        p = _rows(p, b)  # [B, 2 + T, H, W, 3 * 16]
        k = p.shape[-1] // (CACHE_T + 1)
        y = p[:, 0:t, ..., 0:k].float()
        for dt in range(1, CACHE_T + 1):
            y += p[:, dt : dt + t, ..., dt * k : (dt + 1) * k]
        return y.add_(self.conv_out.bias32)

    # ---- layers (inputs passed in a one-element list so the callee can drop them early) ------

    def _fill(
        self, holder: list[torch.Tensor | _Sum], key: str, *, gamma: torch.Tensor | None,
        bias: torch.Tensor | None, silu: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """The input buffer of a causal conv: ``[B, 2 + T, H, W, C]`` = history, then
        ``act(norm(x + bias))`` (or x itself when ``gamma`` is None). Updates the history.
        A pending resnet sum (`_Sum`, with ``bias`` None) is added inside the norm kernel, and
        its ``y`` holds the sum afterwards."""
        x = holder.pop()
        residual = None
        if isinstance(x, _Sum):
            if gamma is None:
                x = x.materialize()
            else:
                if bias is not None:
                    raise ValueError("a pending resnet sum brings its own bias")
                x, bias, residual = x.y, x.bias32, x.residual
        b, t, h, w, c = x.shape
        buf = x.new_empty(b, CACHE_T + t, h, w, c)
        hist = self._history.get(key)
        if hist is None:  # the reference pads the video start with zeros
            hist = self._history[key] = x.new_zeros(b, CACHE_T, h, w, c)
            buf[:, :CACHE_T].zero_()
        else:
            buf[:, :CACHE_T].copy_(hist)
        if gamma is None:
            buf[:, CACHE_T:].copy_(x)
            hist.copy_(buf[:, t:])
            return buf
        if t < CACHE_T:  # the new history keeps the old one's last frame in front
            hist[:, : CACHE_T - t].copy_(hist[:, t:])
        hw = h * w
        for i in range(b):  # per video: buf[i, 2:] is contiguous, buf[:, 2:] is not
            # The kernel also stores the chunk's last 2 frames (or its 1 frame) into the history.
            vae_ops.rms_norm_act(
                x[i], gamma, bias=bias, silu=silu, out=buf[i, CACHE_T:], hist=hist[i],
                hist_start=(t - CACHE_T) * hw, residual=None if residual is None else residual[i],
            )  # fmt: skip
        return buf

    def _resnet_pending(self, holder: list[torch.Tensor | _Sum], blk: _ResBlock, key: str) -> _Sum:
        """One residual block, its closing add left to the consumer's norm (`_Sum`)."""
        x = holder.pop()
        buf = self._fill([x], f"{key}.conv1", gamma=blk.gamma1, bias=None)
        if isinstance(x, _Sum):  # `_fill` added it: its y now holds the block input
            x = x.y
        # 1x1x1 shortcut conv (one GEMM) when the width changes, else the input itself.
        res = x if blk.shortcut is None else F.linear(x, blk.shortcut.weight, blk.shortcut.bias)
        del x
        y = _conv3d(buf, blk.conv1, pad=1, bias=False)  # conv1's bias is folded into norm2
        del buf
        buf = self._fill([y], f"{key}.conv2", gamma=blk.gamma2, bias=blk.conv1.bias32)
        del y
        y = _conv3d(buf, blk.conv2, pad=1, bias=False)
        del buf
        return _Sum(y, blk.conv2.bias32, res)

    def _attention(self, holder: list[torch.Tensor | _Sum], attn: _Attention) -> torch.Tensor:
        """Per-frame single-head self-attention over the H*W positions, + residual."""
        x = holder.pop()
        if isinstance(x, _Sum):  # the norm adds the resnet's sum and leaves it in x.y
            xn = vae_ops.rms_norm_act(x.y, attn.gamma, bias=x.bias32, residual=x.residual, silu=False)
            x = x.y
        else:
            xn = vae_ops.rms_norm_act(x, attn.gamma, silu=False)
        b, t, h, w, c = x.shape
        qkv = F.linear(xn, attn.qkv.weight, attn.qkv.bias).view(b * t, h * w, 3 * c)
        del xn
        q, k, v = qkv.split(c, dim=-1)  # the reference's chunk(3) of [q | k | v] channels
        scores = torch.bmm(q, k.transpose(1, 2))  # [BT, HW, HW], fp32 accumulation
        probs = torch.softmax(scores.float().mul_(1.0 / math.sqrt(c)), dim=-1).to(x.dtype)
        del scores
        o = torch.bmm(probs, v)  # [BT, HW, C]
        del probs, qkv, q, k, v
        y = F.linear(o, attn.proj.weight).view(b, t, h, w, c)
        return vae_ops.add_bias_residual_(y, bias=attn.proj.bias32, residual=x)

    def _time_up(self, x: torch.Tensor, blk: _UpBlock, key: str) -> torch.Tensor:
        """The causal (3, 1, 1) time conv: [B, T, H, W, C] -> [B, T, 2, H, W, C] (frame 2t+a =
        output channel half a). Run as one cuBLAS GEMM over the three frame taps laid side by
        side (K = 3C, fp32 accumulation), ~660 TFLOP/s at up block 1 on an H200 (docs/performance.md)."""
        b, t, h, w, c = x.shape
        buf = self._fill([x], f"{key}.time_conv", gamma=None, bias=None)  # [B, 2 + T, H, W, C]
        del x
        taps = torch.cat([buf[:, i : i + t] for i in range(CACHE_T + 1)], dim=-1)  # [B, T, H, W, 3C]
        del buf
        tc = F.linear(taps, blk.time_conv.weight, blk.time_conv.bias)  # [B, T, H, W, 2C]
        del taps
        return tc.view(b, t, h, w, 2, c).permute(0, 1, 4, 2, 3, 5).contiguous()

    def _upsample_phase(
        self, holder: list[torch.Tensor], blk: _UpBlock, key: str, *, first: bool, x_in: torch.Tensor
    ) -> torch.Tensor:
        """(time conv) -> nearest x2 -> 3x3 conv -> + bias + duplicate-upsample shortcut, as one
        2x2 phase conv and one Triton combine pass. [B, T, H, W, C] -> [B, T*r, 2H, 2W, Cout]."""
        x = holder.pop()
        b, t, h, w, c = x.shape
        if blk.time_conv is not None and not first:
            src, r = self._time_up(x, blk, key), 2
            index = blk.dup_index
        else:  # first chunk: no time conv; the shortcut keeps its last temporal copy
            src, r = x, 1
            index = blk.dup_index[blk.factor_t - 1 :]
        del x
        n = b * t * r
        o = _phase_conv(src.view(n, h, w, c), blk.phase_conv)  # [N, H+1, W+1, 4*Cout]
        del src
        xs = x_in.reshape(b * t, h, w, x_in.shape[-1])
        y = vae_ops.upsample_phase_combine(o, blk.phase_conv.bias32, xs, index.contiguous(), r=r)
        return y.view(b, t * r, 2 * h, 2 * w, y.shape[-1])

    def _upsample(self, holder: list[torch.Tensor], blk: _UpBlock, key: str, *, first: bool) -> torch.Tensor:
        """(time conv: each frame -> 2, channel halves interleaved) -> nearest x2 -> 3x3 conv
        (no bias: it is added with the shortcut). [B, T, H, W, C] -> [B, T*r, 2H, 2W, C]."""
        x = holder.pop()
        b, t, h, w, c = x.shape
        if blk.time_conv is not None and not first:
            src, r = self._time_up(x, blk, key), 2  # [B, T, 2, H, W, C]
        else:  # first chunk: the reference skips the time conv (one frame stays one frame)
            src, r = x.view(b, t, 1, h, w, c), 1
        up = x.new_empty(b, t, r, h, 2, w, 2, c)
        up.copy_(src[:, :, :, :, None, :, None, :].expand(b, t, r, h, 2, w, 2, c))  # nearest x2
        del src, x
        up4 = up.view(b * t * r, 2 * h, 2 * w, c).permute(0, 3, 1, 2)  # NCHW view, channels-last
        y = F.conv2d(up4, blk.up_conv.weight, None, padding=1)
        del up, up4
        return _rows(y, b)  # [B, T*r, 2H, 2W, C]

    # ---- output -------------------------------------------------------------------------------

    def _write(self, y: torch.Tensor, out: torch.Tensor, f0: int) -> None:
        """Decoder output ``[B, f, H, W, >=12]`` -> frames [f0, f0 + f) of ``out``, unpatchified
        (channel = c * p^2 + dw * p + dh), clamped, converted."""
        b, f, h, w, _ = y.shape
        p = self.patch
        v = y[..., : RGB * p * p].unflatten(-1, (RGB, p, p))  # [B, f, h, w, c, dw, dh]
        if out.dtype == torch.uint8:
            dst = out[f0 : f0 + f].view(f, h, p, w, p, RGB)  # [f, h, dh, w, dw, c]
            src = v[0].permute(0, 1, 5, 2, 4, 3)
            # The pipeline's formula exactly: ((x.clamp(-1, 1) + 1) * 127.5).round().to(uint8)
            dst.copy_(((src.float().clamp(-1.0, 1.0) + 1.0) * 127.5).round())
        else:
            dst = out[:, :, f0 : f0 + f].view(b, RGB, f, h, p, w, p)  # [B, c, f, h, dh, w, dw]
            dst.copy_(v.permute(0, 4, 1, 2, 6, 3, 5).clamp(-1.0, 1.0))


# ---- helpers -----------------------------------------------------------------------------------


def _rows(y: torch.Tensor, b: int) -> torch.Tensor:
    """A conv output (logical NC..., channels-last) -> contiguous rows ``[B, T, H, W, C]``."""
    rows = y.permute(0, 2, 3, 4, 1) if y.dim() == 5 else y.permute(0, 2, 3, 1)
    if not rows.is_contiguous():  # cuDNN keeps channels-last; this is a fallback, not the path
        rows = rows.contiguous()
    if rows.dim() == 4:  # conv2d over B*T frames
        rows = rows.view(b, rows.shape[0] // b, *rows.shape[1:])
    return rows


# Below this many bytes of im2col rows a phase conv runs as one GEMM (the first up block: 44x78
# latent frames, where cuDNN's best engine is an sm80 kernel at ~300 TFLOP/s; docs/performance.md).
PHASE_GEMM_MAX_BYTES = 64 * 2**20


def _phase_conv(x: torch.Tensor, conv: _Conv) -> torch.Tensor:
    """The four 2x2 phase kernels over rows ``x [N, H, W, C]`` (padding 1) -> rows
    ``[N, H+1, W+1, 4*Cout]``: cuDNN, or for small frames an explicit im2col + one GEMM."""
    n, h, w, c = x.shape
    c4 = conv.weight.shape[0]
    if n * (h + 1) * (w + 1) * 4 * c * x.element_size() > PHASE_GEMM_MAX_BYTES:
        return _rows(F.conv2d(x.permute(0, 3, 1, 2), conv.weight, None, padding=1), 1).view(n, h + 1, w + 1, c4)
    xp = F.pad(x, (0, 0, 1, 1, 1, 1))  # [N, H+2, W+2, C]
    cols = torch.cat([xp[:, dy : dy + h + 1, dx : dx + w + 1] for dy in (0, 1) for dx in (0, 1)], dim=-1)
    del xp
    # channels-last weight [4Cout, C, 2, 2] is physically [4Cout, 2, 2, C]: the im2col order
    wm = conv.weight.permute(0, 2, 3, 1).reshape(c4, 4 * c)
    return F.linear(cols, wm)  # [N, H+1, W+1, 4*Cout]


def _conv3d(buf: torch.Tensor, conv: _Conv, *, pad: int, bias: bool) -> torch.Tensor:
    """``buf`` rows ``[B, T_in, H, W, C]`` (history included) -> rows ``[B, T_out, H, W, Cout]``;
    time is not padded (the history is in ``buf``), H and W by ``pad`` (cuDNN does it)."""
    x = buf.permute(0, 4, 1, 2, 3)  # logical [B, C, T, H, W], channels_last_3d strides
    y = F.conv3d(x, conv.weight, conv.bias if bias else None, padding=(0, pad, pad))
    return _rows(y, buf.shape[0])


def _dup_channel_index(cin: int, cout: int, factor_t: int, factor_s: int) -> list[list[int]]:
    """DupUp3D's channel map: for each (a, i, j) phase (time, row, column offsets) the input
    channel behind each output channel o: ``(o * F + a * s^2 + i * s + j) // repeats``."""
    fac = factor_t * factor_s * factor_s
    if (cout * fac) % cin:
        raise ValueError(f"duplicate-upsample shortcut {cin}->{cout} x{fac}: channels do not divide")
    repeats = cout * fac // cin
    return [
        [(o * fac + a * factor_s**2 + i * factor_s + j) // repeats for o in range(cout)]
        for a in range(factor_t)
        for i in range(factor_s)
        for j in range(factor_s)
    ]


def _add_dup_shortcut_(
    y: torch.Tensor, x_in: torch.Tensor, bias32: torch.Tensor, *, factor_t: int, factor_s: int, first: bool
) -> None:
    """``y [B, T*r, sH, sW, Cout] += bias + DupUp3D(x_in [B, T, H, W, Cin])`` in place, where the
    first chunk of a temporal shortcut keeps only its last temporal copy (the reference's
    ``first_chunk``). Each (time, row, column) phase is one strided add of a channel gather of
    x_in; phases sharing a channel map are added in one broadcast."""
    b, t, h, w, cin = x_in.shape
    cout = y.shape[-1]
    s = factor_s
    phases_t = [factor_t - 1] if first else list(range(factor_t))
    y8 = y.view(b, t, len(phases_t), h, s, w, s, cout)
    index = _dup_channel_index(cin, cout, factor_t, factor_s)
    bias = bias32.to(y.dtype)
    if cin == cout and all(ix == list(range(cout)) for ix in index):
        y8.add_((x_in + bias)[:, :, None, :, None, :, None, :])  # plain nearest upsampling
        return
    cache: dict[tuple[int, ...], torch.Tensor] = {}
    for ai, a in enumerate(phases_t):
        for i in range(s):
            for j in range(s):
                ix = tuple(index[(a * s + i) * s + j])
                if ix not in cache:
                    sel = torch.tensor(ix, device=x_in.device)
                    cache[ix] = x_in.index_select(-1, sel).add_(bias)
                y8[:, :, ai, :, i, :, j, :].add_(cache[ix])


class _Loader:
    """Reads reference weights by key into the compute layout."""

    def __init__(self, state: Mapping[str, torch.Tensor], *, device: torch.device, dtype: torch.dtype) -> None:
        self.state, self.device, self.dtype = state, device, dtype

    def _get(self, key: str) -> torch.Tensor:
        if key not in self.state:
            raise KeyError(f"state dict has no {key!r}: not a Wan2.2 VAE decoder (diffusers key layout)")
        return self.state[key].detach()

    def _bias(self, prefix: str, cout: int, pad_to: int) -> tuple[torch.Tensor, torch.Tensor]:
        b32 = self._get(f"{prefix}.bias").to(self.device, torch.float32)
        if pad_to > cout:
            b32 = torch.cat([b32, b32.new_zeros(pad_to - cout)])
        return b32.to(self.dtype), b32

    def conv(self, prefix: str, *, pad_out_to: int = 0, pad_in_to: int = 0) -> _Conv:
        wt = self._get(f"{prefix}.weight").to(self.device, self.dtype)
        if pad_in_to > wt.shape[1]:
            wt = torch.cat([wt, wt.new_zeros(wt.shape[0], pad_in_to - wt.shape[1], *wt.shape[2:])], dim=1)
        cout = wt.shape[0]
        width = max(cout, -(-cout // pad_out_to) * pad_out_to) if pad_out_to else cout
        if width > cout:
            wt = torch.cat([wt, wt.new_zeros(width - cout, *wt.shape[1:])])
        fmt = torch.channels_last_3d if wt.dim() == 5 else torch.channels_last
        bias, bias32 = self._bias(prefix, cout, width)
        return _Conv(wt.contiguous(memory_format=fmt), bias, bias32)

    def phase_conv(self, prefix: str) -> _Conv:
        """A 3x3 conv after nearest x2 as its four 2x2 phase kernels (summed in fp32)."""
        wt = vae_ops.phase_weights(self._get(f"{prefix}.weight").to(self.device, torch.float32))
        bias, bias32 = self._bias(prefix, wt.shape[0] // 4, 0)
        return _Conv(wt.to(self.dtype).contiguous(memory_format=torch.channels_last), bias, bias32)

    def time_linear(self, prefix: str) -> _Conv:
        """A (3, 1, 1) conv ``[Cout, C, 3, 1, 1]`` as ``[Cout, 3C]``: column ``i*C + c`` = tap i."""
        wt = self._get(f"{prefix}.weight")
        cout, c, k = wt.shape[:3]
        wt = wt.reshape(cout, c, k).permute(0, 2, 1).reshape(cout, k * c)
        bias, bias32 = self._bias(prefix, cout, 0)
        return _Conv(wt.to(self.device, self.dtype).contiguous(), bias, bias32)

    def linear(self, prefix: str) -> _Conv:
        wt = self._get(f"{prefix}.weight")
        wt = wt.reshape(wt.shape[0], wt.shape[1]).to(self.device, self.dtype).contiguous()
        bias, bias32 = self._bias(prefix, wt.shape[0], 0)
        return _Conv(wt, bias, bias32)

    def gamma(self, prefix: str) -> torch.Tensor:
        return self._get(f"{prefix}.gamma").reshape(-1).to(self.device, torch.float32).contiguous()

    def resblock(self, prefix: str) -> _ResBlock:
        sc = f"{prefix}.conv_shortcut.weight" in self.state
        return _ResBlock(
            gamma1=self.gamma(f"{prefix}.norm1"),
            conv1=self.conv(f"{prefix}.conv1"),
            gamma2=self.gamma(f"{prefix}.norm2"),
            conv2=self.conv(f"{prefix}.conv2"),
            shortcut=self.linear(f"{prefix}.conv_shortcut") if sc else None,
        )


# ---- entry points --------------------------------------------------------------------------------

_AVAILABLE: dict[str, tuple[bool, str]] = {}
_DECODERS: weakref.WeakKeyDictionary[torch.nn.Module, FastWanDecoder] = weakref.WeakKeyDictionary()
_FALLBACK_LOGGED: set[str] = set()


def fast_decode_available(device: torch.device | str) -> tuple[bool, str]:
    """(True, "") where the fast decoder runs (a Hopper GPU whose Triton kernels build and agree
    with their references), else (False, why). Checked once per device."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"device {device} is not a CUDA GPU (the fast VAE decoder runs on Hopper, sm_90)"
    if not torch.cuda.is_available():
        return False, "CUDA is not available in this process"
    if vae_ops.triton is None:
        return False, "triton is not installed"
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = f"cuda:{index}"
    if key not in _AVAILABLE:
        _AVAILABLE[key] = _probe(torch.device(key))
    return _AVAILABLE[key]


def _probe(device: torch.device) -> tuple[bool, str]:
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if major != 9:
        return False, f"GPU {name} is sm_{major}{minor}; the fast VAE decoder is built for Hopper (sm_90)"
    try:  # build (JIT) and check the kernels once on a small odd shape
        x = torch.randn(37, 96, device=device, dtype=torch.bfloat16)
        g = torch.rand(96, device=device) + 0.5
        got = vae_ops.rms_norm_act(x, g, silu=True)
        want = vae_ops.rms_norm_act_reference(x, g, silu=True)
        err = (got.float() - want.float()).abs().max().item()
        if not err <= 0.05:
            return False, f"the Triton RMS-norm kernel disagrees with its reference (max abs err {err:.3g})"
    except Exception as e:  # a failed build must not fail the render: fall back and say why
        return False, f"the Triton kernels failed to build or run ({type(e).__name__}: {e})"
    return True, ""


def _decoder_for(vae: torch.nn.Module, device: torch.device) -> FastWanDecoder:
    dec = _DECODERS.get(vae)
    if dec is None or dec.device != device:
        dec = FastWanDecoder.from_vae(vae, device=device)
        _DECODERS[vae] = dec
    return dec


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """``[3, F, H, W]`` in [-1, 1] -> uint8 ``[F, H, W, 3]`` on the same device: the one place the
    decoded video becomes pixels (the fast decoder's chunk writer uses the same formula in place)."""
    x = ((video.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    return x.permute(1, 2, 3, 0).contiguous()


def _reference_decode(vae: torch.nn.Module, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    vae_dtype = next(vae.parameters()).dtype
    with torch.inference_mode():
        video = vae.decode(z.to(vae_dtype))
    video = getattr(video, "sample", video)  # diffusers returns DecoderOutput
    if out_dtype != torch.uint8:
        return video.clamp(-1.0, 1.0).to(out_dtype)
    if video.shape[0] != 1:
        raise ValueError(f"uint8 output is one video [F, H, W, 3]: got batch {video.shape[0]}")
    return to_uint8_frames(video[0])


def fast_decode(
    vae: torch.nn.Module,
    z_raw: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.uint8,
    config: FastDecodeConfig | None = None,
) -> torch.Tensor:
    """Decode raw latents ``[B, 48, T, h, w]`` with the fast decoder where it can run, else with
    ``vae.decode`` (the reason logged once). uint8: ``[F, H, W, 3]`` (B = 1),
    ``((x.clamp(-1, 1) + 1) * 127.5).round()``; other dtypes: ``[B, 3, F, H, W]`` in [-1, 1].
    The result stays on z's device."""
    ok, reason = fast_decode_available(z_raw.device)
    if ok:
        try:
            dec = _decoder_for(vae, z_raw.device)
        except (ValueError, KeyError) as e:  # not a Wan2.2 layout we build
            ok, reason = False, str(e)
    if not ok:
        if reason not in _FALLBACK_LOGGED:
            _FALLBACK_LOGGED.add(reason)
            log.warning("fast VAE decode unavailable, using the reference decoder: %s", reason)
        return _reference_decode(vae, z_raw, out_dtype)
    return dec.decode(z_raw, out_dtype=out_dtype, config=config)
