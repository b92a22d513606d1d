"""libx264 encode of one video as the worker runs it, on synthetic content: presets, thread counts,
extra x264 options, segment-parallel encoding, one or two encodes at once.

    python scripts/bench_encode.py --out DIR                    # 704x1248x121, both contents, six presets
    python scripts/bench_encode.py --out /tmp/be --frames 25 --height 176 --width 320   # CPU smoke
    python scripts/bench_encode.py --out DIR --presets medium --contents noise --segments 1 2 4
    python scripts/bench_encode.py --out DIR --presets medium --x264-params "" sliced-threads=1

What runs: the worker's ``_encode`` hands ``encode_mp4`` a ``Yuv420Video`` (planes converted on
the GPU by ``media/yuv.py``), the job's fps, crf, preset and tune, and the container tags; the
call encodes with `frame_threads` frame threads (one per two macroblock rows), then fsyncs the file and decodes it back
(``probe_mp4``) before renaming it into place. A row with the product's settings (``--threads 0``,
no ``--x264-params``, one segment) calls ``encode_mp4`` itself; its ``encode_s`` is what the call
returns and ``check_s`` the rest of the call. Any other row goes through this script's copy of the
same writer (same options, colour tags and frame loop; ``--check-writer`` shows the copy gives the
product's bitstream byte for byte) with the row's changes, then the same fsync and ``probe_mp4``.

Contents (uint8 RGB converted to yuv420p by ``media/yuv.py``, as the worker does):
- ``noise``: every pixel uniform random, what the random-weight checkpoint renders (the worst case
  for x264: ~40 MB per 704x1248x121 video at crf 18);
- ``smooth``: a panning pattern of soft gradients with moving discs and boxes and mild grain, a
  stand-in for real video.

Variants:
- ``--threads N``: libx264's frame threads per encoder; 0 is the product's, ``frame_threads`` of the
  height (half the macroblock rows: libx264's own choice on a machine of enough cores, which counts
  the cores: 1.5 x the cores, at most that).
- ``--x264-params S``: extra libx264 options, ``key=value:key=value`` (e.g. ``sliced-threads=1``,
  ``rc-lookahead=20``, ``sync-lookahead=0``, ``lookahead-threads=4``); "" for none.
- ``--segments K``: the frames cut into K runs of consecutive frames, each encoded by its own
  libx264 at the same settings (so each run starts with an IDR frame: a closed GOP), all K at once on
  their own threads, then their packets copied into one mp4 with the timestamps shifted by the
  run's start. With ``--threads 0`` each of the K encoders gets ``frame_threads`` / K frame threads
  (the product's count, shared out). The row checks that the muxed file decodes to every frame at
  ``i / fps``. Why it might pay on many cores: a libx264 frame thread encodes one whole frame, and
  a P frame's row r waits until its reference has finished row r + ~4 (the motion vector range
  kept between threads plus the deblocking margin), so a chain of P frames (all of the noise
  video) advances ~4 of 704/16 = 44 macroblock rows per frame time however many cores there are:
  ~11 frames in flight at most. K runs are K chains, and K lookaheads.
- ``--concurrency C``: C encodes of the same video started together on C threads (the worker runs
  up to two); ``wall_s`` is from their start to the last one's end.

Per row: encode and check seconds, frames per second of the encode, bytes, PSNR of the decoded
mp4 against the source planes (Y, U, V; from the summed squared error of all frames), the frame
types, libx264's options as written in the stream (threads it chose, lookahead threads), the
process's CPU seconds, and (one encode at a time) the CPU seconds of every thread the encode ran
on, sampled from /proc: the busiest thread is a floor under the encode's wall on any number of
cores, and the sum over the encode's wall is how many cores it kept busy.

Prints each row as it ends and a table at the end; writes DIR/bench_encode.json after every row.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import resource
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's pan2render, not whichever one is installed

import av
import numpy as np
import torch

from pan2render.durable import fsync_file
from pan2render.media.video import COLOUR_TAGS, Yuv420Video, encode_mp4, frame_threads, probe_mp4
from pan2render.media.x264 import DEFAULT_X264_PRESET, X264_TUNES
from pan2render.media.yuv import rgb_to_yuv420
from pan2render.runner.protocol.outputs import MP4_PARAMS_KEY

CONTENTS = ("noise", "smooth")
PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium")
# The container tags the worker writes (outputs.video_tags: job name, prompt, the spec as JSON),
# at about their real size.
METADATA = {"title": "bench-encode", "comment": "synthetic content for scripts/bench_encode.py",
            MP4_PARAMS_KEY: json.dumps({"spec": "x" * 1500}, separators=(",", ":"))}
_CHUNK = 16  # frames generated and converted at once (bounds the float temporaries)


def cores() -> int:
    """The cores this process may run on: what libx264 counts for its own thread choice."""
    return len(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------------------- content

def make_planes(content: str, frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 I420 planes [F, H*3/2, W] of ``content``: RGB made here, converted by media/yuv.py."""
    rng = np.random.default_rng(seed)
    out = np.empty((frames, height * 3 // 2, width), dtype=np.uint8)
    scene = _SmoothScene(height, width, rng) if content == "smooth" else None
    for start in range(0, frames, _CHUNK):
        stop = min(start + _CHUNK, frames)
        if scene is None:
            rgb = rng.integers(0, 256, size=(stop - start, height, width, 3), dtype=np.uint8)
        else:
            rgb = np.stack([scene.frame(t, rng) for t in range(start, stop)])
        out[start:stop] = rgb_to_yuv420(torch.from_numpy(rgb)).numpy()
    return out


class _SmoothScene:
    """A pattern of low-frequency sinusoids panning at a few pixels a frame (real motion for the
    motion search), three discs and two boxes with soft edges crossing it on their own paths, and
    grain of about 2 levels: smooth like rendered video, with nothing x264 can skip outright."""

    def __init__(self, height: int, width: int, rng: np.random.Generator) -> None:
        self.h, self.w = height, width
        self.y = np.arange(height, dtype=np.float32)
        self.x = np.arange(width, dtype=np.float32)
        self.waves = [(rng.uniform(0.5, 3.0) / width, rng.uniform(0.5, 3.0) / height, rng.uniform(0, 2 * np.pi))
                      for _ in range(3)]  # per channel: cycles per pixel in x and y, phase
        self.discs = [(rng.uniform(0.08, 0.16) * height, rng.uniform(0.2, 0.8, size=2),
                       rng.uniform(0.004, 0.012, size=2), rng.uniform(30, 230, size=3).astype(np.float32))
                      for _ in range(3)]  # radius, path phases, cycles per frame in y and x, colour
        self.boxes = [(rng.uniform(0.1, 0.25, size=2) * (height, width), rng.uniform(-3, 3, size=2),
                       rng.uniform(30, 230, size=3).astype(np.float32)) for _ in range(2)]

    def frame(self, t: int, rng: np.random.Generator) -> np.ndarray:
        h, w, y, x = self.h, self.w, self.y, self.x
        pan_x, pan_y = 2.5 * t, 1.25 * t  # pixels
        img = np.empty((h, w, 3), dtype=np.float32)
        for c, (fx, fy, phase) in enumerate(self.waves):
            # sin(a + b) = sin a cos b + cos a sin b: two outer products instead of a sine per pixel
            a = 2 * np.pi * fx * (x + pan_x)
            b = 2 * np.pi * fy * (y + pan_y) + phase
            img[..., c] = 128 + 80 * (np.outer(np.cos(b), np.sin(a)) + np.outer(np.sin(b), np.cos(a)))
        for radius, centre, speed, colour in self.discs:
            cy = h * (0.5 + 0.4 * np.sin(2 * np.pi * speed[0] * t + centre[0] * 6))
            cx = w * (0.5 + 0.4 * np.sin(2 * np.pi * speed[1] * t + centre[1] * 6))
            y0, y1 = max(0, int(cy - radius) - 1), min(h, int(cy + radius) + 2)  # the disc's bounding box
            x0, x1 = max(0, int(cx - radius) - 1), min(w, int(cx + radius) + 2)
            dist = np.hypot(y[y0:y1, None] - cy, x[None, x0:x1] - cx)
            alpha = np.clip(radius - dist, 0, 1.5)[..., None] / 1.5  # ~1.5 px soft edge
            patch = img[y0:y1, x0:x1]
            patch += (colour - patch) * alpha
        for (bh, bw), (vy, vx), colour in self.boxes:
            top, left = (h / 3 + vy * t) % h, (w / 3 + vx * t) % w
            img[int(np.ceil(top)):int(np.ceil(top + bh)), int(np.ceil(left)):int(np.ceil(left + bw))] = colour
        img += rng.standard_normal(img.shape, dtype=np.float32) * 2.0
        return np.clip(img + 0.5, 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------------------- encoding

@dataclass(frozen=True)
class Setting:
    content: str
    preset: str
    threads: int  # libx264 frame threads per encoder; 0: libx264's own choice (the product's)
    x264_params: str  # extra libx264 options "k=v:k=v"; "": none (the product's)
    segments: int  # encoders, each on a run of consecutive frames
    concurrency: int  # encodes of the video at once

    @property
    def is_product(self) -> bool:
        return self.threads == 0 and not self.x264_params and self.segments == 1


@dataclass(frozen=True)
class Encoding:
    fps: float
    crf: int
    tune: str

    @property
    def rate(self) -> Fraction:
        return Fraction(self.fps).limit_denominator(1001)  # as media/video.py stores it


def write_h264(planes: np.ndarray, dest: Any, enc: Encoding, *, preset: str, threads: int, x264_params: str,
               metadata: dict[str, str], movflags: str) -> None:
    """The product's _write_h264 (media/video.py) with the row's thread count and extra options:
    same container options, stream options, colour tags and frame loop; ``dest`` a path or a
    seekable file object."""
    _, rows, width = planes.shape
    with av.open(dest, mode="w", format="mp4", options={"movflags": movflags} if movflags else {}) as container:
        for key, value in metadata.items():
            container.metadata[key] = value
        stream = container.add_stream("libx264", rate=enc.rate)
        stream.width, stream.height, stream.pix_fmt = width, rows * 2 // 3, "yuv420p"
        options = {"crf": str(enc.crf), "preset": preset, **({} if enc.tune == "none" else {"tune": enc.tune})}
        if x264_params:
            options["x264-params"] = x264_params
        stream.options = options
        ctx = stream.codec_context
        ctx.thread_type, ctx.thread_count = "FRAME", threads or frame_threads(rows * 2 // 3)
        for name, value in COLOUR_TAGS.items():
            setattr(ctx, name, value)
        for i in range(planes.shape[0]):
            frame = av.VideoFrame.from_ndarray(planes[i], format="yuv420p")
            for name, value in COLOUR_TAGS.items():
                setattr(frame, name, value)
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


PRODUCT_MOVFLAGS = "+faststart+use_metadata_tags"


def segment_bounds(frames: int, k: int) -> list[tuple[int, int]]:
    """K runs of consecutive frames, lengths differing by at most one."""
    k = max(1, min(k, frames))
    edges = [round(i * frames / k) for i in range(k + 1)]
    return list(zip(edges[:-1], edges[1:]))


def write_segmented(planes: np.ndarray, path: Path, enc: Encoding, *, preset: str, threads: int, x264_params: str,
                    segments: int) -> dict[str, Any]:
    """Encode K runs of frames at once (one libx264 each, into memory), then copy their packets
    into one mp4 at ``path`` with each run's timestamps shifted by its first frame's time.

    Every run is encoded with the same settings, so their decoder configurations (SPS/PPS) are the
    same bytes and the first run's serves the whole stream; this is checked, since a run with other
    headers would decode wrongly behind it."""
    bounds = segment_bounds(planes.shape[0], segments)
    per_encoder = threads or max(1, frame_threads(planes.shape[1] * 2 // 3) // len(bounds))
    buffers = [io.BytesIO() for _ in bounds]

    def encode_run(i: int) -> float:
        t0 = time.perf_counter()
        start, stop = bounds[i]
        write_h264(planes[start:stop], buffers[i], enc, preset=preset, threads=per_encoder,
                   x264_params=x264_params, metadata={}, movflags="")
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(bounds), thread_name_prefix="segment") as pool:
        run_s = list(pool.map(encode_run, range(len(bounds))))
    t_runs = time.perf_counter() - t0
    inputs = []
    try:
        for buf in buffers:
            buf.seek(0)
            inputs.append(av.open(buf, mode="r", format="mp4"))
        first = inputs[0].streams.video[0]
        for i, inp in enumerate(inputs[1:], 1):
            if inp.streams.video[0].codec_context.extradata != first.codec_context.extradata:
                raise RuntimeError(f"segment {i} has other SPS/PPS than segment 0; cannot join them into one stream")
        with av.open(str(path), mode="w", format="mp4", options={"movflags": PRODUCT_MOVFLAGS}) as out:
            for key, value in METADATA.items():
                out.metadata[key] = value
            dst = out.add_stream_from_template(first)
            for inp, (start, _) in zip(inputs, bounds):
                src = inp.streams.video[0]
                shift = Fraction(start) / enc.rate / src.time_base
                if shift.denominator != 1:
                    raise RuntimeError(f"frame {start} does not fall on a tick of time base {src.time_base}")
                for packet in inp.demux(src):
                    if packet.dts is None:  # the demuxer's empty end-of-stream packet
                        continue
                    packet.pts += int(shift)
                    packet.dts += int(shift)
                    packet.stream = dst
                    out.mux(packet)
    finally:
        for inp in inputs:
            inp.close()
    return {"segment_frames": [b - a for a, b in bounds], "segment_threads": per_encoder,
            "segment_encode_s": [round(s, 3) for s in run_s], "segments_all_done_s": round(t_runs, 3),
            "join_s": round(time.perf_counter() - t0 - t_runs, 3)}


def encode_once(planes: np.ndarray, path: Path, s: Setting, enc: Encoding) -> dict[str, Any]:
    """One encode of the row, timed: the product's call, or the bench writer + fsync + probe_mp4."""
    res: dict[str, Any] = {"tid": threading.get_native_id()}
    res["t_start"] = t0 = time.perf_counter()
    if s.is_product:
        encode_s = encode_mp4(Yuv420Video(planes), path, fps=enc.fps, crf=enc.crf, preset=s.preset,
                              tune=enc.tune, metadata=METADATA)
        res["t_encoded"] = t0 + encode_s
    else:
        if s.segments > 1:
            res.update(write_segmented(planes, path, enc, preset=s.preset, threads=s.threads,
                                       x264_params=s.x264_params, segments=s.segments))
        else:
            write_h264(planes, str(path), enc, preset=s.preset, threads=s.threads, x264_params=s.x264_params,
                       metadata=METADATA, movflags=PRODUCT_MOVFLAGS)
        res["t_encoded"] = time.perf_counter()
        encode_s = res["t_encoded"] - t0
        fsync_file(path)
        info = probe_mp4(path)
        f, rows, w = planes.shape
        if (info.frames, info.width, info.height) != (f, w, rows * 2 // 3):
            raise RuntimeError(f"{path.name} decodes to {info.frames} frames of {info.width}x{info.height}, "
                               f"expected {f} of {w}x{rows * 2 // 3}")
    res["t_end"] = t_end = time.perf_counter()
    res.update(encode_s=round(encode_s, 3), check_s=round(t_end - t0 - encode_s, 3), bytes=path.stat().st_size)
    return res


# ------------------------------------------------------------------------- what the encode ran on

class ThreadCpu:
    """CPU seconds of every thread of this process, sampled from /proc/self/task on a side thread.

    libx264 starts its threads when the encoder opens and joins them when it closes, inside one
    encode call, so they can only be seen while they run; a thread that ends between two samples
    loses at most one interval of its CPU time."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.tick = os.sysconf("SC_CLK_TCK")
        self.samples: dict[int, list[tuple[float, float]]] = {}  # tid -> [(time, cpu s)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="thread-cpu", daemon=True)

    def _sample(self) -> None:
        now = time.perf_counter()
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:  # ended since the listing
                continue
            self.samples.setdefault(int(tid), []).append((now, (int(fields[11]) + int(fields[12])) / self.tick))

    def _run(self) -> None:
        me = threading.get_native_id()
        while not self._stop.is_set():
            self._sample()
            self.samples.pop(me, None)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "ThreadCpu":
        self._sample()  # baseline of the threads already there
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_between(self, t0: float, t1: float) -> dict[int, float]:
        """Per thread: CPU seconds spent between t0 and t1 (as far as the samples show)."""
        out = {}
        for tid, series in self.samples.items():
            before = [c for t, c in series if t <= t0]
            upto = [c for t, c in series if t <= t1]
            if upto:
                spent = upto[-1] - (before[-1] if before else 0.0)
                if spent > 0:
                    out[tid] = spent
        return out


# ------------------------------------------------------------------------------------ the output

def inspect_output(path: Path, planes: np.ndarray, rate: Fraction) -> dict[str, Any]:
    """Decode ``path`` (not timed): PSNR per plane against ``planes``, the frame count and that
    frame i is shown at i / fps, the frame types, key frames, and libx264's options string."""
    f, rows, w = planes.shape
    h = rows * 2 // 3
    y_n, c_n = h * w, h * w // 4
    sse = np.zeros(3)
    types: dict[str, int] = {}
    bad_times = []
    n = 0
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        first = next(container.demux(stream))
        keyframes = 1 if first.is_keyframe else 0
        keyframes += sum(1 for p in container.demux(stream) if p.is_keyframe and p.dts is not None)
        options = _x264_options(bytes(first))
        colour = {}
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        tb = stream.time_base
        for frame in container.decode(stream):
            if n >= f:
                n += 1
                continue
            if frame.pts is None or frame.pts * tb != Fraction(n) / rate:
                bad_times.append((n, None if frame.pts is None else str(frame.pts * tb)))
            got = frame.to_ndarray().reshape(-1).astype(np.int32)
            ref = planes[n].reshape(-1).astype(np.int32)
            d = got - ref
            sse[0] += float(np.dot(d[:y_n], d[:y_n]))
            sse[1] += float(np.dot(d[y_n:y_n + c_n], d[y_n:y_n + c_n]))
            sse[2] += float(np.dot(d[y_n + c_n:], d[y_n + c_n:]))
            kind = _PICT_TYPES.get(int(frame.pict_type), str(int(frame.pict_type)))
            types[kind] = types.get(kind, 0) + 1
            if n == 0:
                colour = {"colorspace": int(frame.colorspace), "color_range": int(frame.color_range)}
            n += 1
    psnr = [None if e == 0 else round(10 * np.log10(255.0**2 * cnt * f / e), 3)
            for e, cnt in zip(sse, (y_n, c_n, c_n))]
    return {"decoded_frames": n, "frames_ok": n == f, "timestamps_ok": not bad_times and n == f,
            "bad_timestamps": bad_times[:5], "psnr_y": psnr[0], "psnr_u": psnr[1], "psnr_v": psnr[2],
            "frame_types": types, "keyframes": keyframes, "colour": colour, "x264": options}


_PICT_TYPES = {1: "I", 2: "P", 3: "B"}  # FFmpeg's AVPictureType


def _x264_options(first_packet: bytes) -> dict[str, Any]:
    """libx264 writes its version and every option into an SEI of the first frame."""
    m = re.search(rb"x264 - core (\d+)[^\x00]*?options: ([^\x00\x80]*)", first_packet)
    if not m:
        return {}
    opts = dict(kv.split("=", 1) for kv in m.group(2).decode("ascii", "replace").split() if "=" in kv)
    keep = ("threads", "lookahead_threads", "sliced_threads", "rc_lookahead", "bframes", "b_adapt", "mbtree",
            "subme", "me", "ref", "trellis", "keyint", "scenecut", "crf")
    return {"core": int(m.group(1)), **{k: opts[k] for k in keep if k in opts}}


# ------------------------------------------------------------------------------------------ rows

def run_row(planes: np.ndarray, s: Setting, enc: Encoding, tmp: Path, rep: int) -> dict[str, Any]:
    paths = [tmp / f"{s.content}-{s.preset}-{i}.mp4" for i in range(s.concurrency)]
    barrier = threading.Barrier(s.concurrency)

    def one(i: int) -> dict[str, Any]:
        barrier.wait()  # all C encodes start together
        return encode_once(planes, paths[i], s, enc)

    r0 = resource.getrusage(resource.RUSAGE_SELF)
    with ThreadCpu() as monitor, ThreadPoolExecutor(s.concurrency, thread_name_prefix="encode") as pool:
        encodes = list(pool.map(one, range(s.concurrency)))
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = min(e["t_start"] for e in encodes)
    wall = max(e["t_end"] for e in encodes) - t0
    frames = planes.shape[0]
    row: dict[str, Any] = {
        **asdict(s), "rep": rep, "frames": frames, "height": planes.shape[1] * 2 // 3, "width": planes.shape[2],
        "writer": "encode_mp4" if s.is_product else "bench",
        "encode_s": round(float(np.mean([e["encode_s"] for e in encodes])), 3),
        "check_s": round(float(np.mean([e["check_s"] for e in encodes])), 3),
        "wall_s": round(wall, 3),
        "fps": round(frames / float(np.mean([e["encode_s"] for e in encodes])), 1),
        "videos_per_min": round(s.concurrency * 60 / wall, 2),
        "bytes": encodes[0]["bytes"],
        "process_cpu_s": round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 2),
        "encodes": [{k: v for k, v in e.items() if k not in ("t_start", "t_encoded", "t_end")} for e in encodes],
    }
    if s.concurrency == 1:  # the encode's own threads; with two at once they cannot be told apart
        e = encodes[0]
        per_thread = monitor.cpu_between(e["t_start"], e["t_encoded"])
        busy = sorted(per_thread.values(), reverse=True)
        row["encode_cpu_s"] = round(sum(busy), 2)
        row["encode_cores_busy"] = round(sum(busy) / max(e["encode_s"], 1e-9), 2)
        row["busiest_threads_cpu_s"] = [round(c, 2) for c in busy[:6]]
        row["caller_thread_cpu_s"] = round(per_thread.get(e["tid"], 0.0), 2)
        row["threads_seen"] = sum(1 for c in busy if c >= 0.02)
    row.update(inspect_output(paths[0], planes, enc.rate))
    if len({e["bytes"] for e in encodes}) > 1:
        row["note"] = "the concurrent encodes gave files of different sizes"
    for p in paths:
        p.unlink(missing_ok=True)
    return row


def check_writer(planes: np.ndarray, preset: str, enc: Encoding, tmp: Path) -> dict[str, Any]:
    """The bench writer at the product's settings gives encode_mp4's bitstream byte for byte
    (libx264 is deterministic with frame threads), so rows through it differ only by their changes."""
    a, b = tmp / "product.mp4", tmp / "bench.mp4"
    encode_mp4(Yuv420Video(planes), a, fps=enc.fps, crf=enc.crf, preset=preset, tune=enc.tune, metadata=METADATA)
    write_h264(planes, str(b), enc, preset=preset, threads=0, x264_params="", metadata=METADATA,
               movflags=PRODUCT_MOVFLAGS)

    def packets(path: Path) -> list[bytes]:
        with av.open(str(path)) as c:
            return [bytes(p) for p in c.demux(video=0) if p.dts is not None]

    same = packets(a) == packets(b)
    res = {"preset": preset, "same_packets": same, "bytes": [a.stat().st_size, b.stat().st_size]}
    a.unlink()
    b.unlink()
    return res


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'content':8} {'preset':9} {'thr':>3} {'K':>2} {'C':>2} {'x264-params':18} {'encode':>7} {'check':>6} "
            f"{'wall':>7} {'fps':>6} {'MB':>7} {'PSNR Y':>7} {'U':>6} {'V':>6} {'cores':>5} {'busiest':>7} "
            f"{'x264 thr':>8} types")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['content']:8} {r['preset']:9} {r['threads']:>3} {r['segments']:>2} {r['concurrency']:>2} "
                         f"{r['x264_params'] or '-':18} ERROR {r['error']}")
            continue
        x = r.get("x264", {})
        busiest = r.get("busiest_threads_cpu_s") or [None]
        lines.append(
            f"{r['content']:8} {r['preset']:9} {r['threads']:>3} {r['segments']:>2} {r['concurrency']:>2} "
            f"{r['x264_params'] or '-':18} {r['encode_s']:7.2f} {r['check_s']:6.2f} {r['wall_s']:7.2f} {r['fps']:6.1f} "
            f"{r['bytes'] / 1e6:7.2f} {_f(r['psnr_y'])} {_f(r['psnr_u'], 6)} {_f(r['psnr_v'], 6)} "
            f"{_f(r.get('encode_cores_busy'), 5, 1)} {_f(busiest[0], 7)} "
            f"{x.get('threads', '?') + '/' + x.get('lookahead_threads', '?'):>8} "
            + " ".join(f"{k}{v}" for k, v in sorted(r["frame_types"].items()))
            + ("" if r["timestamps_ok"] else "  TIMESTAMPS WRONG"))
    return "\n".join(lines)


def _f(v: Any, width: int = 7, digits: int = 2) -> str:
    return f"{v:{width}.{digits}f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for bench_encode.json")
    p.add_argument("--frames", type=int, default=121)
    p.add_argument("--height", type=int, default=704)
    p.add_argument("--width", type=int, default=1248)
    p.add_argument("--fps", type=float, default=24.0)
    p.add_argument("--crf", type=int, default=18)
    p.add_argument("--tune", default="none", choices=X264_TUNES)
    p.add_argument("--contents", nargs="+", default=list(CONTENTS), choices=CONTENTS)
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    p.add_argument("--threads", nargs="+", type=int, default=[0],
                   help="libx264 frame threads per encoder; 0: the product's, frame_threads of the height "
                        "(default)")
    p.add_argument("--x264-params", nargs="+", default=[""], dest="x264_params",
                   help='extra libx264 options per variant, "k=v:k=v"; "" for none (default)')
    p.add_argument("--segments", nargs="+", type=int, default=[1], help="encoders per video, on consecutive runs")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 2], help="encodes at once")
    p.add_argument("--reps", type=int, default=1, help="times each row runs (each rep is a row of the JSON)")
    p.add_argument("--check-writer", action="store_true",
                   help="first check that the bench writer gives encode_mp4's bitstream at the product settings")
    args = p.parse_args()
    if args.height % 2 or args.width % 2:
        p.error("yuv420p needs an even height and width")

    args.out.mkdir(parents=True, exist_ok=True)
    enc = Encoding(fps=args.fps, crf=args.crf, tune=args.tune)
    env = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cores": cores(),
           "cpu": _cpu_model(), "python": platform.python_version(), "av": av.__version__,
           "ffmpeg": av.ffmpeg_version_info, "numpy": np.__version__, "torch": torch.__version__,
           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    doc: dict[str, Any] = {"env": env, "rows": []}
    out_json = args.out / "bench_encode.json"
    print(f"{args.width}x{args.height}x{args.frames} at {args.fps:g} fps, crf {args.crf}, {cores()} cores", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-encode-") as tmp_name:
        tmp = Path(tmp_name)
        # libx264's and the muxer's first use in the process (loading, allocator warm-up) is not
        # a cost every encode pays.
        encode_mp4(Yuv420Video(make_planes("noise", 5, 64, 64)), tmp / "warm.mp4", fps=enc.fps, crf=enc.crf)
        for content in args.contents:
            t0 = time.perf_counter()
            planes = make_planes(content, args.frames, args.height, args.width)
            print(f"{content}: made in {time.perf_counter() - t0:.1f} s", flush=True)
            if args.check_writer and content == args.contents[0]:
                preset = DEFAULT_X264_PRESET if DEFAULT_X264_PRESET in args.presets else args.presets[0]
                doc["check_writer"] = check_writer(planes, preset, enc, tmp)
                print("check-writer:", json.dumps(doc["check_writer"]), flush=True)
            for preset in args.presets:
                for threads in args.threads:
                    for params in args.x264_params:
                        for segments in args.segments:
                            for conc in args.concurrency:
                                s = Setting(content, preset, threads, params, segments, conc)
                                for rep in range(args.reps):
                                    try:
                                        row = run_row(planes, s, enc, tmp, rep)
                                    except Exception as exc:  # one failing variant keeps the others' figures
                                        row = {**asdict(s), "rep": rep, "error": f"{type(exc).__name__}: {exc}"}
                                    doc["rows"].append(row)
                                    print(json.dumps(row), flush=True)
                                    out_json.write_text(json.dumps(doc, indent=1))
            del planes
    print()
    print(table(doc["rows"]))
    print(f"\n(encode/check/wall s: per encode, means over the C at once; wall: first start to last end; fps: frames "
          f"per encode second; cores: encode CPU s / encode s; busiest: CPU s of the busiest thread; x264 thr: "
          f"frame/lookahead threads libx264 used)\nwritten {out_json}")
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
