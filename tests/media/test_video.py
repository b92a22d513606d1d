"""mp4 encode / probe / thumbnails: round trip, exact frame rates, truncation, atomic writes."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
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


# --------------------------------------------------------------------------------------------------
# Colour: conversion on the device (media/yuv.py), BT.709 limited range, stream tagged so


_PATCHES = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0], [30, 200, 120],
                     [128, 128, 128], [250, 250, 250], [10, 10, 10]], np.uint8)


def _patches(frames: int = 3) -> np.ndarray:
    """Flat saturated patches 16 px wide, uint8 [F, 32, 128, 3]: a wrong matrix or range shows."""
    video = np.zeros((frames, 32, 128, 3), np.uint8)
    for i, colour in enumerate(_PATCHES):
        video[:, :, i * 16:(i + 1) * 16] = colour
    return video


@pytest.mark.parametrize("converted_first", [False, True])
def test_colours_round_trip_through_the_tagged_bt709_stream(tmp_path: Path, converted_first: bool) -> None:
    from pan2render.media.video import Yuv420Video
    from pan2render.media.yuv import rgb_to_yuv420

    video = _patches()
    src = Yuv420Video(rgb_to_yuv420(torch.from_numpy(video)).numpy()) if converted_first else video
    encode_mp4(src, tmp_path / "v.mp4", fps=8, crf=18)
    with av.open(str(tmp_path / "v.mp4")) as c:
        ctx = c.streams.video[0].codec_context
        tags = (ctx.colorspace, ctx.color_primaries, ctx.color_trc, ctx.color_range)
    decoded = _decode_all(tmp_path / "v.mp4")  # PyAV converts with the stream's tagged matrix
    centres = decoded[:, 8:24, [i * 16 + 8 for i in range(8)]].astype(int)  # [F, 16, 8, 3]
    err = np.abs(centres - _PATCHES[None, None].astype(int)).max()
    print(f"tags {tags}; max error at patch centres {err} (of 255)")
    assert tags == (1, 1, 1, 1)  # BT.709 matrix, primaries, transfer; limited (MPEG) range
    assert err <= 3  # measured 2: limited-range rounding and crf 18


def test_a_wrong_matrix_would_fail_the_colour_check() -> None:
    """Negative control for the tolerance above: BT.601 numbers decoded as BT.709 miss by far more."""
    rgb = _PATCHES.astype(float)
    kr, kb = 0.299, 0.114  # BT.601
    y = kr * rgb[:, 0] + (1 - kr - kb) * rgb[:, 1] + kb * rgb[:, 2]
    cb, cr = (rgb[:, 2] - y) / (2 * (1 - kb)), (rgb[:, 0] - y) / (2 * (1 - kr))
    kr7, kb7 = 0.2126, 0.0722  # read back as BT.709
    r = y + 2 * (1 - kr7) * cr
    b = y + 2 * (1 - kb7) * cb
    g = (y - kr7 * r - kb7 * b) / (1 - kr7 - kb7)
    err = np.abs(np.stack([r, g, b], 1) - rgb).max()
    print(f"BT.601 read as BT.709: max error {err:.0f}")
    assert err > 3 * 5


def test_yuv420_planes_match_the_formula() -> None:
    from pan2render.media.yuv import rgb_to_yuv420

    frame = torch.tensor(_PATCHES[None, None].repeat(2, axis=1).repeat(2, axis=2))  # [1, 2, 16, 3]
    planes = rgb_to_yuv420(frame)  # [1, 3, 16]: Y rows 0-1, then U (1x8) and V (1x8) in row 2
    y, u, v = planes[0, :2], planes[0, 2, :8], planes[0, 2, 8:]
    print("Y", y[0, ::2].tolist(), "U", u.tolist(), "V", v.tolist())
    assert y[0, 0] == 63 and u[0] == 102 and v[0] == 240  # red: BT.709 limited range
    assert y[0, 10] == 126 and u[5] == 128 and v[5] == 128  # grey 128: neutral chroma
    with pytest.raises(ValueError, match="even width and height"):
        rgb_to_yuv420(torch.zeros(1, 3, 4, 3, dtype=torch.uint8))


@pytest.mark.parametrize("preset", ["ultrafast", "veryslow"])
def test_encode_presets_validate_and_name_the_allowed_ones(tmp_path: Path, preset: str) -> None:
    encode_mp4(_smooth_video(frames=5), tmp_path / "v.mp4", fps=8, crf=18, preset=preset)
    assert probe_mp4(tmp_path / "v.mp4").frames == 5
    with pytest.raises(MediaError, match="'quick' is not one of libx264's: ultrafast, superfast"):
        encode_mp4(_smooth_video(frames=5), tmp_path / "w.mp4", fps=8, crf=18, preset="quick")
    assert not (tmp_path / "w.mp4").exists()


@pytest.mark.gpu
def test_yuv420_on_the_gpu_matches_the_cpu() -> None:
    """The worker converts on the GPU; the CPU path (and the tests above) on the CPU: same planes."""
    from pan2render.media.yuv import rgb_to_yuv420

    video = torch.from_numpy(np.concatenate([_smooth_video(frames=20, height=64, width=96),
                                             _patches(frames=20)[:, :, :96][:, :64].repeat(2, axis=1)], axis=0))
    cpu = rgb_to_yuv420(video)
    gpu = rgb_to_yuv420(video.cuda()).cpu()
    diff = (cpu.int() - gpu.int()).abs()
    print(f"GPU vs CPU planes: max |diff| {int(diff.max())}, {int((diff > 0).sum())} of {diff.numel()} differ")
    assert int(diff.max()) <= 1  # float rounding at .5 may go either way; nothing else may differ


def test_an_encode_tune_reaches_libx264_and_a_bad_one_is_named(tmp_path: Path) -> None:
    # x264 writes its settings into the stream (an SEI message): the tune shows up there.
    def settings(path: Path) -> bytes:
        data = path.read_bytes()
        start = data.index(b"x264 - core")
        return data[start:data.index(b"\x00", start)]

    encode_mp4(_smooth_video(frames=5), tmp_path / "plain.mp4", fps=8, crf=18)
    encode_mp4(_smooth_video(frames=5), tmp_path / "anim.mp4", fps=8, crf=18, tune="animation")
    assert probe_mp4(tmp_path / "anim.mp4").frames == 5
    # animation: more reference frames and deblocking +1:+1 (libx264's tune table)
    assert b"deblock=1:0:0" in settings(tmp_path / "plain.mp4")
    assert b"deblock=1:1:1" in settings(tmp_path / "anim.mp4")
    with pytest.raises(MediaError, match="'cartoon' is not one of: none, film, animation"):
        encode_mp4(_smooth_video(frames=5), tmp_path / "w.mp4", fps=8, crf=18, tune="cartoon")
    assert not (tmp_path / "w.mp4").exists()


_ENCODE_ON_CORES = """
import os, sys
import numpy as np
from pan2render.media import encode_mp4
os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(",")})
rng = np.random.default_rng(0)
encode_mp4(rng.integers(0, 256, (9, 256, 256, 3), dtype=np.uint8), sys.argv[1], fps=8, crf=18)
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to give the encoder one or two")
def test_the_same_frames_are_the_same_file_on_one_core_or_two(tmp_path: Path) -> None:
    """libx264's own thread count follows the cores it may run on (1.5 x, at most one per two
    macroblock rows), and its bitstream the thread count: the encoder's count is the frame size's
    alone, so a video rendered again on another machine or worker is the same file, the same pixels."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    files = {}
    for n in (1, 2):
        path = tmp_path / f"on-{n}.mp4"
        subprocess.run([sys.executable, "-c", _ENCODE_ON_CORES, str(path), ",".join(map(str, cores[:n]))], check=True)
        files[n] = path.read_bytes()
    assert files[1] == files[2]
    assert b"threads=8 " in files[1]  # 256 rows: 16 macroblock rows, one thread per two
