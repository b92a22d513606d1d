"""How far one video is from another: PSNR and SSIM over every frame, decoded with PyAV.

Both compare uint8 RGB videos ``[F, H, W, 3]`` of one shape (a fast lane's video against the exact
one of the same prompt and seed):

- PSNR = ``10 log10(255^2 / MSE)``, the MSE over every frame, pixel and channel (inf when equal).
- SSIM (Wang, Bovik, Sheikh, Simoncelli, "Image quality assessment: from error visibility to
  structural similarity", IEEE TIP 2004), per frame and channel, with the paper's settings: an
  11x11 Gaussian window of sigma 1.5 (truncated at 3.5 sigma), ``C1 = (0.01 L)^2``,
  ``C2 = (0.03 L)^2``, L = 255, population (not sample) covariances,

      SSIM = (2 mu_a mu_b + C1)(2 s_ab + C2) / ((mu_a^2 + mu_b^2 + C1)(s_a^2 + s_b^2 + C2)),

  the map averaged after dropping the 5 pixels at each border the window does not fit in (the
  image mirrored at its edges for the filtering), then averaged over channels and frames. These
  are scikit-image's ``structural_similarity(gaussian_weights=True, sigma=1.5,
  use_sample_covariance=False, data_range=255, channel_axis=-1)``, which
  ``tests/media/test_quality.py`` checks it against where scikit-image is installed (a test
  extra); numpy alone computes it here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import av
import numpy as np

__all__ = ["VideoQuality", "compare_videos", "psnr", "read_frames", "ssim"]

SSIM_SIGMA = 1.5
SSIM_TRUNCATE = 3.5
SSIM_K1, SSIM_K2 = 0.01, 0.03
DATA_RANGE = 255.0


def read_frames(path: str | os.PathLike[str]) -> np.ndarray:
    """Every frame of an mp4 as uint8 RGB ``[F, H, W, 3]``."""
    with av.open(str(path), mode="r") as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    if not frames:
        raise ValueError(f"{path}: no video frames")
    return np.stack(frames)


def _check(a: np.ndarray, b: np.ndarray) -> None:
    if a.shape != b.shape or a.ndim != 4 or a.shape[-1] != 3:
        raise ValueError(f"videos of shapes {a.shape} and {b.shape}: expected two [F, H, W, 3] of one shape")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of uint8 videos ``[F, H, W, 3]`` (inf for identical videos)."""
    _check(a, b)
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(DATA_RANGE ** 2 / mse)


def _gaussian_taps() -> np.ndarray:
    radius = int(SSIM_TRUNCATE * SSIM_SIGMA + 0.5)  # 5: an 11-tap window
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    taps = np.exp(-0.5 * (x / SSIM_SIGMA) ** 2)
    return taps / taps.sum()


def _blur(img: np.ndarray, taps: np.ndarray) -> np.ndarray:
    """Separable Gaussian of ``[H, W]`` float64, the image mirrored at its edges (``d c b | a b c d``)."""
    r = len(taps) // 2
    for axis in (0, 1):
        pad = [(0, 0), (0, 0)]
        pad[axis] = (r, r)
        padded = np.pad(img, pad, mode="symmetric")
        n = img.shape[axis]
        out = np.zeros_like(img)
        for k, w in enumerate(taps):
            out += w * (padded[k:k + n] if axis == 0 else padded[:, k:k + n])
        img = out
    return img


def _ssim_plane(a: np.ndarray, b: np.ndarray, taps: np.ndarray) -> float:
    c1, c2 = (SSIM_K1 * DATA_RANGE) ** 2, (SSIM_K2 * DATA_RANGE) ** 2
    mu_a, mu_b = _blur(a, taps), _blur(b, taps)
    var_a = _blur(a * a, taps) - mu_a * mu_a
    var_b = _blur(b * b, taps) - mu_b * mu_b
    cov = _blur(a * b, taps) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    r = len(taps) // 2
    return float(s[r:-r, r:-r].mean())


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM of uint8 videos ``[F, H, W, 3]`` (see the module doc); frames must be > 10 px a side."""
    _check(a, b)
    if min(a.shape[1:3]) <= 2 * int(SSIM_TRUNCATE * SSIM_SIGMA + 0.5):
        raise ValueError(f"frames of {a.shape[2]}x{a.shape[1]}: SSIM's 11x11 window needs more than 10 px a side")
    taps = _gaussian_taps()
    values = [_ssim_plane(a[f, :, :, c].astype(np.float64), b[f, :, :, c].astype(np.float64), taps)
              for f in range(a.shape[0]) for c in range(3)]
    return float(np.mean(values))


@dataclass(frozen=True)
class VideoQuality:
    """One video against a reference video."""

    psnr_db: float  # inf: identical
    ssim: float
    frames: int

    def to_json(self) -> dict[str, object]:
        return {"psnr_db": None if math.isinf(self.psnr_db) else round(self.psnr_db, 3),
                "ssim": round(self.ssim, 5), "frames": self.frames}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> "VideoQuality":
        value = d.get("psnr_db")
        return cls(psnr_db=math.inf if value is None else float(value),  # type: ignore[arg-type]
                   ssim=float(d["ssim"]), frames=int(d["frames"]))  # type: ignore[arg-type]


def compare_videos(video: str | os.PathLike[str], reference: str | os.PathLike[str]) -> VideoQuality:
    """PSNR and SSIM of the mp4 ``video`` against the mp4 ``reference``."""
    a, b = read_frames(video), read_frames(reference)
    return VideoQuality(psnr_db=psnr(a, b), ssim=ssim(a, b), frames=int(a.shape[0]))
