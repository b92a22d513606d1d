"""Wan2.2 VAE (the Wan2.2-TI2V-5B video autoencoder) in plain PyTorch.

Our own implementation of what diffusers 0.42.1 ships as ``AutoencoderKLWan`` with the Wan2.2 config
(``diffusers/models/autoencoders/autoencoder_kl_wan.py``). With the same weights it gives the same
``encode`` means and ``decode`` videos (``tests/models/test_vae.py`` builds both from one random
state dict), and its ``state_dict()`` keys are diffusers' keys, so a diffusers ``vae/`` checkpoint loads
by a plain key match (checkpoint keys are permanent API). Reading a model folder lives in
``pan2render/models/loading.py``, not here.

Geometry (released config): RGB ``[B, 3, F, H, W]`` is patchified 2x2 into 12 channels, the encoder
halves H/W three times and T twice (causally: frame 0 alone, then chunks of 4 frames), giving
``[B, 48, 1 + (F - 1) / 4, H / 16, W / 16]``. The decoder mirrors it: T latent frames decode to
``1 + 4 (T - 1)`` frames, one latent frame per pass, with a 2-frame history per causal conv.

Numerics: the norms (+ SiLU) and the residual adds are the fast decoder's op references
(``pan2render.kernels.vae_ops``: ``rms_norm_act_reference``, ``add_bias_residual_reference``), the
ones its kernels are tested against: fp32 math, one rounding. In fp32 that is diffusers' result;
in bf16 diffusers rounds a norm after each step and we do not, which puts our bf16 decode no
further from the fp32 one than diffusers' bf16 decode (``tests/models/test_vae.py``).

Read bottom-up: config, helpers, leaf modules, blocks, encoder/decoder, the public ``WanVAE`` last.
The decoder's submodule names are diffusers' names on purpose: the fast decoder
(``pan2render/kernels``) reads this module's weights by those names. The decoder runs the units of
its plan (``pan2render.vae_plan``), as the fast decoder and the split decode over a GPU group do:
`WanVAE.start_decode` is its side of that interface.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.vae_decode import to_uint8_frames
from ..kernels.vae_ops import add_bias_residual_reference, rms_norm_act_reference
from ..vae_plan import DecoderPlan, DecodeUnit, State, UnitKind, decode_frames, decoder_plan, new_video

# Frames of history a 3-tap causal conv needs from the previous chunk.
CACHE_T = 2

# latents_mean / latents_std of the released Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json
# (the same 48 values as diffusers' scripts/convert_wan_to_diffusers.py `vae22_diffusers_config`).
WAN22_LATENTS_MEAN: tuple[float, ...] = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD: tuple[float, ...] = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip

RGB_CHANNELS = 3  # the same constant as vae_plan's


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WanVAEConfig:
    """Hyperparameters of the Wan2.2 VAE. Field names are diffusers' ``vae/config.json`` keys
    (spelling included: ``temperal_downsample``); defaults reproduce the released Wan2.2-TI2V-5B VAE.

    Only the Wan2.2 architecture is built (residual blocks, patch 2, no attention outside the mid
    block, 4x temporal compression); any other value raises ``ValueError`` naming the key.
    """

    base_dim: int = 160  # encoder width before dim_mult
    decoder_base_dim: int | None = 256  # decoder width before dim_mult; None = base_dim
    z_dim: int = 48  # latent channels
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)  # width multiplier per stage, encoder order
    num_res_blocks: int = 2  # residual blocks per encoder stage (decoder stages have one more)
    attn_scales: tuple[float, ...] = ()  # must be empty: Wan2.2 has attention only in the mid block
    # Per encoder downsample: also halve T? The decoder upsamples in the reverse order.
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0  # residual-block dropout (training only)
    latents_mean: tuple[float, ...] = WAN22_LATENTS_MEAN  # per-channel latent statistics, z_dim long
    latents_std: tuple[float, ...] = WAN22_LATENTS_STD
    is_residual: bool = True  # Wan2.2 residual down/up blocks; False (Wan2.1) is not built here
    in_channels: int = 12  # encoder input channels = RGB x patch_size^2
    out_channels: int = 12  # decoder output channels = RGB x patch_size^2
    patch_size: int | None = 2  # pixel patchify before the encoder / after the decoder
    scale_factor_temporal: int | None = 4  # frames per latent frame (after the first)
    scale_factor_spatial: int | None = 16  # pixels per latent pixel
    # Recorded so a released config.json round-trips. The released file says false, but diffusers
    # 0.42.1 has no such argument and always clamps decode output to [-1, 1] (as does the original
    # Wan2.2 code), so decode clamps whatever this says.
    clip_output: bool = False

    def __post_init__(self) -> None:
        # JSON gives lists; store tuples so the config is immutable and hashable.
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"WanVAEConfig.{name}={value!r}: must be a list of numbers")
            object.__setattr__(self, name, tuple(value))
        for name in ("base_dim", "z_dim", "num_res_blocks", "in_channels", "out_channels"):
            _check_positive_int(name, getattr(self, name))
        if self.decoder_base_dim is not None:
            _check_positive_int("decoder_base_dim", self.decoder_base_dim)
        for i, m in enumerate(self.dim_mult):
            _check_positive_int(f"dim_mult[{i}]", m)
        self._check_supported_architecture()
        self._check_geometry()
        self._check_latent_stats()

    def _check_supported_architecture(self) -> None:
        if self.is_residual is not True:
            raise ValueError(
                f"WanVAEConfig.is_residual={self.is_residual!r}: only the Wan2.2 residual VAE "
                "(is_residual=true) is supported; the Wan2.1 VAE is not built here"
            )
        if len(self.attn_scales) != 0:
            raise ValueError(
                f"WanVAEConfig.attn_scales={list(self.attn_scales)!r}: only [] is supported (Wan2.2 "
                "has attention only in the mid blocks)"
            )
        if self.patch_size != 2:
            raise ValueError(
                f"WanVAEConfig.patch_size={self.patch_size!r}: only 2 is supported (the Wan2.2 VAE)"
            )
        io = RGB_CHANNELS * self.patch_size**2
        for name in ("in_channels", "out_channels"):
            if getattr(self, name) != io:
                raise ValueError(
                    f"WanVAEConfig.{name}={getattr(self, name)!r}: must be {io} "
                    f"(3 RGB channels x patch_size {self.patch_size}^2)"
                )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"WanVAEConfig.dropout={self.dropout!r}: must be in [0, 1)")
        if not isinstance(self.clip_output, bool):
            raise ValueError(f"WanVAEConfig.clip_output={self.clip_output!r}: must be true or false")

    def _check_geometry(self) -> None:
        stages = len(self.dim_mult)
        if stages < 2:
            raise ValueError(f"WanVAEConfig.dim_mult={list(self.dim_mult)!r}: needs at least 2 stages")
        if len(self.temperal_downsample) != stages - 1 or not all(
            isinstance(b, bool) for b in self.temperal_downsample
        ):
            raise ValueError(
                f"WanVAEConfig.temperal_downsample={list(self.temperal_downsample)!r}: must be "
                f"{stages - 1} booleans (one per downsample of dim_mult={list(self.dim_mult)})"
            )
        if sum(self.temperal_downsample) != 2 or self.scale_factor_temporal != 4:
            # The causal chunking (frame 0 alone, then 4 frames per latent frame) is the released
            # geometry and the only one diffusers' encode chunks by.
            raise ValueError(
                f"WanVAEConfig.scale_factor_temporal={self.scale_factor_temporal!r} with "
                f"temperal_downsample={list(self.temperal_downsample)!r}: only 4x temporal "
                "compression (scale_factor_temporal=4, exactly two true entries) is supported"
            )
        spatial = self.patch_size * 2 ** (stages - 1)
        if self.scale_factor_spatial != spatial:
            raise ValueError(
                f"WanVAEConfig.scale_factor_spatial={self.scale_factor_spatial!r}: must be {spatial} "
                f"(patch_size {self.patch_size} x 2^{stages - 1} downsamples of dim_mult)"
            )
        # The average-down / duplicate-up shortcuts regroup channels x (2x2[x2]) positions.
        enc = self.encoder_dims
        for i in range(stages - 1):
            factor = 4 * (2 if self.temperal_downsample[i] else 1)
            if enc[i] * factor % enc[i + 1]:
                raise ValueError(
                    f"WanVAEConfig.dim_mult={list(self.dim_mult)!r}: encoder stage {i} width "
                    f"{enc[i]} x {factor} is not divisible by the next width {enc[i + 1]}"
                )
        dec, up_t = self.decoder_dims, self.temperal_downsample[::-1]
        for i in range(stages - 1):
            factor = 4 * (2 if up_t[i] else 1)
            if dec[i + 1] * factor % dec[i]:
                raise ValueError(
                    f"WanVAEConfig.dim_mult={list(self.dim_mult)!r}: decoder stage {i} width "
                    f"{dec[i + 1]} x {factor} is not divisible by its input width {dec[i]}"
                )

    def _check_latent_stats(self) -> None:
        for name in ("latents_mean", "latents_std"):
            values = getattr(self, name)
            if len(values) != self.z_dim:
                raise ValueError(
                    f"WanVAEConfig.{name} has {len(values)} values: must have z_dim={self.z_dim}"
                )
            if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
                raise ValueError(f"WanVAEConfig.{name}: every value must be a finite number")
        if min(self.latents_std) <= 0:
            raise ValueError(
                f"WanVAEConfig.latents_std has min {min(self.latents_std)!r}: every value must be > 0"
            )

    @property
    def encoder_dims(self) -> list[int]:
        """Encoder widths: stem, then one per stage (released: 160, 160, 320, 640, 640)."""
        return [self.base_dim * m for m in (1, *self.dim_mult)]

    @property
    def decoder_dims(self) -> list[int]:
        """Decoder widths: mid block, then one per stage (released: 1024, 1024, 1024, 512, 256)."""
        d = self.base_dim if self.decoder_base_dim is None else self.decoder_base_dim
        return [d * m for m in (self.dim_mult[-1], *self.dim_mult[::-1])]

    def decoded_frames(self, latent_frames: int) -> int:
        """Video frames that ``latent_frames`` latent frames decode to: ``1 + 4 (T - 1)``."""
        return 1 + self.scale_factor_temporal * (latent_frames - 1)

    def latent_frames(self, frames: int) -> int:
        """Latent frames a ``1 + 4k``-frame video encodes to."""
        return 1 + (frames - 1) // self.scale_factor_temporal

    def to_dict(self) -> dict[str, Any]:
        """The diffusers config.json keys and values (lists, as in the released file)."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WanVAEConfig:
        """Build from a diffusers ``vae/config.json`` dict.

        Keys starting with ``_`` (``_class_name``, ``_diffusers_version``, ``_name_or_path``) only
        matter to diffusers and are ignored; any other unknown key raises, so a typo never passes.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in known and not k.startswith("_"))
        if unknown:
            raise ValueError(
                f"WanVAEConfig: unknown key(s) {unknown}; known keys are {sorted(known)}"
            )
        return cls(**{k: v for k, v in d.items() if k in known})


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"WanVAEConfig.{name}={value!r}: must be a positive integer")


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def patchify(x: torch.Tensor, *, patch: int) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, C * p * p, T, H / p, W / p]; channel = c * p^2 + dw * p + dh.

    The width offset is the slower of the two (diffusers' layout, which the weights assume).
    """
    b, c, t, h, w = x.shape
    x = x.view(b, c, t, h // patch, patch, w // patch, patch)  # [B, C, T, h, dh, w, dw]
    x = x.permute(0, 1, 6, 4, 2, 3, 5)  # [B, C, dw, dh, T, h, w]
    return x.reshape(b, c * patch * patch, t, h // patch, w // patch)


def unpatchify(x: torch.Tensor, *, patch: int) -> torch.Tensor:
    """Inverse of :func:`patchify`: [B, C * p * p, T, h, w] -> [B, C, T, h * p, w * p]."""
    b, cpp, t, h, w = x.shape
    c = cpp // (patch * patch)
    x = x.view(b, c, patch, patch, t, h, w)  # [B, C, dw, dh, T, h, w]
    x = x.permute(0, 1, 4, 5, 3, 6, 2)  # [B, C, T, h, dh, w, dw]
    return x.reshape(b, c, t, h * patch, w * patch)


class _FirstChunkSkipped:
    """Cache marker: a temporal upsampler let the first chunk through without its time conv."""


FIRST_CHUNK_SKIPPED = _FirstChunkSkipped()


class CausalCache:
    """The history every causal layer keeps between chunks of one encode or decode.

    Layers claim slots in call order; every chunk runs the same layers in the same order, so the
    n-th claim of a chunk is the same layer's slot as the n-th claim of the previous chunk.
    ``rewind()`` before each chunk, ``clear()`` when done (it drops every tensor at once).
    A decode that runs the decoder unit by unit gives each unit its own `scope`, so a process that
    runs only some of the units (a split decode) keeps exactly their histories.
    """

    def __init__(self) -> None:
        self._slots: list[Any] = []
        self._cursor = 0
        self._scopes: dict[Hashable, CausalCache] = {}

    def rewind(self) -> None:
        self._cursor = 0

    def scope(self, key: Hashable) -> CausalCache:
        """The history of one unit of work (its own slots, rewound), created on first use."""
        child = self._scopes.get(key)
        if child is None:
            child = self._scopes[key] = CausalCache()
        child.rewind()
        return child

    def claim(self) -> int:
        """Index of the next layer's slot (``None`` on a layer's first chunk)."""
        if self._cursor == len(self._slots):
            self._slots.append(None)
        self._cursor += 1
        return self._cursor - 1

    def __getitem__(self, i: int) -> Any:
        return self._slots[i]

    def __setitem__(self, i: int, value: Any) -> None:
        self._slots[i] = value

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from (s for s in self._slots if isinstance(s, torch.Tensor))
        for child in self._scopes.values():
            yield from child.tensors()

    def clear(self) -> None:
        for child in self._scopes.values():
            child.clear()
        self._scopes.clear()
        self._slots.clear()
        self._cursor = 0


# --------------------------------------------------------------------------------------------------
# Leaf modules
# --------------------------------------------------------------------------------------------------


class CausalConv3d(nn.Conv3d):
    """3-D conv that sees only the current and past frames.

    Spatial padding is the conv's own zero padding; in time the input is preceded by ``2 * pad_t``
    frames: zeros at the start of the video, else the last ``CACHE_T`` frames of the previous chunk
    (taken from ``cache``). Chunked with the cache, the result equals one pass over the whole video.
    Weights: ``weight [out, in, kt, kh, kw]``, ``bias [out]`` (diffusers' ``WanCausalConv3d``).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int, int],
        *,
        stride: int | tuple[int, int, int] = 1,
        padding: int | tuple[int, int, int] = 0,
    ) -> None:
        pt, ph, pw = (padding,) * 3 if isinstance(padding, int) else padding
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=(0, ph, pw))
        self.time_pad = 2 * pt  # all of it in front: causal

    def step(
        self, x: torch.Tensor, history: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk: ``x [B, C, t, H, W]`` after ``history [B, C, <=2, H, W]`` (None: video start).

        Returns the output and the history for the next chunk (the last ``CACHE_T`` input frames).
        """
        ctx = x if history is None else torch.cat([history.to(x.device), x], dim=2)
        new_history = ctx[:, :, -CACHE_T:].clone()  # a copy, so the chunk itself can be freed
        missing = self.time_pad - (ctx.shape[2] - x.shape[2])  # zero frames still owed in front
        if missing > 0:
            ctx = F.pad(ctx, (0, 0, 0, 0, missing, 0))
        return super().forward(ctx), new_history

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        if self.time_pad == 0:
            return super().forward(x)
        if cache is None:  # the whole video in one pass
            return super().forward(F.pad(x, (0, 0, 0, 0, self.time_pad, 0)))
        slot = cache.claim()
        y, cache[slot] = self.step(x, cache[slot])
        return y


class RMSNorm(nn.Module):
    """RMS norm over channels (dim 1): ``x / ||x||_2 * sqrt(C) * gamma``, then SiLU when ``silu``
    (where the decoder applies one right after the norm). ``gamma`` is ``[C, 1, 1, 1]`` for 5-D
    inputs and ``[C, 1, 1]`` for per-frame 4-D ones (diffusers' shapes, so checkpoints load
    unchanged). No bias in the Wan2.2 VAE.

    The math is the fast decoder's op reference (``vae_ops.rms_norm_act_reference``: fp32, one
    rounding to x's dtype), so the kernel tests and this decoder check one definition.
    """

    def __init__(self, dim: int, *, spatial_dims: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim, *(1,) * spatial_dims))

    def forward(self, x: torch.Tensor, *, silu: bool = False) -> torch.Tensor:
        return rms_norm_act_reference(x, self.gamma, silu=silu, dim=1)


class Upsample2x(nn.Module):
    """Nearest x2 in H and W, computed in fp32 (diffusers' ``WanUpsample``).

    [N, C, H, W] -> [N, C, 2H, 2W].
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").to(x.dtype)


class AvgDown3D(nn.Module):
    """Parameter-free shortcut of a down block: fold a (ft, 2, 2) neighbourhood into channels and
    average groups of them down to ``out_channels``.
    [B, C, T, H, W] -> [B, out, T / ft, H / fs, W / fs].
    A chunk whose length is not a multiple of ft is zero-padded in front (frame 0 of the video).
    """

    def __init__(self, in_channels: int, out_channels: int, *, factor_t: int, factor_s: int) -> None:
        super().__init__()
        self.out_channels = out_channels
        self.factor_t = factor_t
        self.factor_s = factor_s
        self.group = in_channels * factor_t * factor_s * factor_s // out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ft, fs = self.factor_t, self.factor_s
        x = F.pad(x, (0, 0, 0, 0, (-x.shape[2]) % ft, 0))
        b, c, t, h, w = x.shape
        x = x.view(b, c, t // ft, ft, h // fs, fs, w // fs, fs)  # [B, C, t, ft, h, fs, w, fs]
        x = x.permute(0, 1, 3, 5, 7, 2, 4, 6)  # [B, C, ft, fs_h, fs_w, t, h, w]
        x = x.reshape(b, self.out_channels, self.group, t // ft, h // fs, w // fs)
        return x.mean(dim=2)


class DupUp3D(nn.Module):
    """Parameter-free shortcut of an up block (inverse layout of :class:`AvgDown3D`): repeat
    channels, then unfold them into a (ft, 2, 2) neighbourhood.
    [B, C, T, H, W] -> [B, out, T * ft, H * fs, W * fs]; on the video's first chunk the first
    ``ft - 1`` frames are dropped (the causal first frame does not upsample in time).
    """

    def __init__(self, in_channels: int, out_channels: int, *, factor_t: int, factor_s: int) -> None:
        super().__init__()
        self.out_channels = out_channels
        self.factor_t = factor_t
        self.factor_s = factor_s
        self.repeats = out_channels * factor_t * factor_s * factor_s // in_channels

    def forward(self, x: torch.Tensor, *, first_chunk: bool = False) -> torch.Tensor:
        ft, fs = self.factor_t, self.factor_s
        b, _, t, h, w = x.shape
        x = x.repeat_interleave(self.repeats, dim=1)
        x = x.view(b, self.out_channels, ft, fs, fs, t, h, w)  # [B, out, ft, fs_h, fs_w, T, H, W]
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4)  # [B, out, T, ft, H, fs_h, W, fs_w]
        x = x.reshape(b, self.out_channels, t * ft, h * fs, w * fs)
        return x[:, :, ft - 1 :] if first_chunk else x


class Resample(nn.Module):
    """2x spatial up/downsampling of a stage, optionally with 2x in time.

    ``resample`` is ``Sequential(<non-parametric>, Conv2d)`` and applies per frame; ``time_conv``
    (temporal modes only) is a causal (3, 1, 1) conv. Up in time: the conv makes 2x channels that
    become 2 frames each. Down in time: a stride-2 conv over the previous chunk's last frame + this
    chunk. The video's first frame is passed through in time by both (the causal first frame).
    """

    def __init__(self, dim: int, *, up: bool, temporal: bool, out_dim: int | None = None) -> None:
        super().__init__()
        self.up = up
        self.temporal = temporal
        if up:
            self.resample = nn.Sequential(Upsample2x(), nn.Conv2d(dim, out_dim or dim, 3, padding=1))
            if temporal:
                self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        else:
            # Pad right/bottom by one so the stride-2 3x3 conv covers every pixel pair.
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
            if temporal:
                self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))

    def _per_frame(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        x = x.transpose(1, 2).reshape(b * t, c, h, w)  # [B*T, C, H, W]
        x = self.resample(x)
        return x.view(b, t, *x.shape[1:]).transpose(1, 2)  # [B, C', T, H', W']

    def _time_up(self, x: torch.Tensor, cache: CausalCache | None) -> torch.Tensor:
        if cache is None:  # whole-video path is not used by WanVAE; mirror the chunked one
            raise RuntimeError("temporal upsampling needs a CausalCache (decode chunk by chunk)")
        slot = cache.claim()
        state = cache[slot]
        if state is None:  # first chunk: no time conv, 1 frame stays 1 frame
            cache[slot] = FIRST_CHUNK_SKIPPED
            return x
        # After the skipped first chunk the history is zeros (the first frame is not seen).
        history = None if state is FIRST_CHUNK_SKIPPED else state
        y, cache[slot] = self.time_conv.step(x, history)  # [B, 2C, T, H, W]
        b, c, t, h, w = x.shape
        y = y.view(b, 2, c, t, h, w)
        return torch.stack((y[:, 0], y[:, 1]), dim=3).view(b, c, 2 * t, h, w)  # frames interleaved

    def _time_down(self, x: torch.Tensor, cache: CausalCache | None) -> torch.Tensor:
        if cache is None:
            raise RuntimeError("temporal downsampling needs a CausalCache (encode chunk by chunk)")
        slot = cache.claim()
        last = cache[slot]
        cache[slot] = x[:, :, -1:].clone()
        if last is None:  # first chunk: 1 frame stays 1 frame
            return x
        return self.time_conv(torch.cat([last[:, :, -1:].to(x.device), x], dim=2))

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        if self.up:
            if self.temporal:
                x = self._time_up(x, cache)
            return self._per_frame(x)
        x = self._per_frame(x)
        return self._time_down(x, cache) if self.temporal else x


# --------------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------------


class ResidualBlock(nn.Module):
    """norm1 -> SiLU -> conv1 -> norm2 -> SiLU -> dropout -> conv2, plus a 1x1x1 conv shortcut when
    the width changes. Both convs are causal 3x3x3."""

    def __init__(self, in_dim: int, out_dim: int, *, dropout: float) -> None:
        super().__init__()
        self.norm1 = RMSNorm(in_dim, spatial_dims=3)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim, spatial_dims=3)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        return self.second_half(*self.first_half(x, cache), cache)

    def first_half(
        self, x: torch.Tensor, cache: CausalCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv1's output, the shortcut of x): the decoder's unit may end a rank's span here."""
        return self.conv1(self.norm1(x, silu=True), cache), self.conv_shortcut(x)

    def second_half(
        self, h: torch.Tensor, shortcut: torch.Tensor, cache: CausalCache | None = None
    ) -> torch.Tensor:
        y = self.conv2(self.dropout(self.norm2(h, silu=True)), cache)
        return add_bias_residual_reference(y, bias=None, residual=shortcut)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H*W positions of each frame (no mask), residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, spatial_dims=2)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)  # [B*T, C, H, W]
        qkv = self.to_qkv(self.norm(frames)).view(b * t, 3 * c, h * w)  # [B*T, 3C, HW]
        qkv = qkv.transpose(1, 2).unsqueeze(1)  # [B*T, 1 head, HW, 3C]
        q, k, v = qkv.chunk(3, dim=-1)  # each [B*T, 1, HW, C]
        o = F.scaled_dot_product_attention(q, k, v)  # [B*T, 1, HW, C]
        o = o.squeeze(1).transpose(1, 2).reshape(b * t, c, h, w)
        o = self.proj(o)
        return add_bias_residual_reference(x, bias=None, residual=o.view(b, t, c, h, w).transpose(1, 2))


