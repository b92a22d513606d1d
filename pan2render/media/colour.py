"""Colour matching of a chained video's segments to its first segment.

A segment conditioned on the previous one's last frame drifts in colour: each clip of an image-to-
video model shifts saturation, brightness or cast a little, and chained, the shifts add up. Each
segment k >= 2 is therefore moved onto segment 1's colour with the per-channel mean / standard
deviation transfer of Reinhard et al. ("Color Transfer between Images", 2001), in CIE Lab:

    out_c = (x_c - mean_k,c) * clamp(std_1,c / std_k,c, 1/2, 2) + mean_1,c      for c in L, a, b

with the statistics taken over every pixel of every frame of the segment. Why this method:

- The drift chaining builds up is global (a cast, a lift, a loss of contrast), and an affine map
  per channel is exactly a global correction: it keeps every edge, gradient and colour relation
  inside the segment, so it never bands, posterises or amplifies noise. Histogram matching forces
  the whole distribution to segment 1's, so a story whose later segment really shows other content
  (a red car enters, night falls) would be bent to the first segment's histogram; mean and spread
  follow content far less.
- Lab separates lightness from chroma roughly as the eye does, so a lightness correction does not
  tint and a cast correction does not darken, as it would channel by channel in RGB.
- Six numbers describe a segment: they go into params.json, and the same transform can be applied
  again to the same decoded frames, bit for bit (a resumed job's video equals an uninterrupted
  run's).
- Statistics over the whole segment, not per frame, keep the segment's own changes over time (a
  fade, a light switched on) instead of flattening each frame to the same mean.

The gain is clamped to [1/2, 2]: a segment that is nearly flat in a channel (fading to black) would
otherwise have its little spread blown up into noise.

The conditioning frame of segment k + 1 is segment k's last frame *after* matching: the model then
continues from a frame already on segment 1's colour, so the drift of one segment does not compound
into the next one's input, and the join in the video (that matched frame, followed by segment k +
1's second frame) shows no jump between a matched and an unmatched frame.

Frames are uint8 sRGB ``[F, H, W, 3]`` on any device; the work is done in chunks of frames so a
720p segment of 121 frames never holds more than a chunk in float32.
"""

from __future__ import annotations

import torch

from pan2render.long_video import ColourStats

GAIN_LIMIT = 2.0
_CHUNK = 16  # frames converted at once: 16 x 704 x 1248 x 3 float32 = 170 MB
# sRGB (D65) linear RGB -> CIE XYZ (IEC 61966-2-1), and the D65 white point.
_RGB_TO_XYZ = ((0.4124564, 0.3575761, 0.1804375),
               (0.2126729, 0.7151522, 0.0721750),
               (0.0193339, 0.1191920, 0.9503041))
_WHITE = (0.95047, 1.0, 1.08883)
_DELTA = 6.0 / 29.0


def srgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """uint8 sRGB ``[..., 3]`` -> float32 CIE Lab ``[..., 3]`` (L in 0..100)."""
    c = rgb.float() / 255.0
    linear = torch.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    m = torch.tensor(_RGB_TO_XYZ, dtype=torch.float32, device=rgb.device)
    xyz = (linear @ m.T) / torch.tensor(_WHITE, dtype=torch.float32, device=rgb.device)
    f = torch.where(xyz > _DELTA ** 3, xyz.clamp_min(1e-12) ** (1 / 3), xyz / (3 * _DELTA ** 2) + 4 / 29)
    fx, fy, fz = f.unbind(-1)
    return torch.stack((116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)), dim=-1)


def lab_to_srgb(lab: torch.Tensor) -> torch.Tensor:
    """float32 CIE Lab ``[..., 3]`` -> uint8 sRGB ``[..., 3]``, colours outside sRGB clipped."""
    lum, a, b = lab.unbind(-1)
    fy = (lum + 16) / 116
    f = torch.stack((fy + a / 500, fy, fy - b / 200), dim=-1)
    xyz = torch.where(f > _DELTA, f ** 3, 3 * _DELTA ** 2 * (f - 4 / 29))
    xyz = xyz * torch.tensor(_WHITE, dtype=torch.float32, device=lab.device)
    m_inv = torch.linalg.inv(torch.tensor(_RGB_TO_XYZ, dtype=torch.float64)).to(lab.device, torch.float32)
    linear = (xyz @ m_inv.T).clamp(0, 1)
    c = torch.where(linear <= 0.0031308, 12.92 * linear, 1.055 * linear.clamp_min(1e-12) ** (1 / 2.4) - 0.055)
    return (c * 255).round().clamp(0, 255).to(torch.uint8)


def colour_stats(frames: torch.Tensor) -> ColourStats:
    """The mean and standard deviation of each Lab channel over every pixel of ``frames`` (uint8
    ``[F, H, W, 3]``), summed in float64 so that long segments lose no precision."""
    _check(frames)
    total = torch.zeros(3, dtype=torch.float64, device=frames.device)
    squares = torch.zeros(3, dtype=torch.float64, device=frames.device)
    for chunk in frames.split(_CHUNK):
        lab = srgb_to_lab(chunk).reshape(-1, 3).double()
        total += lab.sum(0)
        squares += (lab * lab).sum(0)
    n = frames[..., 0].numel()
    mean = total / n
    std = (squares / n - mean * mean).clamp_min(0).sqrt()
    return ColourStats(mean=tuple(mean.tolist()), std=tuple(std.tolist()))  # type: ignore[arg-type]


def match_colour(frames: torch.Tensor, stats: ColourStats, reference: ColourStats) -> torch.Tensor:
    """``frames`` (uint8 ``[F, H, W, 3]``, whose statistics are ``stats``) moved onto ``reference``'s
    mean and spread per Lab channel, the gain clamped to [1/GAIN_LIMIT, GAIN_LIMIT]; a new tensor."""
    _check(frames)
    mean = torch.tensor(stats.mean, dtype=torch.float64)
    ref_mean = torch.tensor(reference.mean, dtype=torch.float64)
    spread = torch.tensor(stats.std, dtype=torch.float64).clamp_min(1e-6)
    gain = (torch.tensor(reference.std, dtype=torch.float64) / spread).clamp(1 / GAIN_LIMIT, GAIN_LIMIT)
    # out = x * gain + (ref_mean - mean * gain): one multiply-add per value on the device
    scale = gain.to(frames.device, torch.float32)
    shift = (ref_mean - mean * gain).to(frames.device, torch.float32)
    out = torch.empty_like(frames)
    for chunk, dest in zip(frames.split(_CHUNK), out.split(_CHUNK)):
        dest.copy_(lab_to_srgb(srgb_to_lab(chunk) * scale + shift))
    return out


def _check(frames: torch.Tensor) -> None:
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3 or not frames.shape[0]:
        raise ValueError(f"colour matching needs uint8 frames [F, H, W, 3], got {frames.dtype} {list(frames.shape)}")
