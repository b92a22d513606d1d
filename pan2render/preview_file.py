"""A live preview's file, ``DIR/<job>/preview.webp``: a lossy WebP strip of a few of a running
sampling's predicted frames, and a note of what it shows (the step, the latent frames, where its
latent -> RGB map comes from, when it was made) in a chunk of its own inside the file, so that the
picture and what it says are replaced together, by one rename.

WebP's extended format (a ``VP8X`` chunk first) lets a file carry chunks a reader does not know,
which readers skip: the note rides in one (``P2PV``). torch- and PyAV-free: ``status``, ``show`` and
the report read the note; the worker adds it to the strip it encoded (`with_note`).
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREVIEW_NAME = "preview.webp"
NOTE_CHUNK = b"P2PV"
MAX_PREVIEW_BYTES = 4 << 20  # a strip is tens of KB; a file past this is not ours


@dataclass(frozen=True)
class PreviewNote:
    """What a preview shows."""

    step: int  # the sampling's steps done when x0 was predicted
    total_steps: int
    frames: tuple[int, ...]  # the latent frames in the strip, left to right
    map: str  # where the latent -> RGB map's numbers come from
    at: float  # when the worker took it (time.time())

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "steps": self.total_steps, "frames": list(self.frames), "map": self.map,
                "at": self.at}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PreviewNote:
        return cls(step=int(doc["step"]), total_steps=int(doc["steps"]), frames=tuple(int(f) for f in doc["frames"]),
                   map=str(doc["map"]), at=float(doc["at"]))


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """A WebP file's chunks (fourcc, payload); ValueError for anything else."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        raise ValueError("not a WebP file")
    size = struct.unpack_from("<I", data, 4)[0]
    end, at, chunks = min(len(data), 8 + size), 12, []
    while at + 8 <= end:
        kind, length = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        if at + 8 + length > end:
            raise ValueError(f"chunk {kind!r} runs past the end of the file")
        chunks.append((kind, data[at + 8:at + 8 + length]))
        at += 8 + length + (length & 1)  # chunks are padded to an even size
    return chunks


def _canvas(chunks: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    """Width and height of a lossy WebP's ``VP8 `` bitstream (its key frame header)."""
    payload = next((p for kind, p in chunks if kind == b"VP8 "), b"")
    if len(payload) < 10 or payload[3:6] != b"\x9d\x01\x2a":
        raise ValueError("no lossy VP8 image in the file")
    width, height = struct.unpack_from("<HH", payload, 6)
    return width & 0x3FFF, height & 0x3FFF


def _riff(chunks: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(kind + struct.pack("<I", len(p)) + p + b"\0" * (len(p) & 1) for kind, p in chunks)
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body


def with_note(webp: bytes, note: PreviewNote) -> bytes:
    """A lossy WebP file (simple format, as libwebp writes it) in the extended format, ``note`` in
    its own chunk after the image."""
    chunks = [c for c in _chunks(webp) if c[0] != NOTE_CHUNK]
    if chunks[0][0] != b"VP8X":
        width, height = _canvas(chunks)
        # VP8X: flags (none: no ICC, alpha, EXIF, XMP or animation), 3 reserved bytes, then the
        # canvas width - 1 and height - 1 as 24-bit little-endian numbers.
        vp8x = bytes(4) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
        chunks.insert(0, (b"VP8X", vp8x))
    return _riff([*chunks, (NOTE_CHUNK, json.dumps(note.to_json()).encode())])


def read_note(data: bytes) -> PreviewNote | None:
    """The note of a preview file's bytes; None for a file without one or not a WebP file."""
    try:
        payload = next((p for kind, p in _chunks(data) if kind == NOTE_CHUNK), None)
        return None if payload is None else PreviewNote.from_json(json.loads(payload))
    except (ValueError, KeyError, TypeError):  # (json's errors are ValueErrors)
        return None


def read_preview(path: Path) -> PreviewNote | None:
    """The note of the preview at ``path``: a regular file opened without following a link and
    without waiting on a FIFO; None when there is none there or it is not a preview."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # absent, a link, unreadable
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_PREVIEW_BYTES:
            return None
        return read_note(f.read())