class MidBlock(nn.Module):
    """resnets[0] -> attentions[0] -> resnets[1] at the lowest resolution."""

    def __init__(self, dim: int, *, dropout: float) -> None:
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])  # registered first, as in diffusers
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim, dropout=dropout) for _ in range(2)])

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        x = self.resnets[0](x, cache)
        x = self.attentions[0](x)
        return self.resnets[1](x, cache)


class ResidualDownBlock(nn.Module):
    """Encoder stage: residual blocks, then (except the last stage) a downsampler; plus the
    parameter-free average-down shortcut of the stage input."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        num_res_blocks: int,
        dropout: float,
        temporal: bool,
        down: bool,
    ) -> None:
        super().__init__()
        self.avg_shortcut = AvgDown3D(
            in_dim, out_dim, factor_t=2 if temporal else 1, factor_s=2 if down else 1
        )
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nn.ModuleList(
            [ResidualBlock(i, o, dropout=dropout) for i, o in zip(dims[:-1], dims[1:])]
        )
        self.downsampler = Resample(out_dim, up=False, temporal=temporal) if down else None

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        shortcut = self.avg_shortcut(x)
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.downsampler is not None:
            x = self.downsampler(x, cache)
        return add_bias_residual_reference(x, bias=None, residual=shortcut)


class ResidualUpBlock(nn.Module):
    """Decoder stage: ``num_res_blocks + 1`` residual blocks, then (except the last stage) an
    upsampler; plus the duplicate-up shortcut of the stage input, added after the upsampler.
    Run by `Decoder3d.run_unit`, unit by unit."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        num_res_blocks: int,
        dropout: float,
        temporal: bool,
        up: bool,
    ) -> None:
        super().__init__()
        self.avg_shortcut = (
            DupUp3D(in_dim, out_dim, factor_t=2 if temporal else 1, factor_s=2) if up else None
        )
        dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
        self.resnets = nn.ModuleList(
            [ResidualBlock(i, o, dropout=dropout) for i, o in zip(dims[:-1], dims[1:])]
        )
        self.upsampler = (
            Resample(out_dim, up=True, temporal=temporal, out_dim=out_dim) if up else None
        )


