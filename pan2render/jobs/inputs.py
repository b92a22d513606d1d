"""What a batch may ask for, and reading the files it names without trusting them.

A batch file comes from a user, a script or a colleague's folder: it may be hostile or just wrong.
Everything here fails in milliseconds with a message saying what is allowed, never by running a
worker out of memory hours later:

- :class:`InputLimits` bounds one job's cost (frames x height x width as DiT tokens, steps), a first
  frame's pixels, the files' sizes, YAML alias expansion and the number of jobs.
- :func:`read_regular_file` (and :func:`sha256_regular_file`) is how every file a batch names is
  read: only if it is a regular file under a size limit (a FIFO would block forever, ``/dev/zero``
  never ends, a folder is not a file), and never longer than :data:`READ_STALL_S` without a byte.
- :func:`control_chars` finds NUL and other control characters, which no path or prompt needs;
  :func:`bidi_controls` the bidirectional controls, which make a name show as another.
- :func:`image_size` reads a PNG, JPEG or WebP header for its pixel size without decoding it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import stat
import struct
import threading
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pan2render.sampling import WAN22


@dataclass(frozen=True)
class InputLimits:
    """Bounds on one batch. Each is far above any real use and far below what breaks a worker."""

    # The DiT attends over every token of a video at once and the VAE decodes every pixel, so the
    # token count bounds both. 1080p (1088x1920) x 241 frames is 124,440 tokens; the 720p presets
    # are 26,598.
    dit_tokens: int = 131_072
    # libx264 refuses frames wider or taller than this (H.264's largest levels stop near 8K).
    side: int = 4096
    # Flow-matching schedules are defined on 1000 training timesteps: more steps repeat timesteps.
    steps: int = 1000
    # Far above any use (Wan2.2 guides at 5, flow shifts stay under 20), far below where a step's
    # arithmetic leaves float32's range (1e300 made non-finite latents).
    guidance: float = 100.0
    flow_shift: float = 100.0
    # A first frame is decoded to RGB in the worker (3 bytes a pixel) before it is resized.
    image_pixels: int = 4096 * 4096
    image_bytes: int = 64 << 20
    batch_bytes: int = 4 << 20
    # A LoRA travels to every worker that renders with it; a rank-128 adapter of every linear of the
    # 5B DiT in fp32 is ~1.3 GB.
    lora_bytes: int = 4 << 30
    loras: int = 8  # adapters stacked on one job
    # A job's chained segments (each a whole sampling), and what its worker then holds at once: the
    # joined, interpolated video's frames, uint8 RGB on the device for colour matching and
    # interpolation (and half that as yuv420p on its host for the encode). 16 GiB is 6,000 frames
    # at 704x1248 (16 segments of 121 frames, twice interpolated, is 3,841).
    segments: int = 32
    video_bytes: int = 16 << 30
    lora_scale: float = 100.0  # |scale| of one adapter (ComfyUI's LoraLoader range)
    prompts_file_bytes: int = 16 << 20
    interpolation_weights_bytes: int = 1 << 30  # RIFE's IFNet weighs ~20 MB in fp32
    model_config_bytes: int = 1 << 20  # a model's config.json, read to check LoRAs against (a DiT's is ~1 KB)
    # YAML aliases share nodes; expanded, a few lines can stand for billions of values.
    yaml_aliases: int = 1000
    yaml_values: int = 100_000
    jobs: int = 20_000
    # The text encoder reads 512 tokens (about 2,000 characters of English) and cuts the rest; a
    # longer prompt only grows the ledger, params.json, the report and the mp4 tags of every job.
    text_chars: int = 4096
    name_chars: int = 200  # a job id keeps the first 80 characters of its name
    path_chars: int = 4096  # PATH_MAX on Linux
    # Levels of lists and mappings inside one another (a batch needs 4); the YAML and JSON readers
    # recurse once per level.
    nesting: int = 64


LIMITS = InputLimits()


def dit_tokens(*, frames: int, height: int, width: int) -> int:
    """DiT sequence length of a video (the VAE's compression, then the DiT's patches)."""
    return WAN22.tokens(frames=frames, height=height, width=width)


class InputFileError(Exception):
    """A named file is not something we may read; the message says what it is instead."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


