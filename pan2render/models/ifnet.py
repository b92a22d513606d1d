"""RIFE's IFNet: the frame in between two frames, for frame interpolation after decode.

The architecture is Practical-RIFE's v4.25 / v4.26 family, by default its v4.26.heavy variant: the
one RIFE model ccvfi ships (``RIFE_IFNet_v426_heavy``), so the parity tests compare this network
with a reference of exactly the same architecture, and the newest family Practical-RIFE publishes.
v4.25, v4.26 and v4.25.heavy files load too: the same forward at other widths, told apart by their
shapes (`pan2render.ifnet_files.VARIANTS`). Earlier 4.x versions each had another block layout and
are refused by the loader, naming what their file lacks.

How it computes (``t`` the timestep, both flows in pixels of the frame):

1. A small encoder turns each frame into features (16 channels in v4.26.heavy, 4 in the others).
2. Five flow blocks, coarse to fine (at 1/16, 1/8, 1/4, 1/2, 1/1 of the frame for ``scale`` 1),
   each refine two flows (from the middle frame back to frame 0 and to frame 1) and a mask; the
   first sees both frames, their features and t, the others the frames and features warped by the
   flows so far, the mask and 8 channels carried from the block before.
3. The middle frame is both frames warped by their flow and blended by the mask's sigmoid.

v4 takes the timestep as an input (a constant channel), so any t in (0, 1) is one pass; 4x
interpolation runs t = 1/4, 1/2, 3/4 from the two original frames instead of bisecting (1/2, then
the halves from that synthesized frame): no frame is made from a made frame, so errors do not
compound, and all in-betweens of a video are independent, batched together (`interpolate`).

Frames: float ``[N, 3, H, W]`` RGB in [0, 1]. The network needs H and W to be multiples of
``64 / scale`` (the coarsest block works at 1/16 of ``scale`` and halves twice more): others are
padded with zeros at the right and bottom, as Practical-RIFE pads, and the result cropped back.
``scale`` is RIFE's: below 1 the flows are computed on a coarser grid (0.5 is Practical-RIFE's
advice for 4K), above 1 on a finer one.

Precision: the convolutions run in the weights' dtype; the frames, flows, mask, warps and blend stay
in float32 whatever it is, because a flow of hundreds of pixels kept in bfloat16 (8 mantissa bits)
would be off by pixels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ifnet_files import (
    BLOCK_OUTPUTS,
    ENCODER_WIDTH,
    RESIDUAL_CONVS,
    SAFETENSORS,
    IFNetConfig,
    IFNetWeightsError,
    block_inputs,
    check_ifnet_weights,
    load_torch_state,
    plan_ifnet,
    safetensors_entries,
    torch_entries,
    weights_format,
)

log = logging.getLogger(__name__)

__all__ = ["FACTORS", "SCALES", "IFNet", "IFNetConfig", "IFNetWeightsError", "check_ifnet_weights", "interpolate",
           "interpolate_uint8", "load_ifnet"]

SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)  # RIFE's flow scales (Practical-RIFE accepts these)
FACTORS = (2, 4)  # frame-rate multipliers `interpolate` makes
_BLOCK_DOWNSCALE = (16, 8, 4, 2, 1)  # each flow block's working resolution, 1/n of the frame at scale 1


def _conv(inp: int, out: int, *, stride: int = 1) -> nn.Sequential:
    """3x3 convolution then leaky ReLU (RIFE's ``conv``; keys ``.0.weight``/``.0.bias``)."""
    return nn.Sequential(nn.Conv2d(inp, out, 3, stride, 1), nn.LeakyReLU(0.2, inplace=True))


class FrameEncoder(nn.Module):
    """Per-frame features at full resolution (RIFE's ``Head``): 3x3 stride 2, two 3x3, then a 4x4
    stride-2 transposed convolution back up. Needs even H and W."""

    def __init__(self, out_channels: int) -> None:
        super().__init__()
        self.cnn0 = nn.Conv2d(3, ENCODER_WIDTH, 3, 2, 1)
        self.cnn1 = nn.Conv2d(ENCODER_WIDTH, ENCODER_WIDTH, 3, 1, 1)
        self.cnn2 = nn.Conv2d(ENCODER_WIDTH, ENCODER_WIDTH, 3, 1, 1)
        self.cnn3 = nn.ConvTranspose2d(ENCODER_WIDTH, out_channels, 4, 2, 1)
        self.relu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, frames: Tensor) -> Tensor:
        x = self.relu(self.cnn0(frames))  # [N, 16, H/2, W/2]
        x = self.relu(self.cnn1(x))
        x = self.relu(self.cnn2(x))
        return self.cnn3(x)  # [N, E, H, W]