# --------------------------------------------------------------------------------------------------
# Encoder / decoder
# --------------------------------------------------------------------------------------------------


class Encoder3d(nn.Module):
    """[B, 12, t, H/2, W/2] patchified chunk -> [B, 2 z, 1 latent frame, H/16, W/16] (mean, logvar)."""

    def __init__(self, cfg: WanVAEConfig) -> None:
        super().__init__()
        dims = cfg.encoder_dims
        last = len(cfg.dim_mult) - 1
        self.conv_in = CausalConv3d(cfg.in_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            [
                ResidualDownBlock(
                    dims[i],
                    dims[i + 1],
                    num_res_blocks=cfg.num_res_blocks,
                    dropout=cfg.dropout,
                    temporal=i != last and cfg.temperal_downsample[i],
                    down=i != last,
                )
                for i in range(last + 1)
            ]
        )
        self.mid_block = MidBlock(dims[-1], dropout=cfg.dropout)
        self.norm_out = RMSNorm(dims[-1], spatial_dims=3)
        self.conv_out = CausalConv3d(dims[-1], cfg.z_dim * 2, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.conv_in(x, cache)
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)
        return self.conv_out(self.norm_out(x, silu=True), cache)


class Decoder3d(nn.Module):
    """[B, z, 1 latent frame, h, w] -> [B, 12, 1 (first chunk) or 4 frames, 8h, 8w] (patchified),
    as the units of ``vae_plan.decoder_plan(cfg)``, each run by `run_unit`."""

    def __init__(self, cfg: WanVAEConfig) -> None:
        super().__init__()
        dims = cfg.decoder_dims
        last = len(cfg.dim_mult) - 1
        up_t = cfg.temperal_downsample[::-1]
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0], dropout=cfg.dropout)
        self.up_blocks = nn.ModuleList(
            [
                ResidualUpBlock(
                    dims[i],
                    dims[i + 1],
                    num_res_blocks=cfg.num_res_blocks,
                    dropout=cfg.dropout,
                    temporal=i != last and up_t[i],
                    up=i != last,
                )
                for i in range(last + 1)
            ]
        )
        self.norm_out = RMSNorm(dims[-1], spatial_dims=3)
        self.conv_out = CausalConv3d(dims[-1], cfg.out_channels, 3, padding=1)

    def run_unit(self, unit: DecodeUnit, state: State, cache: CausalCache, *, first: bool) -> State:
        """One unit of the plan on a chunk's state (``"x"``: ``[B, C, t, H, W]``; ``"res"``, ``"x_in"``:
        see ``vae_plan.STATE_KEYS``); ``cache`` holds this unit's causal history. ``first``: the
        chunk is the video's first latent frame (the duplicate-upsample shortcut keeps one frame)."""
        x = state.pop("x")
        kind = unit.kind
        if kind is UnitKind.CONV_IN:
            return {**state, "x": self.conv_in(x, cache)}
        if kind is UnitKind.HEAD:
            return {**state, "x": self.conv_out(self.norm_out(x, silu=True), cache)}
        if unit.block is None:
            if kind is UnitKind.ATTENTION:
                return {**state, "x": self.mid_block.attentions[0](x)}
            res = self.mid_block.resnets[unit.index]
        else:
            block = self.up_blocks[unit.block]
            if kind is UnitKind.UPSAMPLE:
                assert block.upsampler is not None and block.avg_shortcut is not None, unit
                shortcut = block.avg_shortcut(state.pop("x_in"), first_chunk=first)
                up = block.upsampler(x, cache)
                return {**state, "x": add_bias_residual_reference(up, bias=None, residual=shortcut)}
            res = block.resnets[unit.index]
            if kind is UnitKind.RES_IN and unit.index == 0 and block.avg_shortcut is not None:
                state["x_in"] = x  # the block's input, for its shortcut after the upsampler
        if kind is UnitKind.RES_IN:
            state["x"], state["res"] = res.first_half(x, cache)
        else:
            state["x"] = res.second_half(x, state.pop("res"), cache)
        return state


