"""mp4 encode / probe / thumbnails with PyAV (libx264, yuv420p, BT.709 limited range).

A video counts as done only once it decodes to the expected number of frames, so every write goes
to a temp name in the destination folder, is flushed, fsynced and decoded back, and only then
``os.replace``d onto the final name: a crash at any point leaves either the old file or the new
one, never a half-written mp4 under the final name.
"""

from __future__ import annotations

import io
import math
import os
import struct
import tempfile
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np

from pan2render.durable import fsync_dir, fsync_file
from pan2render.media.x264 import DEFAULT_X264_PRESET, DEFAULT_X264_TUNE, X264_PRESETS, X264_TUNES

# Frame rates are stored as exact rationals in the container; 1001 keeps NTSC-style rates
# (24000/1001, 30000/1001) exact and maps 24.0 to 24/1.
_FPS_MAX_DENOMINATOR = 1001


# How every stream is tagged: BT.709 matrix, primaries and transfer, limited range; the numbers
# the conversion in media/yuv.py uses. (Values of FFmpeg's AVColorSpace / AVColorPrimaries /
# AVColorTransferCharacteristic / AVColorRange enums.)
COLOUR_TAGS = {"colorspace": 1, "color_primaries": 1, "color_trc": 1, "color_range": 1}


class MediaError(Exception):
    """An mp4 could not be written, or a file on disk is not a complete, decodable mp4."""


@dataclass(frozen=True)
class VideoInfo:
    """What a decodable mp4 holds. ``frames`` is counted by decoding, not read from the header."""

    frames: int
    width: int
    height: int
    fps: float