class ResidualConv(nn.Module):
    """``leaky_relu(conv(x) * beta + x)``: a 3x3 convolution with a learned per-channel gain."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 1, 1)
        self.beta = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.relu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.conv(x) * self.beta + x)


class FlowBlock(nn.Module):
    """One level of the coarse-to-fine estimate (RIFE's ``IFBlock``): works at 1/``scale`` of its
    input, 4x further down inside, and returns at the input's size (float32): the flow (or its
    update) [N, 4, H, W] in the input's pixels, the mask logit [N, 1, H, W] and 8 feature channels."""

    def __init__(self, in_channels: int, width: int) -> None:
        super().__init__()
        self.conv0 = nn.Sequential(_conv(in_channels, width // 2, stride=2), _conv(width // 2, width, stride=2))
        self.convblock = nn.Sequential(*(ResidualConv(width) for _ in range(RESIDUAL_CONVS)))
        # 52 channels at 1/2 of the working size, shuffled into 13 at the working size.
        self.lastconv = nn.Sequential(nn.ConvTranspose2d(width, 4 * BLOCK_OUTPUTS, 4, 2, 1), nn.PixelShuffle(2))

    def forward(self, x: Tensor, flow: Tensor | None, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        # A resize by exactly 1 is the identity (bilinear, align_corners=False): skipped, it would
        # only copy the finest block's full-size input.
        if scale != 1:
            x = F.interpolate(x, scale_factor=1.0 / scale, mode="bilinear", align_corners=False)
        if flow is not None:
            if scale != 1:
                flow = F.interpolate(flow, scale_factor=1.0 / scale, mode="bilinear", align_corners=False) / scale
            x = torch.cat((x, flow), 1)
        dtype = self.lastconv[0].weight.dtype
        out = self.lastconv(self.convblock(self.conv0(x.to(dtype)))).float()  # [N, 13, h, w]
        if scale != 1:
            out = F.interpolate(out, scale_factor=scale, mode="bilinear", align_corners=False)
        return out[:, :4] * scale, out[:, 4:5], out[:, 5:]


class _Grid:
    """What warping at one frame size needs, made once per pass: each pixel's own position in
    grid_sample's coordinates (-1 .. 1 corner to corner) [1, H, W, 2], and a pixel's size in them."""

    def __init__(self, height: int, width: int, device: torch.device) -> None:
        ys = torch.linspace(-1.0, 1.0, height, device=device)
        xs = torch.linspace(-1.0, 1.0, width, device=device)
        self.base = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), dim=-1).unsqueeze(0)
        self.per_pixel = torch.tensor([2.0 / (width - 1), 2.0 / (height - 1)], device=device)

    def warp(self, image: Tensor, flow: Tensor) -> Tensor:
        """``image`` [N, C, H, W] sampled at each pixel + ``flow`` [N, 2, H, W] (x, y in pixels):
        bilinear, edges extended. All float32."""
        where = self.base + flow.permute(0, 2, 3, 1) * self.per_pixel  # [N, H, W, 2]
        return F.grid_sample(image, where, mode="bilinear", padding_mode="border", align_corners=True)


class IFNet(nn.Module):
    """RIFE v4.25 / v4.26 IFNet. Module names are the published checkpoints' keys (``encode.*``,
    ``block0.*`` .. ``block4.*``), so a state dict loads as published (`load_ifnet`)."""

    def __init__(self, config: IFNetConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or IFNetConfig()
        for i, width in enumerate(config.block_channels):
            self.add_module(f"block{i}", FlowBlock(block_inputs(config, i), width))
        self.encode = FrameEncoder(config.encoder_channels)

    @property
    def blocks(self) -> tuple[FlowBlock, ...]:
        return tuple(getattr(self, f"block{i}") for i in range(len(self.config.block_channels)))

    @staticmethod
    def alignment(scale: float = 1.0) -> int:
        """What H and W must be multiples of at ``scale``."""
        _check_scale(scale)
        return round(4 * _BLOCK_DOWNSCALE[0] / scale)

    def features(self, frames: Tensor) -> Tensor:
        """The encoder's features of aligned frames [N, 3, H, W] (float32) -> [N, E, H, W] float32."""
        return self.encode(frames.to(self.encode.cnn0.weight.dtype)).float()

    def synthesize(self, img0: Tensor, img1: Tensor, feat0: Tensor, feat1: Tensor, timestep: Tensor, *,
                   scale: float = 1.0) -> Tensor:
        """The frame at ``timestep`` [N] (each in (0, 1)) between aligned float32 frames [N, 3, H, W]
        whose `features` are given (computed once per frame when a frame serves several pairs)."""
        n, _, height, width = img0.shape
        t = timestep.to(device=img0.device, dtype=torch.float32).reshape(n, 1, 1, 1).expand(n, 1, height, width)
        grid = _Grid(height, width, img0.device)
        flow = mask = carried = None
        warped0, warped1 = img0, img1
        for block, down in zip(self.blocks, _BLOCK_DOWNSCALE):
            block_scale = down / scale
            if flow is None:
                flow, mask, carried = block(torch.cat((img0, img1, feat0, feat1, t), 1), None, block_scale)
            else:
                wf0, wf1 = grid.warp(feat0, flow[:, :2]), grid.warp(feat1, flow[:, 2:4])
                x = torch.cat((warped0, warped1, wf0, wf1, t, mask, carried), 1)
                update, mask, carried = block(x, flow, block_scale)
                flow = flow + update
            warped0, warped1 = grid.warp(img0, flow[:, :2]), grid.warp(img1, flow[:, 2:4])
        weight0 = torch.sigmoid(mask)
        return warped0 * weight0 + warped1 * (1 - weight0)

    def forward(self, img0: Tensor, img1: Tensor, timestep: float | Tensor = 0.5, *, scale: float = 1.0) -> Tensor:
        """The frame at ``timestep`` (a float, or one per pair [N]) between ``img0`` and ``img1``:
        float [N, 3, H, W] in [0, 1], any H and W (padded to `alignment`, cropped back); the result
        in the frames' dtype."""
        _check_frames(img0, "img0")
        if img1.shape != img0.shape:
            raise ValueError(f"img1 must have img0's shape {list(img0.shape)}, got {list(img1.shape)}")
        n, _, height, width = img0.shape
        if not torch.is_tensor(timestep):
            if not 0 < timestep < 1:
                raise ValueError(f"timestep must be in (0, 1), got {timestep}")
            timestep = torch.full((n,), float(timestep))
        elif timestep.shape != (n,):
            raise ValueError(f"a timestep tensor must be one per pair, shape [{n}], got {list(timestep.shape)}")
        align = self.alignment(scale)
        both = _pad(torch.cat((img0, img1)).float(), align)
        feats = self.features(both)
        out = self.synthesize(both[:n], both[n:], feats[:n], feats[n:], timestep, scale=scale)
        return out[:, :, :height, :width].to(img0.dtype)


def _check_scale(scale: float) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES} (RIFE's flow scales; 0.5 for 4K), got {scale}")


def _check_frames(frames: Tensor, what: str) -> None:
    if frames.dim() != 4 or frames.shape[1] != 3 or not frames.is_floating_point():
        raise ValueError(f"{what} must be float RGB [N, 3, H, W] in [0, 1], got {frames.dtype} {list(frames.shape)}")


def _pad(frames: Tensor, align: int) -> Tensor:
    """Zeros at the right and bottom up to the next multiple of ``align`` (Practical-RIFE's padding)."""
    height, width = frames.shape[-2:]
    return F.pad(frames, (0, -width % align, 0, -height % align))


# ------------------------------------------------------------------------------------------------
# Weights


def load_ifnet(path: Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> IFNet:
    """An IFNet with the weights of ``path`` (a .safetensors file or a plain torch state dict: see
    `pan2render.ifnet_files`), in eval mode without gradients, on ``device`` in ``dtype``. Anything
    that does not fit is an IFNetWeightsError naming the file and what is wrong."""
    path = Path(path)
    name = str(path)
    if weights_format(path, name=name) == SAFETENSORS:
        plan = plan_ifnet(safetensors_entries(path, name=name), name=name)  # checked before any data is read
        tensors = _read_safetensors(path, name)
    else:
        tensors = load_torch_state(path, name=name)
        plan = plan_ifnet(torch_entries(tensors), name=name)
    if plan.dropped:
        log.info("IFNet weights %s: %d training-only tensor(s) left unread (e.g. %s)", name, len(plan.dropped),
                 plan.dropped[0])
    with torch.device("meta"):  # no random init: every tensor comes from the file
        model = IFNet(plan.config)
    model.load_state_dict({ours: tensors[theirs] for ours, theirs in plan.keys.items()}, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _read_safetensors(path: Path, name: str) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:  # offsets past the end, a truncated file
        raise IFNetWeightsError(f"IFNet weights file {name!r} cannot be read as safetensors ({e})") from e


# ------------------------------------------------------------------------------------------------
# Interpolating a video


@torch.no_grad()
def interpolate(model: IFNet, frames: Tensor, factor: int, *, batch: int = 8, scale: float = 1.0) -> Tensor:
    """``frames`` float [T, 3, H, W] RGB in [0, 1] -> [(T - 1) * factor + 1, 3, H, W], same dtype
    and device (the model's): frame k of the input is frame k * factor of the output, bit for bit,
    and the ``factor - 1`` frames after it are IFNet's at t = j / factor between it and frame k + 1.

    ``batch``: in-between frames per network pass (memory grows with it). Each input frame is
    encoded once, however many pairs and timesteps it serves. uint8 [T, H, W, 3] frames, as the
    decoder gives them: `interpolate_uint8`."""
    _check_frames(frames, "frames")
    out = frames.new_empty(_output_shape(frames.shape[0], factor, tuple(frames.shape[1:])))
    out[::factor] = frames
    for where, mids in _in_betweens(model, frames.shape[0], lambda a, b: frames[a:b].float(), factor=factor,
                                    batch=batch, scale=scale, device=frames.device):
        out[where] = mids.to(out.dtype)
    return out


@torch.no_grad()
def interpolate_uint8(model: IFNet, frames: Tensor, factor: int, *, batch: int = 8, scale: float = 1.0) -> Tensor:
    """`interpolate` for uint8 RGB frames [T, H, W, 3] (the decoder's layout) -> uint8
    [(T - 1) * factor + 1, H, W, 3]: the originals copied, the in-betweens rounded to the nearest
    level. Frames go to float one window at a time, never the whole video."""
    if frames.dim() != 4 or frames.shape[-1] != 3 or frames.dtype != torch.uint8:
        raise ValueError(f"frames must be uint8 RGB [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    out = frames.new_empty(_output_shape(frames.shape[0], factor, tuple(frames.shape[1:])))
    out[::factor] = frames

    def read(a: int, b: int) -> Tensor:
        return frames[a:b].permute(0, 3, 1, 2).float() / 255.0

    for where, mids in _in_betweens(model, frames.shape[0], read, factor=factor, batch=batch, scale=scale,
                                    device=frames.device):
        out[where] = (mids * 255.0).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    return out


def _output_shape(count: int, factor: int, frame: tuple[int, ...]) -> tuple[int, ...]:
    if factor not in FACTORS:
        raise ValueError(f"factor must be one of {FACTORS}, got {factor}")
    if count < 1:
        raise ValueError("frames must hold at least one frame, got none")
    return ((count - 1) * factor + 1, *frame)


def _in_betweens(model: IFNet, count: int, read: Callable[[int, int], Tensor], *, factor: int, batch: int,
                 scale: float, device: torch.device) -> Iterator[tuple[Tensor, Tensor]]:
    """(output positions, float32 frames [n, 3, H, W]) for every in-between of ``count`` frames,
    ``read(a, b)`` giving float32 frames a..b-1 [b - a, 3, H, W] on ``device``.

    A window of consecutive pairs is read, padded and encoded at once (its first frame's padding and
    features kept from the window before), and its in-betweens run ``batch`` at a time."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    param = model.encode.cnn0.weight
    if param.device != device:
        raise ValueError(f"the frames are on {device}, the model on {param.device}: move one to the other")
    align = model.alignment(scale)
    steps = factor - 1
    pairs_per_window = max(1, batch // steps)
    kept: tuple[Tensor, Tensor] | None = None  # the last window's last frame, padded, and its features
    for first in range(0, count - 1, pairs_per_window):
        last = min(first + pairs_per_window, count - 1)  # pairs first..last-1 use frames first..last
        raw = read(first if kept is None else first + 1, last + 1)
        height, width = raw.shape[-2:]
        new = _pad(raw, align)
        feats = model.features(new)
        if kept is not None:
            new, feats = torch.cat((kept[0], new)), torch.cat((kept[1], feats))
        kept = (new[-1:], feats[-1:])
        pair = torch.arange(last - first, device=device).repeat_interleave(steps)  # pair of each in-between
        step = torch.arange(1, factor, device=device).repeat(last - first)  # its j: t = j / factor
        for s in range(0, pair.numel(), batch):
            p, j = pair[s:s + batch], step[s:s + batch]
            mids = model.synthesize(new[p], new[p + 1], feats[p], feats[p + 1], j.float() / factor, scale=scale)
            yield (first + p) * factor + j, mids[:, :, :height, :width]
