"""Video output: PyAV libx264 encode with validation, probing and thumbnail strips."""

from pan2render.media.video import MediaError, VideoInfo, encode_mp4, png_bytes, probe_mp4, thumbnail_strip

__all__ = ["MediaError", "VideoInfo", "encode_mp4", "png_bytes", "probe_mp4", "thumbnail_strip"]
