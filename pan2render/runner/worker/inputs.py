"""What a worker builds and reads: the PAN2 pipeline (the default factory a worker's config names)
and a job's first-frame image, sent as bytes by the driver so that workers need no shared filesystem."""

from __future__ import annotations

import io
from typing import Any

import av

from pan2render.phases import phase
from pan2render.runner.protocol.failures import JobInputError


def load_pan2_pipeline(model: str, device: str) -> Any:
    with phase("imports"):
        from pan2render.models import PAN2Pipeline, PAN2PipelineConfig  # heavy import

    return PAN2Pipeline.from_pretrained(model, config=PAN2PipelineConfig(device=device))


def decode_image(data: bytes) -> Any:
    """Image file bytes (PNG, JPEG, WebP, ...) -> uint8 numpy [H, W, 3], with PyAV (a dependency
    already, unlike Pillow). The driver sends the bytes, so workers need no shared filesystem."""
    try:
        with av.open(io.BytesIO(data)) as container:
            frame = next(container.decode(video=0))
            return frame.to_ndarray(format="rgb24")
    except (av.FFmpegError, StopIteration) as e:
        raise JobInputError(f"the first-frame image ({len(data)} bytes) does not decode: {e}") from e
