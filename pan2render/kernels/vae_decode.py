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
- One latent frame per chunk through every layer (it becomes 4 frames, 1 for the first, after
  the temporal upsamplers): more frames per chunk measured no faster and cost memory
  (docs/performance.md). Causality makes the chunking exact: a frame only ever sees earlier
  frames through the histories.
- The mid-block attention (one head, C=1024) as two batched GEMMs with an fp32 softmax between.
- Each resnet's closing add (conv2 bias + residual) is folded into the next RMS-norm kernel, which
  writes the sum back (it is the next residual); small phase convs run as im2col + one GEMM (cuDNN
  picks a slow sm80 kernel there); the head conv (12 output channels) runs as a 2-D conv with its
  three time taps side by side in the output, summed in fp32.
- The decoder runs the units of its plan (``pan2render.vae_plan``) through the public
  ``start_decode`` -> ``FastDecodeRun`` interface, which the split decode over a GPU group
  (``pan2render.parallel.decode``) uses too, so both run the same code.
- Intermediates are dropped as soon as they are consumed; each decoded chunk is written straight
  into the preallocated output (uint8 ``[F, H, W, 3]`` or bf16 ``[B, 3, F, H, W]``).

Its speed, memory and accuracy against diffusers are in docs/performance.md ("VAE decode kernel").

The first latent frame is special, as in the reference: the temporal upsamplers skip their time
conv on it (one frame out, not two) and the duplicate-upsample shortcut keeps only its last
temporal copy. Chunk 0 is that frame alone; the time convs' histories start at zeros on chunk 1.

Entry points: ``choose_decode_path(vae, device)`` (the one decision between this decoder and the
reference one, with its reason, logged once; a group passes its agreement in), ``fast_decode(vae,
z)`` (decodes on the path it chooses), ``fast_decode_available(device)`` and ``fast_decoder_for(vae,
device)`` (the decoder every path runs, built once per VAE).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..vae_plan import DecoderPlan, DecodeUnit, State, UnitKind, decode_frames, decoder_plan, new_video
from . import vae_ops

log = logging.getLogger(__name__)