# How long a read of a file a batch names may go without a byte before it is refused. A disk answers
# in milliseconds and a busy network filesystem in seconds; one whose server is gone (a `hard` NFS
# mount) blocks the reading thread for good, and nothing can interrupt it.
READ_STALL_S = 30.0
_CHUNK = 1 << 20  # bytes per read
T = TypeVar("T")


def read_regular_file(path: str | Path, *, limit: int, first: int | None = None) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes (with ``first``,
    only its first ``first`` bytes, fewer where it is shorter).

    Every read of a file a batch names goes through here or :func:`sha256_regular_file`: the batch
    file, presets and prompts files, images, LoRAs and the model's config, at validation and when
    the driver sends a job's image and adapters to its workers. Raises InputFileError (or
    FileNotFoundError / PermissionError / OSError): see :func:`_read` for what is refused."""
    chunks: list[bytes] = []
    _read(Path(path), limit=limit, first=first, sink=chunks.append)
    return b"".join(chunks)


def sha256_regular_file(path: str | Path, *, limit: int) -> str:
    """The sha256 (hex) of ``path`` under :func:`read_regular_file`'s rules, without holding it."""
    digest = hashlib.sha256()
    _read(Path(path), limit=limit, first=None, sink=digest.update)
    return digest.hexdigest()


def _read(path: Path, *, limit: int, first: int | None, sink: Callable[[bytes], object]) -> None:
    """Feed ``sink`` the file's bytes, on a thread given up after READ_STALL_S without one.

    Refused, each with InputFileError saying what the file is instead: anything but a regular file
    (a FIFO would block until a writer comes, ``/dev/zero`` never ends, a folder is not a file), a
    file over ``limit`` bytes (checked on the open descriptor; the read stops at ``limit`` + 1 bytes
    whatever the file does meanwhile), /proc and /sys files (regular by their mode but made up as
    they are read: ``/proc/self/environ`` is the process environment; refused by their filesystem,
    and by holding more than their size says), and a read that stalls (:data:`READ_STALL_S`).

    A symlink is followed, as a path through it is: the paths a batch names are resolved at
    validation, and a link reaches nothing its target's path would not. The kind is checked on the
    path before it is opened (opening a device can act: a tape rewinds, a watchdog arms) and again on
    what was opened, non-blocking (the path may have been swapped for a FIFO in between)."""

    def read(progress: Callable[[], None]) -> None:
        _check(os.stat(path), limit)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            _check(st, limit)
            want = limit + 1 if first is None else min(first, limit + 1)
            total = 0
            while total < want:
                block = os.read(fd, min(want - total, _CHUNK))
                progress()
                if not block:
                    break
                sink(block)
                total += len(block)
        finally:
            os.close(fd)
        if first is None and total > limit:
            raise InputFileError(f"grew past {limit:,} bytes while being read; allowed: at most {limit:,} bytes")
        if first is None and total > st.st_size:
            raise InputFileError(_PSEUDO)

    stall_bounded(read)


def _check(st: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(f"is {_kind(st.st_mode)}; allowed: a regular file")
    if st.st_dev in _pseudo_filesystems():
        raise InputFileError(_PSEUDO)
    if st.st_size > limit:
        raise InputFileError(f"is {st.st_size:,} bytes; allowed: at most {limit:,} bytes")


def stall_bounded(work: Callable[[Callable[[], None]], T], *, stall_s: float = READ_STALL_S) -> T:
    """``work(progress)`` run on a thread of its own: its result (or what it raised), or
    InputFileError once ``stall_s`` pass without ``work`` calling ``progress``. A thread stuck in a
    read cannot be stopped: it is left behind (a daemon, which does not hold up the process's exit),
    holding its file open until the read returns, if ever."""
    last = [time.monotonic()]
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, work(lambda: last.__setitem__(0, time.monotonic()))))
        except BaseException as exc:  # raised again in the caller
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="pan2-render input read", daemon=True).start()
    while not done.wait(max(0.0, last[0] + stall_s - time.monotonic())):
        if time.monotonic() - last[0] >= stall_s:
            raise InputFileError(f"gave no data for {stall_s:g} s (a network filesystem that does not answer?); "
                                 "allowed: a file that can be read")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


_PSEUDO = ("is a file the kernel makes up as it is read (its size is not its content: a /proc or /sys "
           "file); allowed: a regular file")


