"""libx264's encoder presets: the names a job's ``encode_preset`` may take (no heavy imports, so
batch validation can use them without loading PyAV)."""

from __future__ import annotations

# Fastest first. At a fixed crf a slower preset spends more CPU for a smaller file of about the
# same quality; "medium" is libx264's own default (and ours).
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower",
                "veryslow")
DEFAULT_X264_PRESET = "medium"
