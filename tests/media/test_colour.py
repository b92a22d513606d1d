"""Colour matching of chained segments (media/colour.py): the Lab conversion against published
values, and a segment deliberately shifted in colour moved back onto the first segment's
per-channel statistics, with a negative control."""

from __future__ import annotations

import pytest
import torch

from pan2render.long_video import ColourStats
from pan2render.media.colour import GAIN_LIMIT, colour_stats, lab_to_srgb, match_colour, srgb_to_lab


def _segment(seed: int) -> torch.Tensor:
    """uint8 [9, 24, 32, 3]: smooth colour fields that drift from frame to frame, away from 0 and 255
    (clipping would make any matching inexact)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(9, 3, 3, 4, generator=g) * 140 + 50
    fine = torch.nn.functional.interpolate(coarse, size=(24, 32), mode="bilinear", align_corners=False)
    return fine.permute(0, 2, 3, 1).round().to(torch.uint8).contiguous()


def _shifted(frames: torch.Tensor) -> torch.Tensor:
    """The drift a chained segment shows: darker, less contrast, a warm cast (done in Lab)."""
    lab = srgb_to_lab(frames)
    lab[..., 0] = lab[..., 0] * 0.8 + 4  # lightness: down and flatter
    lab[..., 1] += 6  # towards red
    lab[..., 2] = lab[..., 2] * 1.2 + 9  # towards yellow, more spread
    return lab_to_srgb(lab)


def _gap(a: ColourStats, b: ColourStats) -> float:
    return max(max(abs(x - y) for x, y in zip(a.mean, b.mean)), max(abs(x - y) for x, y in zip(a.std, b.std)))


def test_lab_of_reference_colours() -> None:
    """sRGB white, black, primaries and a grey against the CIE Lab values of the sRGB standard's
    D65 conversion (e.g. Bruce Lindbloom's calculator)."""
    rgb = torch.tensor([[255, 255, 255], [0, 0, 0], [255, 0, 0], [0, 255, 0], [0, 0, 255], [128, 128, 128]],
                       dtype=torch.uint8)
    expected = torch.tensor([[100.0, 0.0, 0.0], [0.0, 0.0, 0.0], [53.24, 80.09, 67.20], [87.73, -86.18, 83.18],
                             [32.30, 79.19, -107.86], [53.59, 0.0, 0.0]])
    assert torch.allclose(srgb_to_lab(rgb), expected, atol=0.05)
    frames = _segment(0)
    assert torch.equal(lab_to_srgb(srgb_to_lab(frames)), frames)  # the round trip loses nothing


def test_a_shifted_segment_is_moved_onto_the_first_segments_statistics() -> None:
    first = _segment(1)
    later = _shifted(_segment(2))  # other content, and drifted
    ref, stats = colour_stats(first), colour_stats(later)
    gap_before = _gap(stats, ref)
    matched = match_colour(later, stats, ref)
    gap_after = _gap(colour_stats(matched), ref)
    print(f"\nLab statistics, first segment {ref}\n  shifted {stats} (gap {gap_before:.2f})\n"
          f"  matched {colour_stats(matched)} (gap {gap_after:.3f})")
    assert gap_before > 5  # negative control: the shift is there to be corrected, far beyond the tolerance
    assert gap_after < 0.5  # uint8 rounding leaves a few tenths of a Lab unit
    # Negative control: matched to another segment's statistics, it does not land on the first's.
    other = colour_stats(_shifted(_shifted(_segment(3))))
    assert _gap(colour_stats(match_colour(later, stats, other)), ref) > 5
    # The same frames and statistics give the same bits (a resumed job's video equals the first run's).
    assert torch.equal(match_colour(later, stats, ref), matched)
    assert matched.shape == later.shape and matched.dtype == torch.uint8


def test_the_gain_is_bounded_for_a_nearly_flat_segment() -> None:
    flat = torch.full((3, 8, 8, 3), 100, dtype=torch.uint8)
    flat[0, 0, 0] = 104  # almost no spread: matching a lively segment's would amplify it 100-fold
    ref = colour_stats(_segment(4))
    out = colour_stats(match_colour(flat, colour_stats(flat), ref))
    assert all(o <= s * GAIN_LIMIT + 0.5 for o, s in zip(out.std, colour_stats(flat).std))


def test_frames_that_are_not_uint8_rgb_are_refused() -> None:
    with pytest.raises(ValueError, match=r"uint8 frames \[F, H, W, 3\]"):
        colour_stats(torch.zeros(2, 4, 4, 3))