@functools.cache
def _pseudo_filesystems() -> frozenset[int]:
    """Device numbers of /proc and /sys, where they are mounted."""
    devices = set()
    for root in ("/proc", "/sys"):
        try:
            devices.add(os.stat(root).st_dev)
        except OSError:
            continue
    return frozenset(devices)


# C0 controls and DEL, except tab, line feed and carriage return (line structure, not content).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_CONTROL_OR_NEWLINE = re.compile(r"[\x00-\x1f\x7f]")


def control_chars(text: str, *, newlines: bool) -> list[tuple[int, str]]:
    """(index, character) of each control character in ``text``; tab/LF/CR pass if ``newlines``."""
    pattern = _CONTROL if newlines else _CONTROL_OR_NEWLINE
    return [(m.start(), m.group()) for m in pattern.finditer(text)]


# Unicode's bidirectional formatting characters (UAX #9): the marks (U+061C, U+200E, U+200F), the
# embeddings and overrides (U+202A..U+202E) and the isolates (U+2066..U+2069). Unseen themselves,
# they reorder the text around them wherever it is shown: a job named U+202E + "gnp.exe" shows as
# "exe.png" in the monitor, the report and a terminal. No name, prompt or path needs one.
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
BIDI_CONTROLS = "U+061C, U+200E, U+200F, U+202A..U+202E, U+2066..U+2069"


def bidi_controls(text: str) -> list[tuple[int, str]]:
    """(index, character) of each bidirectional control in ``text`` (:data:`BIDI_CONTROLS`)."""
    return [(m.start(), m.group()) for m in _BIDI.finditer(text)]


def escape_bidi(text: str) -> str:
    """``text`` with each bidirectional control written as its ``\\uXXXX`` escape, to be shown."""
    return _BIDI.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def join_surrogate_pairs(text: str) -> str:
    """``text`` with each high+low surrogate pair made the one character it stands for (YAML reads
    the escapes ``\\ud83e\\udd8a`` as two code points, JSON as one); lone halves are left as they are."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    except UnicodeDecodeError:  # a lone half: nothing to join it with
        return text


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone UTF-16 surrogate in ``text`` (not encodable as UTF-8, so it fails
    wherever the text is written: the ledger, params.json, the mp4 tags, the report), or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def nesting_depth(value: object) -> int:
    """Levels of lists and dicts in ``value`` (a scalar is 0), counted without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        else:
            continue
        deepest = max(deepest, depth + 1)
    return deepest


def describe_char(c: str) -> str:
    """``U+202E (RIGHT-TO-LEFT OVERRIDE)``: the code point, and its name where it has one."""
    names = {"\x00": "NUL", "\t": "tab", "\n": "line feed", "\r": "carriage return", "\x7f": "DEL"}
    name = names.get(c) or unicodedata.name(c, "")
    return f"U+{ord(c):04X}" + (f" ({name})" if name else "")


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG, JPEG or WebP header, without decoding. Raises InputFileError."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) >= 24 and data[12:16] == b"IHDR":
        return struct.unpack(">II", data[16:24])
    if data.startswith(b"\xff\xd8"):
        return _jpeg_size(data)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP" and len(data) >= 30:
        chunk = data[12:16]
        if chunk == b"VP8X":
            w = int.from_bytes(data[24:27], "little") + 1
            h = int.from_bytes(data[27:30], "little") + 1
            return w, h
        if chunk == b"VP8L":
            bits = int.from_bytes(data[21:25], "little")
            return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
        if chunk == b"VP8 ":
            w, h = struct.unpack("<HH", data[26:30])
            return w & 0x3FFF, h & 0x3FFF
    raise InputFileError("is not a PNG, JPEG or WebP image (its header is not one of theirs)")


def _jpeg_size(data: bytes) -> tuple[int, int]:
    # Segments after SOI: FF <marker> <length:2> <payload>; the frame header (SOF0..SOF15 except
    # DHT C4, JPG C8, DAC CC) holds precision:1, height:2, width:2.
    i = 2
    while i + 9 <= len(data):
        if data[i] != 0xFF:
            break
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            h, w = struct.unpack(">HH", data[i + 5:i + 9])
            return w, h
        i += 2 + length
    raise InputFileError("is a JPEG without a readable frame header (truncated or corrupt)")
