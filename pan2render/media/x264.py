"""libx264's encoder presets and tunings: the names a job's ``encode_preset`` and ``encode_tune``
may take (no heavy imports, so batch validation can use them without loading PyAV)."""

from __future__ import annotations

# Fastest first. At a fixed crf a slower preset spends more CPU for a smaller file of about the
# same quality.
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower",
                "veryslow")
# Ours is "veryfast", not libx264's "medium": on a 16-core host a 704x1248x121 video at crf 18
# encoded 2.2x (smooth content) to 3.5x (noise) faster, for the same PSNR and size on smooth
# content (44.8 vs 44.7 dB, 0.86 vs 0.85 MB) and 1.3 dB less on noise (docs/performance.md,
# scripts/bench_encode.py). The encode is what a video waits for after its decode.
DEFAULT_X264_PRESET = "veryfast"

# What the content is, so libx264 weights its psycho-visual choices for it; "none" leaves them as
# they are. (libx264's "psnr" and "ssim" tunings, which switch those choices off to win a metric,
# are left out.)
X264_TUNES = ("none", "film", "animation", "grain", "stillimage", "fastdecode", "zerolatency")
DEFAULT_X264_TUNE = "none"
