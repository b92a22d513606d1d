"""A live preview's file: the WebP strip the worker encodes, with its note in a chunk of its own,
still decodes as the picture it was (PyAV's libwebp, Pillow), says what it shows, and is read only
as a regular file (never through a link, never waiting on a FIFO)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import av
import numpy as np
import pytest

from pan2render.media.video import webp_strip
from pan2render.preview_file import NOTE_CHUNK, PreviewNote, read_note, read_preview, with_note

NOTE = PreviewNote(step=12, total_steps=30, frames=(0, 10, 20, 30), map="published: test", at=1.5e9)


def _tiles() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    gradient = np.linspace(0, 255, 78, dtype=np.float32)[None, :, None] * np.ones((44, 1, 3), np.float32)
    return [np.clip(gradient + rng.normal(0, 8, gradient.shape), 0, 255).astype(np.uint8) for _ in range(4)]


def _decoded(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return next(container.decode(video=0)).to_ndarray(format="rgb24")


def test_a_strip_with_its_note_decodes_as_the_picture_and_says_what_it_shows() -> None:
    strip = webp_strip(_tiles(), height=88)
    data = with_note(strip, NOTE)
    assert data[:4] == b"RIFF" and data[8:16] == b"WEBPVP8X" and NOTE_CHUNK in data
    assert read_note(data) == NOTE and read_note(strip) is None
    picture = _decoded(data)
    assert picture.shape == (88, 4 * 156, 3)  # each 44 x 78 tile at twice its size, side by side
    assert np.array_equal(picture, _decoded(strip))  # the note changes nothing of the picture
    from PIL import Image  # another reader: skips the chunk it does not know

    with Image.open(io.BytesIO(data)) as im:
        by_pillow = np.asarray(im.convert("RGB"), dtype=np.float64)
    assert by_pillow.shape == picture.shape and np.abs(by_pillow - picture).mean() < 3  # (its own YUV -> RGB)
    # The left of each tile is dark, the right bright: the picture, not noise.
    assert picture[:, 10].mean() < 60 and picture[:, 150].mean() > 190
    again = with_note(data, PreviewNote(**{**NOTE.__dict__, "step": 13}))  # a note replaced, not added
    assert read_note(again).step == 13 and again.count(NOTE_CHUNK) == 1


def test_a_preview_is_read_only_as_a_regular_file(tmp_path: Path) -> None:
    data = with_note(webp_strip(_tiles(), height=88), NOTE)
    (tmp_path / "preview.webp").write_bytes(data)
    assert read_preview(tmp_path / "preview.webp") == NOTE
    (tmp_path / "elsewhere.webp").write_bytes(data)
    os.symlink(tmp_path / "elsewhere.webp", tmp_path / "link.webp")
    os.mkfifo(tmp_path / "fifo.webp")
    (tmp_path / "junk.webp").write_bytes(b"RIFF\x04\x00\x00\x00WEBP" + b"\xff" * 40)
    for name in ("link.webp", "fifo.webp", "junk.webp", "absent.webp"):
        assert read_preview(tmp_path / name) is None, name  # (the FIFO: at once, no writer waited for)


def test_with_note_refuses_what_is_not_a_lossy_webp() -> None:
    with pytest.raises(ValueError, match="not a WebP file"):
        with_note(b"\x89PNG\r\n\x1a\n", NOTE)