# --------------------------------------------------------------------------------------------------
# Public model
# --------------------------------------------------------------------------------------------------


class WanVAE(nn.Module):
    """The Wan2.2 VAE. ``state_dict()`` keys equal diffusers' ``AutoencoderKLWan`` keys.

    ``encode``: RGB video in [-1, 1] -> raw posterior mean. ``decode``: raw latents -> RGB video in
    [-1, 1]. Use ``normalize_latents`` / ``denormalize_latents`` to move between raw latents and the
    normalised ones the DiT works in. Call under ``torch.inference_mode()`` for rendering.
    """

    def __init__(self, config: WanVAEConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else WanVAEConfig()
        cfg = self.config
        # Registration order = diffusers' order, so the state dicts list keys alike.
        self.encoder = Encoder3d(cfg)
        self.quant_conv = CausalConv3d(cfg.z_dim * 2, cfg.z_dim * 2, 1)
        self.post_quant_conv = CausalConv3d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder3d(cfg)
        # The causal history of the encode/decode in progress; None otherwise (see _run_cached and
        # WanDecodeRun).
        self._cache: CausalCache | None = None

    # ---- latent statistics ------------------------------------------------------------------

    def _latent_stats(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, 1 / std) as [1, z, 1, 1, 1] in z's dtype, built exactly as pipeline_wan.py does
        (std cast to z's dtype first, then inverted), so results match the diffusers pipeline
        bitwise."""
        shape = (1, self.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.config.latents_mean).view(shape).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(self.config.latents_std).view(shape).to(z.device, z.dtype)
        return mean, inv_std

    def normalize_latents(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latents -> normalised: ``(z - mean) * (1 / std)``."""
        self._check_latents(z)
        mean, inv_std = self._latent_stats(z)
        return (z - mean) * inv_std

    def denormalize_latents(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> raw: ``z / (1 / std) + mean`` (pipeline_wan.py before decode)."""
        self._check_latents(z)
        mean, inv_std = self._latent_stats(z)
        return z / inv_std + mean

    # ---- encode / decode ----------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """RGB ``[B, 3, F, H, W]`` in [-1, 1], F = 1 + 4k, H and W multiples of 16 ->
        raw posterior mean ``[B, z, 1 + k, H / 16, W / 16]`` (diffusers'
        ``encode(x).latent_dist.mean``)."""
        cfg = self.config
        self._check_video(x)
        b, _, frames, height, width = x.shape
        s = cfg.scale_factor_spatial
        x = patchify(x, patch=cfg.patch_size)  # [B, 12, F, H/2, W/2]
        n = cfg.latent_frames(frames)
        mean = x.new_empty(b, cfg.z_dim, n, height // s, width // s)
        ft = cfg.scale_factor_temporal

        def run(cache: CausalCache) -> None:
            for t in range(n):
                # Chunk t: frame 0 alone, then frames 1+4(t-1) .. 4t.
                f0, f1 = (0, 1) if t == 0 else (1 + ft * (t - 1), 1 + ft * t)
                cache.rewind()
                h = self.quant_conv(self.encoder(x[:, :, f0:f1], cache))  # [B, 2z, 1, h, w]
                mean[:, :, t : t + 1] = h[:, : cfg.z_dim]

        self._run_cached(run)
        return mean

    def decode(self, z: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Raw latents ``[B, z, T, h, w]`` -> RGB ``[B, 3, 1 + 4 (T - 1), 16 h, 16 w]`` clamped to
        [-1, 1] (diffusers' ``decode(z).sample``).

        One latent frame at a time through the decoder's units; each one's frames are written
        straight into one preallocated output (no growing concatenation); the causal cache is
        dropped when done, also on error.

        Args:
            z: raw (un-normalised) latents; see ``denormalize_latents``.
            out_dtype: dtype of the returned video (default: z's dtype, as diffusers). Frames are
                clamped in the compute dtype and then cast.
        """
        with self.start_decode(z) as run:
            video = run.new_output(out_dtype or z.dtype)
            written = decode_frames(run, video)
        assert written == video.shape[2], (written, video.shape)
        return video

    def start_decode(self, z: torch.Tensor) -> WanDecodeRun:
        """A decode of raw latents ``z`` run unit by unit (``vae_plan.UnitDecoder``): what `decode`
        runs, and what the split decode over a GPU group runs a span of per rank."""
        self._check_latents(z)
        return WanDecodeRun(self, z)

    def _run_cached(self, run: Callable[[CausalCache], None]) -> None:
        """Run a chunked pass with a fresh causal cache and always drop the cache's tensors after,
        so a failed decode (whose traceback may keep frames alive) does not pin its history."""
        if self._cache is not None:
            raise RuntimeError("WanVAE is already encoding or decoding; calls must not overlap")
        cache = self._cache = CausalCache()
        try:
            run(cache)
        finally:
            cache.clear()
            self._cache = None

    # ---- input checks -----------------------------------------------------------------------

    def _check_latents(self, z: torch.Tensor) -> None:
        if z.dim() != 5 or z.shape[1] != self.config.z_dim or z.shape[2] < 1:
            raise ValueError(
                f"latents of shape {tuple(z.shape)}: expected [B, {self.config.z_dim}, T>=1, h, w]"
            )

    def _check_video(self, x: torch.Tensor) -> None:
        cfg = self.config
        if x.dim() != 5 or x.shape[1] != RGB_CHANNELS:
            raise ValueError(f"video of shape {tuple(x.shape)}: expected [B, 3, F, H, W]")
        frames, height, width = x.shape[2:]
        ft, s = cfg.scale_factor_temporal, cfg.scale_factor_spatial
        if frames < 1 or (frames - 1) % ft:
            raise ValueError(
                f"video has {frames} frames: encode needs 1 + {ft}k frames (e.g. "
                f"{1 + ft * max(0, (frames - 1) // ft)}); trim or pad the clip"
            )
        if height % s or width % s:
            raise ValueError(
                f"video is {height}x{width}: encode needs height and width that are multiples of {s}"
            )


class WanDecodeRun:
    """`WanVAE`'s side of ``vae_plan.DecodeRun``: the reference modules, activations
    ``[B, C, T, H, W]`` in the VAE's dtype, one `CausalCache` scope per unit."""

    def __init__(self, vae: WanVAE, z: torch.Tensor) -> None:
        self._vae = vae
        self._z = z
        self._x: torch.Tensor | None = None  # post_quant_conv(z), made on the first latent_input
        self._cache: CausalCache | None = None
        self.plan: DecoderPlan = decoder_plan(vae.config, height=z.shape[3], width=z.shape[4])
        self.latent_frames = z.shape[2]
        self.state_dtype: torch.dtype = next(vae.parameters()).dtype

    def __enter__(self) -> WanDecodeRun:
        if self._vae._cache is not None:
            raise RuntimeError("WanVAE is already encoding or decoding; calls must not overlap")
        self._cache = self._vae._cache = CausalCache()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Drop the histories now: a failed decode's traceback may keep this run alive.
        if self._cache is not None:
            self._cache.clear()
        self._cache = self._vae._cache = None
        self._x = None

    def latent_input(self, t: int) -> State:
        if self._x is None:  # pointwise, so once for all frames
            self._x = self._vae.post_quant_conv(self._z.to(self.state_dtype))
        return {"x": self._x[:, :, t : t + 1]}

    def run_unit(self, unit: DecodeUnit, state: State, *, first: bool) -> State:
        if self._cache is None:
            raise RuntimeError("enter the decode run (with vae.start_decode(z) as run: ...) before running units")
        return self._vae.decoder.run_unit(unit, state, self._cache.scope(unit), first=first)

    def settle(self, state: State) -> State:
        return state

    def new_output(self, out_dtype: torch.dtype) -> torch.Tensor:
        return new_video(self.plan, self._z.shape, out_dtype, self._z.device)

    def write(self, state: State, out: torch.Tensor, start: int) -> int:
        video = unpatchify(state["x"], patch=self._vae.config.patch_size).clamp_(-1.0, 1.0)  # [B, 3, f, H, W]
        frames = video.shape[2]
        if out.dtype == torch.uint8:
            out[start : start + frames] = to_uint8_frames(video[0])
        else:
            out[:, :, start : start + frames] = video
        return frames