CACHE_T = 2  # frames of history of a causal 3x3x3 conv (kernel 3 in time, padded 2 in front)
RGB = 3
_OUT_CHANNEL_ALIGN = 16  # conv_out's 12 channels padded to 16: bf16 rows of 32 B keep cuDNN fast
_IN_CHANNEL_ALIGN = 64  # conv_in's input channels padded to a multiple of this


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
    # nearest x2 + the [C, C, 3, 3] conv as four 2x2 phase kernels [4C, C, 2, 2] (vae_ops);
    # None: no upsampler (the last block)
    phase_conv: _Conv | None
    dup_index: torch.Tensor | None  # [factor_t, 2, 2, Cout] int32: the shortcut's channel map
    factor_t: int  # duplicate-upsample shortcut factor in time (1 or 2; 2 in space)


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
    ``decode`` runs the whole video; ``start_decode`` (``vae_plan.UnitDecoder``) hands out a run
    of single units, for a decode split over several GPUs.
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
        self._config = config  # what the decode plan is built from
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
                    phase_conv=g.phase_conv(f"{p}.upsampler.resample.1") if up else None,
                    dup_index=index,
                    factor_t=ft,
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
        self._history: dict[str, torch.Tensor] = {}  # conv key -> [B, 2, H, W, C] history
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
    def decode(self, z: torch.Tensor, *, out_dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Raw latents ``[B, z, T, h, w]`` -> uint8 ``[F, H, W, 3]`` (B must be 1) or
        ``[B, 3, F, H, W]`` in ``out_dtype``, clamped to [-1, 1], F = 1 + 4 (T - 1)."""
        run = self.start_decode(z)
        out = run.new_output(out_dtype)
        with run:
            written = decode_frames(run, out)
        assert written == run.plan.decoded_frames(run.latent_frames), (written, out.shape)
        return out

    def start_decode(self, z: torch.Tensor) -> FastDecodeRun:
        """A decode of raw latents ``z [B, z, T, h, w]`` run unit by unit (``vae_plan.UnitDecoder``):
        what `decode` runs, and what the split decode over a GPU group runs a span of per rank."""
        if z.dim() != 5 or z.shape[1] != self.z_dim or z.shape[2] < 1:
            raise ValueError(f"latents of shape {tuple(z.shape)}: expected [B, {self.z_dim}, T>=1, h, w]")
        return FastDecodeRun(self, z)

    def _claim(self) -> None:
        """Start a decode: fresh causal histories; one decode at a time."""
        if self._busy:
            raise RuntimeError("FastWanDecoder is already decoding; calls must not overlap")
        self._busy = True
        self._history = {}

    def _release(self) -> None:
        self._history = {}
        self._busy = False

    def _post_quant(self, z: torch.Tensor) -> torch.Tensor:
        b, c, n, h, w = z.shape
        zp = torch.zeros(b, CACHE_T + n, h, w, self.z_width, dtype=self.dtype, device=self.device)
        zr = z.to(self.device, self.dtype).permute(0, 2, 3, 4, 1)  # [B, T, h, w, z]
        zp[:, CACHE_T:, :, :, :c] = F.linear(zr, self.post_quant.weight, self.post_quant.bias)
        return zp

    def _run_unit(self, unit: DecodeUnit, state: State, *, first: bool) -> State:
        """One unit of the plan on a chunk's state (see `FastDecodeRun.run_unit`)."""
        x = state.pop("x")
        kind = unit.kind
        if kind is UnitKind.CONV_IN:
            return {**state, "x": _conv3d(x.contiguous(), self.conv_in, pad=1, bias=True)}
        if kind is UnitKind.ATTENTION:
            return {**state, "x": self._attention([x], self.mid_attn)}
        if kind is UnitKind.HEAD:
            buf = self._fill([x], "head", gamma=self.gamma_out, bias=None)
            del x
            return {**state, "x": self._head_by_frame_taps(buf)}
        blk = None if unit.block is None else self.up_blocks[unit.block]
        if kind is UnitKind.UPSAMPLE:  # upsampler + duplicate-upsample shortcut (+ bias)
            assert blk is not None and blk.phase_conv is not None, unit
            holder = [_materialized(x)]  # the callee pops it and frees it once consumed
            del x
            x_in = state.pop("x_in")
            return {**state, "x": self._upsample_phase(holder, blk, f"up.{unit.block}", first=first, x_in=x_in)}
        j = unit.index
        if blk is None:
            res, key = self.mid_resnets[j], f"mid.{j}"
        else:
            res, key = blk.resnets[j], f"up.{unit.block}.resnets.{j}"
        if kind is UnitKind.RES_IN:
            if blk is not None and j == 0 and blk.phase_conv is not None:  # the block's input, for its shortcut
                x = _materialized(x)
                state["x_in"] = x
            buf = self._fill([x], f"{key}.conv1", gamma=res.gamma1, bias=None)  # adds a pending sum
            x = x.y if isinstance(x, _Sum) else x
            # 1x1x1 shortcut conv (one GEMM) when the width changes, else the input itself.
            state["res"] = x if res.shortcut is None else F.linear(x, res.shortcut.weight, res.shortcut.bias)
            del x
            state["x"] = _conv3d(buf, res.conv1, pad=1, bias=False)  # conv1's bias folds into norm2
            return state
        if kind is not UnitKind.RES_OUT:
            raise ValueError(f"FastWanDecoder cannot run a {kind} unit")
        buf = self._fill([x], f"{key}.conv2", gamma=res.gamma2, bias=res.conv1.bias32)
        del x
        y = _conv3d(buf, res.conv2, pad=1, bias=False)
        del buf
        state["x"] = _Sum(y, res.conv2.bias32, state.pop("res"))  # added by the next unit's norm
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
        side (K = 3C, fp32 accumulation): one large GEMM instead of a thin (3, 1, 1) conv."""
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


class FastDecodeRun:
    """`FastWanDecoder`'s side of ``vae_plan.DecodeRun``: activations are rows ``[B, T, H, W, C]``
    in the decoder's dtype, each causal conv keeps its own history. Entering the run claims the
    decoder and turns cuDNN's autotuning on for its convs (its kernels are chosen per shape on
    the first chunk of that shape); leaving it drops the histories and restores torch's flags.

    Inside a rank's span a unit may leave ``state["x"]`` as a pending residual sum that the next
    unit's norm adds; `settle` adds it before the state leaves the run.
    """

    def __init__(self, dec: FastWanDecoder, z: torch.Tensor) -> None:
        self._dec = dec
        self._z = z
        self._zp: torch.Tensor | None = None  # post-quant latents, 2 zero frames in front
        self._stack: ExitStack | None = None
        self.plan: DecoderPlan = decoder_plan(dec._config, height=z.shape[3], width=z.shape[4])
        self.latent_frames: int = z.shape[2]
        self.state_dtype: torch.dtype = dec.dtype

    def __enter__(self) -> FastDecodeRun:
        self._dec._claim()
        stack = ExitStack()
        stack.callback(self._dec._release)
        try:
            stack.enter_context(torch.backends.cudnn.flags(
                enabled=True, benchmark=True, deterministic=False, allow_tf32=torch.backends.cudnn.allow_tf32,
            ))  # fmt: skip
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack, self._stack = self._stack, None
        self._zp = None
        if stack is not None:
            stack.close()

    def latent_input(self, t: int) -> State:
        """Latent frame t after post_quant_conv with its 2 history frames in front (conv_in keeps
        no history of its own: the post-quant latents of every frame are at hand)."""
        if self._zp is None:
            self._zp = self._dec._post_quant(self._z)  # [B, 2 + T, h, w, z]: pointwise, all frames at once
        return {"x": self._zp[:, t : t + 1 + CACHE_T]}

    def run_unit(self, unit: DecodeUnit, state: State, *, first: bool) -> State:
        """Run one unit on a chunk's state and return it. ``state["x"]``: the activation rows
        ``[B, T, H, W, C]``, or a pending resnet sum that the next norm adds; ``"res"`` carries a
        residual block's shortcut between its halves, ``"x_in"`` an up block's input to its
        shortcut. The input is consumed (popped), so it can be freed early."""
        if self._stack is None:
            raise RuntimeError("enter the decode run (with decoder.start_decode(z) as run: ...) before running units")
        return self._dec._run_unit(unit, state, first=first)

    def settle(self, state: State) -> State:
        state["x"] = _materialized(state["x"])
        return state

    def new_output(self, out_dtype: torch.dtype) -> torch.Tensor:
        return new_video(self.plan, self._z.shape, out_dtype, self._dec.device)

    def write(self, state: State, out: torch.Tensor, start: int) -> int:
        y = state["x"]  # [B, f, H, W, >=12] after the head
        self._dec._write(y, out, start)
        return y.shape[1]


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
# latent frames, where cuDNN's best engine is a slow sm80 kernel; docs/performance.md).
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
_FALLBACK_LOGGED: set[str] = set()  # the reasons `log_fallback` has said, once each per process


class DecodePath(NamedTuple):
    """Which decoder a decode runs: the fast one, or the reference one and why (``reason``)."""

    fast: bool
    reason: str = ""  # why the reference decoder runs; "" when the fast one does

    def describe(self) -> str:
        """The path in words, as a pipeline records it beside every video."""
        return "fast decoder" if self.fast else f"reference decoder ({self.reason})"


SWITCHED_OFF = DecodePath(False, "vae_decode_kernel is off")  # the path of a pipeline with the switch off

# What a group of processes makes of this process's own path (``parallel.decode``: every rank
# takes the fast path only if all can); the single-process decoders pass none.
Agreement = Callable[[DecodePath], DecodePath]


def choose_decode_path(
    vae: torch.nn.Module, device: torch.device | str, *, enabled: bool = True, agree: Agreement | None = None
) -> DecodePath:
    """The one decision between the fast decoder and the reference one, for every decode path
    (`fast_decode`, the pipeline's frame decoders, the split decode over a group).

    This process runs the fast decoder when ``enabled`` (the pipeline's ``vae_decode_kernel``),
    `fast_decode_available` on ``device`` and the decoder builds for ``vae`` (its weight copy is
    made here, once, and kept for the decode). ``agree`` turns that answer into the group's, so
    every rank takes the same path. A fallback's reason is logged once per process
    (`log_fallback`). Out of memory while building is raised, not a fallback: the reference
    decoder needs more memory, not less.
    """
    path = _local_decode_path(vae, device, enabled=enabled)
    if agree is not None:
        path = agree(path)
    if not path.fast:
        log_fallback(path.reason)
    return path


def _local_decode_path(vae: torch.nn.Module, device: torch.device | str, *, enabled: bool) -> DecodePath:
    if not enabled:
        return SWITCHED_OFF
    ok, reason = fast_decode_available(device)
    if not ok:
        return DecodePath(False, reason)
    try:
        fast_decoder_for(vae, device)
    except torch.cuda.OutOfMemoryError:
        raise
    except (ValueError, KeyError, RuntimeError) as e:  # not a Wan2.2 decoder layout, or a broken state dict
        return DecodePath(False, f"the fast decoder cannot take this VAE ({e})")
    return DecodePath(True)


def log_fallback(reason: str) -> None:
    """Say once per process and reason that the reference decoder runs instead of the fast one."""
    if reason not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(reason)
        log.info("vae_decode_kernel: the reference decoder runs: %s", reason)


def _resolved(device: torch.device | str) -> torch.device:
    """``device`` with its index: "cuda" is the current CUDA device, so both spellings share a probe
    and a built decoder."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
    key = str(_resolved(device))
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
    except Exception as e:  # noqa: BLE001 - a failed build must not fail the render: fall back and say why
        return False, f"the Triton kernels failed to build or run ({type(e).__name__}: {e})"
    return True, ""


def fast_decoder_for(vae: torch.nn.Module, device: torch.device | str) -> FastWanDecoder:
    """The fast decoder of ``vae`` on ``device`` (built on first use, kept while ``vae`` lives):
    the one every decode path runs once `choose_decode_path` chose it. Raises ValueError /
    KeyError for a VAE it does not build."""
    device = _resolved(device)
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
) -> torch.Tensor:
    """Decode raw latents ``[B, 48, T, h, w]`` with the fast decoder where it can run, else with
    ``vae.decode`` (`choose_decode_path` decides, and logs the reason once). uint8: ``[F, H, W, 3]``
    (B = 1), ``((x.clamp(-1, 1) + 1) * 127.5).round()``; other dtypes: ``[B, 3, F, H, W]`` in
    [-1, 1]. The result stays on z's device."""
    if not choose_decode_path(vae, z_raw.device).fast:
        return _reference_decode(vae, z_raw, out_dtype)
    return fast_decoder_for(vae, z_raw.device).decode(z_raw, out_dtype=out_dtype)
