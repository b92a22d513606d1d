"""mp4 encode / probe / thumbnails: round trip, exact frame rates, truncation, atomic writes."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from pan2render.media import MediaError, encode_mp4, middle_frame_png, probe_mp4, read_metadata
from pan2render.media import video as video_mod


def _smooth_video(frames: int = 17, height: int = 64, width: int = 64) -> np.ndarray:
    """A moving colour gradient, uint8 [F, H, W, 3]: smooth enough that crf 18 keeps it close."""
    t, y, x = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
    r = x * 160 // width + t * 4  # stays below 256: no wrap-around edges
    g = y * 160 // height + t * 2
    b = np.full_like(r, 128)
    return np.stack([r, g, b], axis=-1).astype(np.uint8)


def _decode_all(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / max(mse, 1e-12)))


def test_round_trip_17_frames_64x64(tmp_path: Path) -> None:
    video = _smooth_video()
    out = tmp_path / "video.mp4"
    encode_mp4(video, out, fps=8, crf=18)
    info = probe_mp4(out)
    decoded = _decode_all(out)
    psnr = _psnr(decoded, video)
    print(f"{info}, {out.stat().st_size} bytes, PSNR {psnr:.1f} dB vs the input")
    assert (info.frames, info.width, info.height, info.fps) == (17, 64, 64, 8.0)
    assert decoded.shape == video.shape
    # RGB -> yuv420p (limited range, half-res chroma) -> RGB alone costs a few dB; measured ~42 dB.
    assert psnr > 35.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["video.mp4"]  # no temp file left


def test_torch_input_and_one_frame(tmp_path: Path) -> None:
    frames = torch.from_numpy(_smooth_video(frames=1, height=32, width=96))
    encode_mp4(frames, tmp_path / "one.mp4", fps=24, crf=23)
    info = probe_mp4(tmp_path / "one.mp4")
    assert (info.frames, info.width, info.height) == (1, 96, 32)


@pytest.mark.parametrize("fps,expected", [(24, 24.0), (23.976, 23.976), (24000 / 1001, 24000 / 1001), (12.5, 12.5)])
def test_fractional_frame_rates_are_stored_exactly(tmp_path: Path, fps: float, expected: float) -> None:
    encode_mp4(_smooth_video(frames=5), tmp_path / "v.mp4", fps=fps, crf=30)
    with av.open(str(tmp_path / "v.mp4")) as c:
        rate = c.streams.video[0].average_rate
    print(f"fps {fps} -> stream rate {rate}")
    assert abs(float(rate) - expected) < 1e-9
    assert abs(probe_mp4(tmp_path / "v.mp4").fps - expected) < 1e-9


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.99])
def test_truncated_file_is_a_media_error(tmp_path: Path, fraction: float) -> None:
    good = tmp_path / "good.mp4"
    encode_mp4(_smooth_video(), good, fps=8, crf=18)
    data = good.read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(MediaError) as info:
        probe_mp4(cut)
    print(f"cut at {fraction:.0%} of {len(data)} bytes: {info.value}")
    assert "cut.mp4" in str(info.value)


@pytest.mark.parametrize("content", [b"", b"not an mp4 at all" * 10], ids=["empty", "garbage"])
def test_corrupt_or_missing_file_is_a_media_error(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(content)
    with pytest.raises(MediaError, match="bad.mp4"):
        probe_mp4(bad)
    with pytest.raises(MediaError, match="no video at"):
        probe_mp4(tmp_path / "missing.mp4")


def test_failed_validation_leaves_no_temp_and_keeps_the_old_file(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "video.mp4"
    out.write_bytes(b"previous render")

    def lying_probe(path: Path) -> video_mod.VideoInfo:
        assert Path(path).name.startswith(".video.mp4.") and Path(path).exists()  # the temp name
        return video_mod.VideoInfo(frames=3, width=64, height=64, fps=8.0)

    monkeypatch.setattr(video_mod, "probe_mp4", lying_probe)
    with pytest.raises(MediaError, match="decodes to 3 frames.*expected 17"):
        encode_mp4(_smooth_video(), out, fps=8, crf=18)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["video.mp4"]
    assert out.read_bytes() == b"previous render"


def test_encoder_failure_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise MediaError("libx264 encode failed: simulated")

    monkeypatch.setattr(video_mod, "_write_h264", broken)
    with pytest.raises(MediaError, match="simulated"):
        encode_mp4(_smooth_video(), tmp_path / "v.mp4", fps=8, crf=18)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "frames,kw,match",
    [(np.zeros((3, 63, 64, 3), np.uint8), {}, "odd side.*yuv420p needs even"),
     (np.zeros((3, 64, 64, 3), np.float32), {}, "must be uint8"),
     (np.zeros((3, 64, 64), np.uint8), {}, r"shape \[F >= 1, H, W, 3\]"),
     (np.zeros((0, 64, 64, 3), np.uint8), {}, r"shape \[F >= 1, H, W, 3\]"),
     (np.zeros((3, 64, 64, 3), np.uint8), {"fps": 0.0}, "fps=0.0 must be a finite number > 0"),
     (np.zeros((3, 64, 64, 3), np.uint8), {"crf": 60}, "crf=60 is not an integer in 0..51")],
    ids=["odd-height", "float", "no-channels", "no-frames", "fps-zero", "crf-60"],
)
def test_bad_input_is_refused_before_writing(tmp_path: Path, frames: np.ndarray, kw: dict, match: str) -> None:
    args = {"fps": 8.0, "crf": 18, **kw}
    with pytest.raises(MediaError, match=match):
        encode_mp4(frames, tmp_path / "v.mp4", **args)
    assert list(tmp_path.iterdir()) == []


def _read_png(data: bytes) -> np.ndarray:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks[kind] = body
        pos += 12 + length
    w, h, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2)
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + w * 3)
    assert (rows[:, 0] == 0).all()  # filter type None
    return rows[:, 1:].reshape(h, w, 3)


def test_middle_frame_png_is_the_middle_frame_scaled_down(tmp_path: Path) -> None:
    # Frame i is a flat grey of level 15 * i, so the poster says which frame it came from.
    video = np.repeat(np.arange(17, dtype=np.uint8)[:, None, None, None] * 15, 3, axis=3)
    video = np.broadcast_to(video, (17, 64, 128, 3)).copy()
    encode_mp4(video, tmp_path / "v.mp4", fps=8, crf=0)
    poster = _read_png(middle_frame_png(tmp_path / "v.mp4", max_side=64))
    print(f"poster {poster.shape}, level {poster.mean():.1f} (frame 8: 120)")
    assert poster.shape == (32, 64, 3)  # aspect kept: 128x64 -> 64x32
    assert abs(float(poster.mean()) - 120) < 4
    big = _read_png(middle_frame_png(tmp_path / "v.mp4", max_side=4096))
    assert big.shape == (64, 128, 3)  # never scaled up


def test_metadata_tags_survive_the_mp4_muxer(tmp_path: Path) -> None:
    tags = {"title": "fox-seed0", "comment": "A red fox \u2014 in snow", "pan2_render": '{"seed": 0}'}
    encode_mp4(_smooth_video(frames=5), tmp_path / "v.mp4", fps=8, crf=18, metadata=tags)
    back = read_metadata(tmp_path / "v.mp4")
    print(back)
    assert {k: back.get(k) for k in tags} == tags  # our own key too, not only the iTunes set


def test_destination_that_is_a_folder_is_a_media_error(tmp_path: Path) -> None:
    (tmp_path / "video.mp4").mkdir()
    with pytest.raises(MediaError, match="writing .*video.mp4 failed"):
        encode_mp4(_smooth_video(frames=5), tmp_path / "video.mp4", fps=8, crf=18)
    assert [p.name for p in tmp_path.iterdir()] == ["video.mp4"]  # the folder, and no temp file
