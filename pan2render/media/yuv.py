"""RGB -> yuv420p (BT.709, limited range) in torch, on whatever device the frames are on.

Converting on the GPU halves what crosses to the host (12 bits a pixel instead of 24) and takes the
colour conversion off the encoder's thread. The layout is I420, what PyAV's
``VideoFrame.from_ndarray(..., format="yuv420p")`` takes: per frame ``H * 3 // 2`` rows of ``W``
bytes: the Y plane (H x W), then U and then V ((H/2) x (W/2) each, packed row after row).

The matrix and range here are the ones ``media.video`` tags the stream with (``COLOUR_TAGS``), so a
player converts back with the same numbers; one place holds them.
"""

from __future__ import annotations

import torch

# BT.709 luma weights; Kg = 1 - Kr - Kb.
KR, KB = 0.2126, 0.0722
KG = 1.0 - KR - KB
# Limited ("TV", "MPEG") range: Y in 16..235, Cb/Cr in 16..240 around 128.
Y_OFFSET, Y_SCALE = 16.0, 219.0 / 255.0
C_OFFSET, C_SCALE = 128.0, 224.0 / 255.0

# Frames converted at once: bounds the float32 intermediates to ~chunk * H * W * 12 bytes
# (16 frames of 704x1248: ~170 MB) whatever the video's length.
_CHUNK_FRAMES = 16


def rgb_to_yuv420(frames: torch.Tensor) -> torch.Tensor:
    """uint8 RGB ``[F, H, W, 3]`` (even H, W) -> uint8 I420 ``[F, H * 3 // 2, W]`` on the same device.

    Chroma is the mean of each 2x2 block of full-resolution Cb/Cr (centre-sited, as swscale's
    default downsampling), then rounded."""
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    n, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise ValueError(f"yuv420p needs an even width and height, got {w}x{h}")
    out = torch.empty((n, h * 3 // 2, w), dtype=torch.uint8, device=frames.device)
    for start in range(0, n, _CHUNK_FRAMES):
        stop = min(start + _CHUNK_FRAMES, n)
        _convert_chunk(frames[start:stop], out[start:stop])
    return out


def _convert_chunk(rgb8: torch.Tensor, out: torch.Tensor) -> None:
    """rgb8 uint8 [f, H, W, 3] -> out uint8 [f, H*3/2, W] (written in place)."""
    f, h, w, _ = rgb8.shape
    rgb = rgb8.float()
    r, g, b = rgb.unbind(-1)  # [f, H, W] each, 0..255
    luma = KR * r + KG * g + KB * b  # [f, H, W], 0..255
    y = luma * Y_SCALE + Y_OFFSET
    cb = (b - luma) * (C_SCALE / (2.0 * (1.0 - KB)))  # [f, H, W], centred on 0
    cr = (r - luma) * (C_SCALE / (2.0 * (1.0 - KR)))
    # 2x2 means: [f, H, W] -> [f, H/2, 2, W/2, 2] -> [f, H/2, W/2]
    cb = cb.view(f, h // 2, 2, w // 2, 2).mean(dim=(2, 4)) + C_OFFSET
    cr = cr.view(f, h // 2, 2, w // 2, 2).mean(dim=(2, 4)) + C_OFFSET
    flat = out.view(f, -1)  # [f, H*W*3/2]
    q = h * w // 4  # one chroma plane's bytes
    flat[:, : h * w] = y.round_().clamp_(0, 255).to(torch.uint8).view(f, -1)
    flat[:, h * w : h * w + q] = cb.round_().clamp_(0, 255).to(torch.uint8).view(f, -1)
    flat[:, h * w + q :] = cr.round_().clamp_(0, 255).to(torch.uint8).view(f, -1)
