"""PSNR and SSIM of two known videos (pan2render.media.quality): against an independent numpy
computation written from the formulas, against scikit-image where it is installed (a test extra),
and through the mp4 files `pan2-render compare` reads."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pan2render.media.quality import compare_videos, psnr, read_frames, ssim
from pan2render.media.video import encode_mp4


def two_videos() -> tuple[np.ndarray, np.ndarray]:
    """A smooth moving pattern and a noisy, shifted-brightness copy of it: [F, H, W, 3] uint8."""
    f, h, w = 3, 36, 44
    t, y, x = np.meshgrid(np.arange(f), np.arange(h), np.arange(w), indexing="ij")
    base = 128 + 60 * np.sin(x / 5.0 + t) * np.cos(y / 7.0)
    a = np.stack([base, base * 0.8 + 20, 255 - base], axis=-1)
    noise = np.random.default_rng(0).normal(0, 6, a.shape)
    return np.clip(a, 0, 255).astype(np.uint8), np.clip(a + noise + 4, 0, 255).astype(np.uint8)


def independent_ssim(a: np.ndarray, b: np.ndarray) -> float:
    """SSIM per Wang et al. 2004 by direct windowed sums: at every pixel whose 11x11 window fits,
    the Gaussian-weighted means, variances and covariance of the window (no filtering trick)."""
    g = np.exp(-0.5 * (np.arange(-5, 6) / 1.5) ** 2)
    win = np.outer(g, g) / np.outer(g, g).sum()
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    values = []
    for fa, fb in zip(a.astype(np.float64), b.astype(np.float64)):
        for c in range(3):
            pa, pb = fa[..., c], fb[..., c]
            h, w = pa.shape
            for i in range(5, h - 5):
                for j in range(5, w - 5):
                    wa, wb = pa[i - 5:i + 6, j - 5:j + 6], pb[i - 5:i + 6, j - 5:j + 6]
                    ma, mb = (win * wa).sum(), (win * wb).sum()
                    va, vb = (win * wa * wa).sum() - ma ** 2, (win * wb * wb).sum() - mb ** 2
                    cov = (win * wa * wb).sum() - ma * mb
                    values.append((2 * ma * mb + c1) * (2 * cov + c2) / ((ma ** 2 + mb ** 2 + c1) * (va + vb + c2)))
    return float(np.mean(values))


def test_psnr_and_ssim_equal_an_independent_computation() -> None:
    a, b = two_videos()
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    assert psnr(a, b) == pytest.approx(10 * math.log10(255 ** 2 / mse), rel=1e-12)
    assert ssim(a, b) == pytest.approx(independent_ssim(a, b), abs=1e-9)
    assert psnr(a, a) == math.inf and ssim(a, a) == pytest.approx(1.0)
    worse = np.clip(b.astype(int) + np.random.default_rng(1).normal(0, 20, b.shape), 0, 255).astype(np.uint8)
    assert psnr(a, worse) < psnr(a, b) and ssim(a, worse) < ssim(a, b) < 1.0  # negative control


def test_ssim_equals_scikit_image() -> None:
    metrics = pytest.importorskip("skimage.metrics")
    a, b = two_videos()
    want = np.mean([metrics.structural_similarity(a[f], b[f], gaussian_weights=True, sigma=1.5,
                                                  use_sample_covariance=False, data_range=255, channel_axis=-1)
                    for f in range(a.shape[0])])
    assert ssim(a, b) == pytest.approx(want, abs=1e-9)
    assert psnr(a, b) == pytest.approx(metrics.peak_signal_noise_ratio(a, b, data_range=255), rel=1e-12)


def test_compare_reads_both_mp4s(tmp_path: Path) -> None:
    a, b = two_videos()
    pa, pb = tmp_path / "a.mp4", tmp_path / "b.mp4"
    for video, path in ((a, pa), (b, pb)):
        encode_mp4(np.pad(video, ((0, 0), (0, 28), (0, 20), (0, 0))), path, fps=8, crf=0)
    q = compare_videos(pb, pa)
    fa, fb = read_frames(pa), read_frames(pb)
    assert fa.shape == (3, 64, 64, 3) and q.frames == 3
    assert q.psnr_db == pytest.approx(psnr(fb, fa)) and q.ssim == pytest.approx(ssim(fb, fa))
    assert compare_videos(pa, pa).psnr_db == math.inf
