"""Video output: PyAV libx264 encode with validation and metadata, probing, poster frames."""

from pan2render.media.video import (
    MediaError,
    VideoInfo,
    encode_mp4,
    middle_frame_png,
    png_bytes,
    probe_mp4,
    read_metadata,
)

__all__ = ["MediaError", "VideoInfo", "encode_mp4", "middle_frame_png", "png_bytes", "probe_mp4",
           "read_metadata"]