@dataclass(frozen=True)
class Yuv420Video:
    """Frames already converted to yuv420p (media/yuv.py): uint8 ``[F, H * 3 // 2, W]``, I420 rows
    (Y, then U, then V), BT.709 limited range."""

    planes: np.ndarray

    def __post_init__(self) -> None:
        p = self.planes
        if not isinstance(p, np.ndarray) or p.dtype != np.uint8 or p.ndim != 3 or p.shape[1] % 3:
            raise MediaError(f"Yuv420Video needs uint8 numpy [F, H*3/2, W], got "
                             f"{getattr(p, 'dtype', type(p))} {tuple(getattr(p, 'shape', ()))}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(frames, height, width) of the picture."""
        f, rows, w = self.planes.shape
        return f, rows * 2 // 3, w


def frame_threads(height: int) -> int:
    """libx264's frame threads for frames ``height`` pixels high: one per two macroblock rows, the
    cap libx264's own choice takes (1.5 x the cores, at most that: x264's encoder.c) on a machine of
    enough cores (22 for 704 rows, as on the 16-core H200 hosts of docs/performance.md, "Encode
    presets"). Not libx264's own choice: it counts the cores, and its bitstream, so the decoded
    pixels, differ with the thread count; a video rendered again (`run --from`) on another machine,
    or in a worker given another share of the cores, must come out the same."""
    return max(1, (height + 15) // 16 // 2)


def check_x264_preset(preset: str) -> str:
    if preset not in X264_PRESETS:
        raise MediaError(f"encode preset {preset!r} is not one of libx264's: {', '.join(X264_PRESETS)}")
    return preset


def check_x264_tune(tune: str) -> str:
    if tune not in X264_TUNES:
        raise MediaError(f"encode tune {tune!r} is not one of: {', '.join(X264_TUNES)}")
    return tune


def encode_mp4(frames: Any, path: str | os.PathLike[str], *, fps: float, crf: int,
               preset: str = DEFAULT_X264_PRESET, tune: str = DEFAULT_X264_TUNE,
               metadata: Mapping[str, str] | None = None) -> float:
    """Write ``frames`` to ``path`` as H.264 mp4 (yuv420p, tagged BT.709 limited range); returns
    the seconds spent encoding (without the check that decodes the file back).

    ``frames``: uint8 RGB ``[F, H, W, 3]`` (numpy or torch; converted with media/yuv.py) or a
    :class:`Yuv420Video` converted already (on the GPU by the worker). ``preset``: one of
    :data:`X264_PRESETS`; ``tune``: one of :data:`X264_TUNES` ("none": libx264's defaults). The
    encoder runs `frame_threads` frame threads: a number of the frame's size alone, so the same
    frames give the same file on any machine (libx264's bitstream depends on its thread count).

    ``metadata``: container tags (e.g. ``title``, ``comment``, or any key of ours), read back by
    :func:`read_metadata`, PyAV's ``container.metadata`` or ``ffprobe -show_format``.
    The file appears under ``path`` only after it has been decoded back and found to hold ``F``
    frames of ``W x H``; on any error no temp file is left behind and an existing ``path`` is
    untouched. Raises MediaError.
    """
    video = frames if isinstance(frames, Yuv420Video) else _to_yuv420(_as_uint8_video(frames))
    num_frames, height, width = video.shape
    rate = _fps_fraction(fps)
    if isinstance(crf, bool) or not isinstance(crf, int) or not 0 <= crf <= 51:
        raise MediaError(f"crf={crf!r} is not an integer in 0..51 (libx264's range; 18 is near lossless)")
    check_x264_preset(preset)
    check_x264_tune(tune)
    dest = Path(path)
    if not dest.parent.is_dir():
        raise MediaError(f"cannot write {dest}: folder {dest.parent} does not exist")

    # A unique temp name in the same folder, so the final os.replace is an atomic rename on one
    # filesystem; the leading dot keeps half-written files out of casual listings.
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    except OSError as exc:
        raise MediaError(f"cannot create a temp file beside {dest}: {exc}") from exc
    os.close(fd)  # PyAV opens the file by name; mkstemp only reserves a unique name
    tmp = Path(tmp_name)
    try:
        t0 = time.perf_counter()
        _write_h264(video, tmp, rate=rate, crf=crf, preset=preset, tune=tune, metadata=metadata or {})
        encode_s = time.perf_counter() - t0
        fsync_file(tmp)
        info = probe_mp4(tmp)
        if (info.frames, info.width, info.height) != (num_frames, width, height):
            raise MediaError(
                f"encoded {dest.name} decodes to {info.frames} frames of {info.width}x{info.height}, "
                f"expected {num_frames} frames of {width}x{height}; the encoder lost frames"
            )
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
        return encode_s
    except OSError as exc:  # fsync or rename: e.g. dest is a folder, or the disk is full
        tmp.unlink(missing_ok=True)
        raise MediaError(f"writing {dest} failed: {exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def probe_mp4(path: str | os.PathLike[str]) -> VideoInfo:
    """Open and fully decode ``path``; MediaError if it is missing, corrupt or truncated.

    Decoding every frame is the only reliable truncation check: with ``+faststart`` the header
    (moov) sits at the front and still announces every frame after the tail has been cut off.
    """
    p = Path(path)
    if not p.is_file():
        raise MediaError(f"no video at {p}")
    try:
        with av.open(str(p), mode="r") as container:
            if not container.streams.video:
                raise MediaError(f"{p} has no video stream (truncated, or not a video); re-encode it")
            stream = container.streams.video[0]
            if stream.codec_context is None:  # header cut before the codec parameters
                raise MediaError(f"{p} is truncated or corrupt: its video stream has no codec parameters; re-encode it")
            # Frame threads: the check decodes every frame of a video that libx264 encoded on
            # every core, and one decoder thread made it longer than the encode itself.
            stream.thread_type = "AUTO"
            declared = int(stream.frames or 0)
            rate = stream.average_rate or stream.guessed_rate
            width, height = stream.codec_context.width, stream.codec_context.height
            decoded = sum(1 for _ in container.decode(stream))
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError) as exc:
        raise MediaError(f"{p} is not a decodable mp4 ({type(exc).__name__}: {exc}); re-encode it") from exc
    if decoded == 0:
        raise MediaError(f"{p} decodes to 0 frames; re-encode it")
    if declared and decoded != declared:
        raise MediaError(
            f"{p} is truncated or corrupt: its header declares {declared} frames but only {decoded} "
            "decode; re-encode it"
        )
    return VideoInfo(frames=decoded, width=width, height=height, fps=float(rate) if rate else 0.0)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The container tags of an mp4 (as :func:`encode_mp4` wrote them, plus the muxer's own)."""
    try:
        with av.open(str(path), mode="r") as container:
            return dict(container.metadata)
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise MediaError(f"cannot read the metadata of {path}: {exc}") from exc


def middle_frame_png(path: str | os.PathLike[str], *, max_side: int) -> bytes:
    """PNG bytes of the middle frame of an mp4, scaled down so its longer side is at most
    ``max_side`` (never up). Decodes only up to that frame, on one thread: for the short clips a
    report shows by the hundred, starting the decoder's threads costs more than they save."""
    p = Path(path)
    try:
        with av.open(str(p), mode="r") as container:
            stream = container.streams.video[0]
            stream.thread_type = "NONE"
            frames = int(stream.frames or 0) or probe_mp4(p).frames  # header count; decode if absent
            middle = (frames - 1) // 2
            for i, frame in enumerate(container.decode(stream)):
                if i == middle:
                    return _scaled_png(frame, max_side)
    except (av.FFmpegError, OSError, ValueError, IndexError) as exc:
        raise MediaError(f"cannot read frames of {p}: {exc}") from exc
    raise MediaError(f"{p} ended before its middle frame {middle}; re-encode it")


def contact_strip_png(path: str | os.PathLike[str], *, tiles: int, max_side: int) -> bytes:
    """PNG bytes of ``tiles`` frames of an mp4, evenly spaced from its first to its last, each
    scaled so its longer side is at most ``max_side``, side by side in one row."""
    p = Path(path)
    try:
        with av.open(str(p), mode="r") as container:
            stream = container.streams.video[0]
            stream.thread_type = "NONE"
            count = int(stream.frames or 0) or probe_mp4(p).frames
            wanted = {round(i * (count - 1) / max(1, tiles - 1)) for i in range(tiles)}
            picked = []
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    scale = min(1.0, max_side / max(frame.width, frame.height))
                    small = frame.reformat(width=max(2, round(frame.width * scale)),
                                           height=max(2, round(frame.height * scale)), format="rgb24")
                    picked.append(small.to_ndarray())
                if i >= max(wanted):
                    break
    except (av.FFmpegError, OSError, ValueError, IndexError) as exc:
        raise MediaError(f"cannot read frames of {p}: {exc}") from exc
    if not picked:
        raise MediaError(f"{p} holds no frame")
    return png_bytes(np.concatenate(picked, axis=1))


def image_png(data: bytes, *, max_side: int, name: str) -> bytes:
    """PNG bytes of a still image given as its file's bytes (PNG, JPEG, WebP: a job's first frame,
    read by the caller under the input limits; ``name`` for messages), scaled down so its longer side
    is at most ``max_side`` (never up)."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            return _scaled_png(next(container.decode(video=0)), max_side)
    except (av.FFmpegError, OSError, ValueError, IndexError, StopIteration) as exc:
        raise MediaError(f"cannot read the image {name}: {exc}") from exc


def _scaled_png(frame: Any, max_side: int) -> bytes:
    scale = min(1.0, max_side / max(frame.width, frame.height))
    small = frame.reformat(width=max(2, round(frame.width * scale)), height=max(2, round(frame.height * scale)),
                           format="rgb24")
    return png_bytes(small.to_ndarray())  # [h, w, 3] uint8


def png_bytes(rgb: np.ndarray) -> bytes:
    """Encode a uint8 ``[H, W, 3]`` array as an 8-bit RGB PNG (no filtering, zlib level 6)."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise MediaError(f"png_bytes needs uint8 [H, W, 3], got {rgb.dtype} {tuple(rgb.shape)}")
    h, w, _ = rgb.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    # Every scanline is prefixed with filter type 0 (None).
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1).tobytes()
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8 bits, colour type 2 = RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def webp_strip(tiles: list[np.ndarray], *, height: int, quality: int = 80) -> bytes:
    """Lossy WebP bytes (libwebp) of uint8 ``[h, w, 3]`` tiles side by side in one row, each scaled
    (bilinear) to ``height`` pixels tall, its aspect kept: a live preview's strip."""
    if not tiles or any(t.dtype != np.uint8 or t.ndim != 3 or t.shape[2] != 3 for t in tiles):
        raise MediaError("webp_strip needs uint8 [h, w, 3] tiles")
    scaled = []
    for tile in tiles:
        width = max(2, round(tile.shape[1] * height / tile.shape[0]))
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(tile), format="rgb24")
        scaled.append(frame.reformat(width=width, height=height, format="rgb24",
                                     interpolation="BILINEAR").to_ndarray())
    strip = np.concatenate(scaled, axis=1)  # [height, sum of widths, 3]
    buf = io.BytesIO()
    try:
        with av.open(buf, mode="w", format="webp") as container:
            stream = container.add_stream("libwebp", rate=1)
            stream.width, stream.height, stream.pix_fmt = strip.shape[1], strip.shape[0], "yuv420p"
            stream.options = {"quality": str(quality)}
            for packet in stream.encode(av.VideoFrame.from_ndarray(strip, format="rgb24")):
                container.mux(packet)
            for packet in stream.encode(None):
                container.mux(packet)
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise MediaError(f"libwebp encode of a {strip.shape[1]}x{strip.shape[0]} strip failed: {exc}") from exc
    return buf.getvalue()


def _as_uint8_video(frames: Any) -> np.ndarray:
    if hasattr(frames, "detach"):  # torch.Tensor, without importing torch here
        frames = frames.detach().cpu().numpy()
    video = np.asarray(frames)
    if video.dtype != np.uint8:
        raise MediaError(f"frames must be uint8 RGB, got dtype {video.dtype}; "
                         "convert with (x * 255).round().clamp(0, 255).to(torch.uint8)")
    if video.ndim != 4 or video.shape[3] != 3 or video.shape[0] < 1:
        raise MediaError(f"frames must have shape [F >= 1, H, W, 3], got {tuple(video.shape)}")
    _, h, w, _ = video.shape
    if h % 2 or w % 2 or h < 2 or w < 2:
        raise MediaError(
            f"frame size {w}x{h} has an odd side; yuv420p needs even width and height "
            "(presets use multiples of 32): crop or pad the frames"
        )
    return np.ascontiguousarray(video)


def _to_yuv420(video: np.ndarray) -> Yuv420Video:
    import torch  # the conversion is shared with the GPU path

    from pan2render.media.yuv import rgb_to_yuv420

    return Yuv420Video(rgb_to_yuv420(torch.from_numpy(video)).numpy())


def _fps_fraction(fps: float) -> Fraction:
    if isinstance(fps, bool) or not isinstance(fps, (int, float, Fraction)) or not math.isfinite(fps) or fps <= 0:
        raise MediaError(f"fps={fps!r} must be a finite number > 0 (e.g. 24)")
    rate = Fraction(fps).limit_denominator(_FPS_MAX_DENOMINATOR)
    if rate <= 0:
        raise MediaError(f"fps={fps!r} is too small to store as a frame rate (denominator <= {_FPS_MAX_DENOMINATOR})")
    return rate


def _write_h264(video: Yuv420Video, path: Path, *, rate: Fraction, crf: int, preset: str, tune: str,
                metadata: Mapping[str, str]) -> None:
    num_frames, height, width = video.shape
    try:
        # +faststart puts the index at the front so the report's <video> tags play at once;
        # +use_metadata_tags stores every tag as a QuickTime "mdta" key: without it the mp4 muxer
        # keeps only the iTunes set (title, comment, description, ...) and silently drops our keys.
        with av.open(str(path), mode="w", format="mp4",
                     options={"movflags": "+faststart+use_metadata_tags"}) as container:
            for key, value in metadata.items():
                container.metadata[key] = value
            stream = container.add_stream("libx264", rate=rate)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"crf": str(crf), "preset": preset, **({} if tune == "none" else {"tune": tune})}
            ctx = stream.codec_context
            # Frame threads (PyAV's default is slice threads, which split each frame and
            # parallelise far less), as many as libx264 itself would take on enough cores.
            ctx.thread_type, ctx.thread_count = "FRAME", frame_threads(height)
            for name, value in COLOUR_TAGS.items():
                setattr(ctx, name, value)
            for i in range(num_frames):
                frame = av.VideoFrame.from_ndarray(video.planes[i], format="yuv420p")
                for name, value in COLOUR_TAGS.items():
                    setattr(frame, name, value)
                frame.pts = i  # in units of 1/rate: frame i is shown at i / fps seconds
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode(None):  # flush: x264 holds back frames for B-frame lookahead
                container.mux(packet)
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise MediaError(f"libx264 encode to {path} failed: {type(exc).__name__}: {exc}") from exc
