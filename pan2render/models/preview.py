"""Live previews of a sampling: the clean latents the model predicts (x0) at a step boundary, a few
latent frames of them, and the linear latent -> RGB map that makes a small picture of those.

`PAN2Pipeline.sample` hands a `PreviewLatents` to its ``on_preview`` hook once ``preview_every_s``
seconds of sampling have passed since the last one (`PreviewHook`): only the latent frames a
preview shows (`preview_frames`), copied to the CPU. That copy is all a preview costs the sampling
(docs/performance.md, "Previews"); the map (`RgbMap.apply`: a [C, 3] matrix and a bias), the
resize and the encode run wherever the hook hands them (the runner: its worker's I/O lane).

The map of a model (`rgb_map_for`): the one ``pan2-render calibrate`` fitted and kept beside its
model id (`fit_rgb_map`: least squares against the VAE's own decode of the x0s of a sampling,
``<cache>/preview/<model id>.json``); else, for a VAE with the Wan2.2 VAE's 48 latent channels, the
published Wan2.2 factors (`WAN22_RGB_MAP`); else none, and the sampling makes no previews.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..sampling import WAN22
from .calibration import model_file

__all__ = ["PREVIEW_FRAMES", "WAN22_RGB_MAP", "FitSamples", "PreviewHook", "PreviewLatents", "RgbMap",
           "calibrate_rgb_map", "fit_rgb_map", "frame_targets", "grey_map", "preview_frames", "preview_psnr",
           "rgb_map_for", "rgb_map_path", "store_rgb_map", "stored_rgb_map"]

# Latent frames a preview shows, spread from the first to the last: 4 of a 121-frame video's 31 (its
# start, two middles, its end) cost the sampling one copy of 4 x 48 x 44 x 78 float32 (2.6 MB).
PREVIEW_FRAMES = 4
RGB_MAP_FORMAT = 1


@dataclass(frozen=True)
class PreviewLatents:
    """The clean latents predicted at a step boundary, for the latent frames a preview shows."""

    step: int  # steps done (the prediction of step ``step`` of ``total_steps``)
    total_steps: int
    frames: tuple[int, ...]  # the latent frames held, in order
    x0: torch.Tensor  # float32 CPU [C, len(frames), h, w], normalised latent space
    at: float  # when it was taken (time.time())


def preview_frames(latent_frames: int, count: int = PREVIEW_FRAMES) -> tuple[int, ...]:
    """``count`` latent frames spread evenly from the first to the last (all of them when there are
    no more than ``count``)."""
    if latent_frames < 1 or count < 1:
        raise ValueError(f"latent_frames={latent_frames}, count={count}: both must be >= 1")
    if latent_frames <= count:
        return tuple(range(latent_frames))
    if count == 1:
        return (latent_frames // 2,)
    return tuple(sorted({round(i * (latent_frames - 1) / (count - 1)) for i in range(count)}))


class PreviewHook:
    """What `PAN2Pipeline.sample` does for previews at a step boundary: once ``every_s`` seconds of
    sampling have passed since the last preview (0: never), the x0 of ``frames`` latent frames,
    copied to the CPU, handed to ``on_preview``. ``active`` is False when none can be due."""

    def __init__(self, *, every_s: float = 0.0, on_preview: Callable[[PreviewLatents], None] | None = None,
                 frames: int = PREVIEW_FRAMES, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or not math.isfinite(every_s) \
                or every_s < 0:
            raise ValueError(f"preview_every_s={every_s!r}: must be a number of seconds >= 0 (0 turns previews off)")
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
            raise ValueError(f"preview_frames={frames!r}: must be an integer >= 1")
        self.every_s = float(every_s) if on_preview is not None else 0.0
        self.on_preview = on_preview
        self.frames = frames
        self.active = self.every_s > 0
        self._clock = clock  # seconds, monotonic
        self._last = clock()

    def start(self) -> None:
        """The sampling's first step starts now: the first preview is due ``every_s`` after it."""
        self._last = self._clock()

    def at_boundary(self, *, step: int, total_steps: int, latent_frames: int,
                    estimate: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
        """Called after step ``step``; ``estimate(frames)`` gives x0 ``[C, len(frames), h, w]`` on the
        sampling's device, for those latent frames only."""
        if not self.active or self._clock() - self._last < self.every_s:
            return
        frames = preview_frames(latent_frames, self.frames)
        x0 = estimate(frames).detach().to("cpu", torch.float32, copy=True)  # the one device -> host copy
        assert self.on_preview is not None  # (active)
        self.on_preview(PreviewLatents(step=step, total_steps=total_steps, frames=frames, x0=x0, at=time.time()))
        self._last = self._clock()  # the hook's own time is not sampling time


# ---------------------------------------------------------------------------------- the map
@dataclass(frozen=True)
class RgbMap:
    """Normalised latents -> RGB in [-1, 1], per latent pixel: ``rgb = z @ weight + bias``."""

    weight: tuple[tuple[float, float, float], ...]  # [C][R, G, B]
    bias: tuple[float, float, float]
    source: str  # where its numbers come from

    def __post_init__(self) -> None:
        values = [v for row in self.weight for v in row] + list(self.bias)
        if not self.weight or any(len(row) != 3 for row in self.weight) or len(self.bias) != 3 \
                or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            raise ValueError(f"a latent -> RGB map is [channels][3] finite weights and 3 biases ({self.source})")

    @property
    def channels(self) -> int:
        return len(self.weight)

    def apply(self, x0: np.ndarray) -> np.ndarray:
        """float ``[C, k, h, w]`` -> uint8 RGB ``[k, h, w, 3]``."""
        if x0.ndim != 4 or x0.shape[0] != self.channels:
            raise ValueError(f"latents of shape {list(x0.shape)} for a map of {self.channels} channels")
        rgb = np.einsum("ckhw,cr->khwr", x0.astype(np.float32), np.asarray(self.weight, dtype=np.float32))
        rgb += np.asarray(self.bias, dtype=np.float32)
        return np.clip((rgb + 1.0) * 127.5, 0.0, 255.0).round().astype(np.uint8)

    def to_json(self) -> dict[str, Any]:
        return {"weight": [list(row) for row in self.weight], "bias": list(self.bias), "source": self.source}

    @classmethod
    def from_json(cls, doc: dict[str, Any], *, source: str) -> RgbMap:
        try:
            return cls(weight=tuple(tuple(float(v) for v in row) for row in doc["weight"]),
                       bias=tuple(float(v) for v in doc["bias"]), source=str(doc.get("source", source)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: not a latent -> RGB map ({e}); run `pan2-render calibrate` again") from e


def _rows(values: Sequence[float]) -> tuple[tuple[float, float, float], ...]:
    return tuple((values[i], values[i + 1], values[i + 2]) for i in range(0, len(values), 3))


# The Wan2.2 VAE's (z_dim 48) latent -> RGB factors as ComfyUI publishes them for its live previews:
# comfy/latent_formats.py, class Wan22, latent_rgb_factors and latent_rgb_factors_bias (Comfy-Org/ComfyUI,
# commit 75399d78). ComfyUI applies them to the sampler's x0 in its model space, the latents normalised
# by the VAE's latents_mean / latents_std as ours are, and reads the result in [-1, 1].
WAN22_RGB_MAP = RgbMap(weight=_rows((
    0.0119, 0.0103, 0.0046, -0.1062, -0.0504, 0.0165, 0.0140, 0.0409, 0.0491, -0.0813, -0.0677, 0.0607,
    0.0656, 0.0851, 0.0808, 0.0264, 0.0463, 0.0912, 0.0295, 0.0326, 0.0590, -0.0244, -0.0270, 0.0025,
    0.0443, -0.0102, 0.0288, -0.0465, -0.0090, -0.0205, 0.0359, 0.0236, 0.0082, -0.0776, 0.0854, 0.1048,
    0.0564, 0.0264, 0.0561, 0.0006, 0.0594, 0.0418, -0.0319, -0.0542, -0.0637, -0.0268, 0.0024, 0.0260,
    0.0539, 0.0265, 0.0358, -0.0359, -0.0312, -0.0287, -0.0285, -0.1032, -0.1237, 0.1041, 0.0537, 0.0622,
    -0.0086, -0.0374, -0.0051, 0.0390, 0.0670, 0.2863, 0.0069, 0.0144, 0.0082, 0.0006, -0.0167, 0.0079,
    0.0313, -0.0574, -0.0232, -0.1454, -0.0902, -0.0481, 0.0714, 0.0827, 0.0447, -0.0304, -0.0574, -0.0196,
    0.0401, 0.0384, 0.0204, -0.0758, -0.0297, -0.0014, 0.0568, 0.1307, 0.1372, -0.0055, -0.0310, -0.0380,
    0.0239, -0.0305, 0.0325, -0.0663, -0.0673, -0.0140, -0.0416, -0.0047, -0.0023, 0.0166, 0.0112, -0.0093,
    -0.0211, 0.0011, 0.0331, 0.1833, 0.1466, 0.2250, -0.0368, 0.0370, 0.0295, -0.3441, -0.3543, -0.2008,
    -0.0479, -0.0489, -0.0420, -0.0660, -0.0153, 0.0800, -0.0101, 0.0068, 0.0156, -0.0690, -0.0452, -0.0927,
    -0.0145, 0.0041, 0.0015, 0.0421, 0.0451, 0.0373, 0.0504, -0.0483, -0.0356, -0.0837, 0.0168, 0.0055)),
    bias=(0.0317, -0.0878, -0.1388),
    source="published: ComfyUI's Wan22 latent_rgb_factors (comfy/latent_formats.py)")
assert WAN22_RGB_MAP.channels == 48


def rgb_map_path(model_id: str) -> Path:
    """Where ``model_id``'s fitted map lives (beside its MagCache calibration's folder)."""
    return model_file("preview", model_id)


def stored_rgb_map(model_id: str) -> RgbMap | None:
    path = rgb_map_path(model_id)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable latent -> RGB map ({e}); run `pan2-render calibrate` again") from e
    return RgbMap.from_json(doc, source=str(path))


def store_rgb_map(model_id: str, rgb_map: RgbMap, *, quality: dict[str, float] | None = None) -> Path:
    """Write (atomically) ``rgb_map`` as ``model_id``'s, with how well it fitted."""
    path = rgb_map_path(model_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": RGB_MAP_FORMAT, "model_id": model_id, **rgb_map.to_json(), "quality": quality or {}}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


def rgb_map_for(model_id: str, latent_channels: int) -> RgbMap | None:
    """The map a model's previews use (see the module doc); None: none applies."""
    stored = stored_rgb_map(model_id)
    if stored is not None:
        return stored
    return WAN22_RGB_MAP if latent_channels == WAN22_RGB_MAP.channels else None


# ---------------------------------------------------------------------------------- the fit
def frame_targets(frames: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
    """What a latent pixel decodes to: uint8 frames ``[F, H, W, 3]`` -> float64 RGB in [-1, 1]
    ``[T, h, w, 3]`` (``grid`` = (T, h, w)), each latent frame's frames (the first alone, then
    ``vae_temporal`` each: the causal VAE's 1 + 4(T - 1)) and each latent pixel's block averaged."""
    t_count, h, w = grid
    f, height, width, _ = frames.shape
    step = WAN22.vae_temporal
    if f != 1 + step * (t_count - 1) or height % h or width % w:
        raise ValueError(f"frames {list(frames.shape)} are not the decode of a [{t_count}, {h}, {w}] latent grid")
    sy, sx = height // h, width // w
    rgb = frames.astype(np.float64) / 127.5 - 1.0
    out = np.empty((t_count, h, w, 3))
    for t in range(t_count):
        span = rgb[0:1] if t == 0 else rgb[step * (t - 1) + 1:step * t + 1]
        out[t] = span.mean(axis=0).reshape(h, sy, w, sx, 3).mean(axis=(1, 3))
    return out


def fit_rgb_map(pairs: Iterable[tuple[torch.Tensor, np.ndarray]], *, source: str) -> RgbMap:
    """The least-squares map from normalised latents ``[C, T, h, w]`` to what their decode
    ``[F, H, W, 3]`` (uint8) holds at each latent pixel (`frame_targets`), over every pair."""
    xs, ys = [], []
    for latents, frames in pairs:
        c, t, h, w = latents.shape
        xs.append(latents.double().permute(1, 2, 3, 0).reshape(-1, c).numpy())
        ys.append(frame_targets(frames, (t, h, w)).reshape(-1, 3))
    x, y = np.concatenate(xs), np.concatenate(ys)
    a = np.concatenate([x, np.ones((len(x), 1))], axis=1)  # [N, C + 1]: the bias as a last channel
    beta, *_ = np.linalg.lstsq(a, y, rcond=None)  # [C + 1, 3]
    return RgbMap(weight=tuple(tuple(float(v) for v in row) for row in beta[:-1]),
                  bias=tuple(float(v) for v in beta[-1]), source=source)


def preview_psnr(rgb_map: RgbMap, latents: torch.Tensor, frames: np.ndarray) -> float:
    """PSNR (dB, over [0, 255]) of ``rgb_map``'s picture of ``latents`` ``[C, T, h, w]`` against their
    decode ``frames``, at the latent grid (what a preview can show)."""
    shown = rgb_map.apply(latents.float().numpy()).astype(np.float64)  # [T, h, w, 3]
    want = (frame_targets(frames, tuple(latents.shape[1:])) + 1.0) * 127.5
    mse = float(np.mean((shown - want) ** 2))
    return float("inf") if mse == 0 else 10.0 * math.log10(255.0 ** 2 / mse)


def grey_map(channels: int) -> RgbMap:
    """A map to mid-grey whatever the latents: the baseline a fitted map must beat."""
    return RgbMap(weight=((0.0, 0.0, 0.0),) * channels, bias=(0.0, 0.0, 0.0), source="a fixed grey picture")


class FitSamples:
    """An ``on_preview`` hook that keeps the x0 of ``keep`` boundaries spread over a sampling of
    ``steps`` steps, whole (give `PAN2Pipeline.sample` ``preview_every_s`` tiny and
    ``preview_frames`` at least the latent frames): what ``pan2-render calibrate`` fits a map on,
    from blurry early predictions to nearly clean ones, as previews show them."""

    def __init__(self, *, steps: int, keep: int = 4) -> None:
        # The boundaries are after steps 1 .. steps - 1.
        self.wanted = {1 + b for b in preview_frames(steps - 1, keep)} if steps > 1 else set()
        self.x0s: list[torch.Tensor] = []

    def __call__(self, latents: PreviewLatents) -> None:
        if latents.step in self.wanted:
            self.x0s.append(latents.x0)


def calibrate_rgb_map(pipe: Any, x0s: Sequence[torch.Tensor]) -> tuple[RgbMap, dict[str, float]]:
    """Fit ``pipe``'s map on these x0s (``[C, T, h, w]``, decoded here by its own VAE); with the
    in-sample PSNR of the fit and of a grey picture."""
    pairs = [(x0, pipe.decode(x0).numpy()) for x0 in x0s]
    if not pairs:
        raise ValueError("no x0 to fit a latent -> RGB map on: the sampling needs at least 2 steps")
    fitted = fit_rgb_map(pairs, source=f"fitted on {pipe.model_id} ({len(pairs)} decodes, "
                                      f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())})")
    quality = {"psnr_db": float(np.mean([preview_psnr(fitted, z, f) for z, f in pairs])),
               "grey_psnr_db": float(np.mean([preview_psnr(grey_map(z.shape[0]), z, f) for z, f in pairs]))}
    return fitted, quality
