"""Live previews of a sampling: the clean latents the model predicts (x0) at a step boundary, a few
latent frames of them, and the linear latent -> RGB map that makes a small picture of those.

`PAN2Pipeline.sample` hands a `PreviewLatents` to its ``on_preview`` hook once ``preview_every_s``
seconds of sampling have passed since the last one (`PreviewHook`): only the latent frames a
preview shows (`preview_frames`), copied to the CPU. That copy is all a preview costs the sampling
(docs/performance.md, "Previews"); the map (`RgbMap.apply`: a [C, 3] matrix and a bias), the
resize and the encode run wherever the hook hands them (the runner: its worker's I/O lane).

The map of a model (`rgb_map_for`): the one ``pan2-render calibrate`` fitted and kept beside its
model id (`fit_rgb_map`: least squares against the VAE's own decode of the x0s of a sampling,
``<cache>/preview/<model id>.json``); else one fitted, the first time a preview is asked for, on the
model's VAE alone (`vae_rgb_map`: its decodes of Gaussian latents) and kept in the same file
until ``calibrate`` replaces it. Any VAE gets a map this way, from its own weights.
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

from ..kernels.vae_decode import to_uint8_frames
from ..sampling import WAN22
from .calibration import model_file

__all__ = ["PREVIEW_FRAMES", "FitSamples", "PreviewHook", "PreviewLatents", "RgbMap",
           "calibrate_rgb_map", "fit_rgb_map", "frame_targets", "grey_map", "preview_frames", "preview_psnr",
           "rgb_map_for", "rgb_map_path", "store_rgb_map", "stored_rgb_map",
           "vae_rgb_map"]

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


def rgb_map_for(pipe: Any) -> RgbMap:
    """The map ``pipe``'s previews use (see the module doc): its stored one, else one fitted now on
    its VAE's own encodes (`vae_rgb_map`) and stored, so that a model pays for that fit once."""
    stored = stored_rgb_map(pipe.model_id)
    if stored is not None:
        return stored
    fitted, quality = vae_rgb_map(pipe)
    try:
        store_rgb_map(pipe.model_id, fitted, quality=quality)
    except OSError:  # a read-only cache: the map still serves, fitted again next time
        pass
    return fitted


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


def vae_rgb_map(pipe: Any, *, count: int = 4, seed: int = 0) -> tuple[RgbMap, dict[str, float]]:
    """A map for any VAE from nothing but the VAE: least squares from unit-Gaussian latents (the
    normalised latent space's own marginal, 2 latent frames of 16 x 16) to the VAE's decode of them,
    with its in-sample PSNR and a grey picture's. Seeded, so one model always gets the same map.
    ``pan2-render calibrate`` fits on the x0s of a real sampling instead, which suits the late,
    detailed predictions better; on the tiny model the two pictured a held-out sampling within
    1 dB of each other (tests/models/test_preview.py prints both)."""
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(pipe.vae.config.z_dim, 2, 16, 16, generator=g) for _ in range(count)]
    pairs = [(z, _local_decode(pipe.vae, z)) for z in latents]
    fitted = fit_rgb_map(pairs, source=f"fitted on {pipe.model_id}'s VAE ({count} decodes of Gaussian latents)")
    quality = {"psnr_db": float(np.mean([preview_psnr(fitted, z, f) for z, f in pairs])),
               "grey_psnr_db": float(np.mean([preview_psnr(grey_map(z.shape[0]), z, f) for z, f in pairs]))}
    return fitted, quality


def _local_decode(vae: Any, z: torch.Tensor) -> np.ndarray:
    """The VAE's plain decode in this process: rank 0 of a group fits the map alone, so the
    group's split decode (a collective) is no way to get it."""
    weight = next(vae.parameters())
    with torch.no_grad():
        raw = vae.denormalize_latents(z[None].to(weight.device, torch.float32)).to(weight.dtype)
        return to_uint8_frames(vae.decode(raw)[0]).cpu().numpy()


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
