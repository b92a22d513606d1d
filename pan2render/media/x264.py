"""libx264's encoder presets and tunings: the names a job's ``encode_preset`` and ``encode_tune``
may take (no heavy imports, so batch validation can use them without loading PyAV)."""

from __future__ import annotations

# Fastest first. At a fixed crf a slower preset spends more CPU for a smaller file of about the
# same quality; "medium" is libx264's own default (and ours).
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower",
                "veryslow")
DEFAULT_X264_PRESET = "medium"

# What the content is, so libx264 weights its psycho-visual choices for it; "none" leaves them as
# they are. (libx264's "psnr" and "ssim" tunings, which switch those choices off to win a metric,
# are left out.)
X264_TUNES = ("none", "film", "animation", "grain", "stillimage", "fastdecode", "zerolatency")
DEFAULT_X264_TUNE = "none"
