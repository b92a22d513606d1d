"""Hostile or broken batch files: each is refused in milliseconds with exit 2, file:line, the field
and what is allowed, never a traceback, a hang or a worker run out of memory."""

from __future__ import annotations

import os
import struct
import textwrap
import time
import zlib
from pathlib import Path

import pytest

from pan2render.jobs.inputs import LIMITS
from pan2render.runner import cli

pytestmark = pytest.mark.timeout(20)

HEADER = "model: tiny\npreset: tiny-preview\n"

# Nine levels of nine aliases each: 9**9 (~387 million) strings once expanded.
BOMB = textwrap.dedent("""\
    a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
    i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
    """)


def _run(tmp_path: Path, text: str | bytes, capsys: pytest.CaptureFixture[str]) -> str:
    """`validate` and `run` both refuse the batch with exit 2, write nothing; returns stderr."""
    batch = tmp_path / "batch.yaml"
    batch.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "out"
    t0 = time.perf_counter()
    assert cli.main(["validate", str(batch)]) == 2
    assert cli.main(["run", str(batch), "--out", str(out)]) == 2
    seconds = time.perf_counter() - t0
    err = capsys.readouterr().err
    print(f"({seconds:.3f} s)\n{err}")
    assert "Traceback" not in err and not out.exists()
    return err


@pytest.mark.parametrize("where", ["prompt", "preset", "sweep", "key"])
def test_alias_bomb_is_refused_with_its_line(tmp_path: Path, where: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    use = {"prompt": "jobs:\n  - prompt: *i\n",
           "preset": "model: tiny\npreset: *i\njobs: [a fox]\n",
           "sweep": HEADER + "jobs: [a fox]\nsweep:\n  seed: *i\n",
           "key": HEADER + "jobs: [a fox]\n? *i\n: 1\n"}[where]
    text = BOMB + (use if where != "prompt" else HEADER + use)
    err = _run(tmp_path, text, capsys)
    # The smallest value past the limit is `f` (9**6 values, line 6): that line is named.
    assert f"batch.yaml:6: (yaml): the value written here expands through aliases to more than " \
           f"{LIMITS.yaml_values:,} values" in err


def test_too_many_alias_references(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refs = ", ".join(["*p"] * (LIMITS.yaml_aliases + 1))
    err = _run(tmp_path, HEADER + f"x: &p 1\nl: [{refs}]\njobs: [a fox]\n", capsys)
    # Named at the anchor (line 3): an alias node is the anchored node itself once composed.
    assert "batch.yaml:3: (yaml): more than 1000 alias references" in err


@pytest.mark.parametrize("field", ["image", "model", "prompts_file", "prompt", "name"])
def test_nul_in_a_path_or_text_field(tmp_path: Path, field: str, capsys: pytest.CaptureFixture[str]) -> None:
    value = '"a\\0b.png"'  # a YAML escape: the value holds a real NUL
    if field == "model":
        text = f"model: {value}\npreset: tiny-preview\njobs: [a fox]\n"
        line, label = 1, "model"
    elif field == "prompts_file":
        text = HEADER + f"prompts_file: {value}\n"
        line, label = 3, "prompts_file"
    else:
        other = "" if field == "prompt" else "    prompt: a fox\n"
        text = HEADER + f"jobs:\n  - {field}: {value}\n{other}"
        line, label = 4, f"jobs[0].{field}"
    err = _run(tmp_path, text, capsys)
    assert f"batch.yaml:{line}: {label}: holds the control character U+0000 (NUL)" in err


def test_raw_control_characters_in_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(tmp_path, (HEADER + "jobs:\n  - prompt: a f\x00ox\n  - prompt: ok\x07\n").encode(), capsys)
    assert "batch.yaml:4: (yaml): control character U+0000 (NUL) at column 16" in err
    assert "batch.yaml:5: (yaml): control character U+0007 at column 15" in err


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "folder", "huge"])
def test_prompts_file_must_be_a_bounded_regular_file(tmp_path: Path, kind: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "prompts.txt"
    if kind == "dev-zero":
        target = Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(target)  # nobody ever writes to it: reading it would block forever
    elif kind == "folder":
        target.mkdir()
    else:
        with open(target, "wb") as f:
            f.truncate(LIMITS.prompts_file_bytes + 1)  # sparse: no disk used
    err = _run(tmp_path, HEADER + f"prompts_file: {target}\n", capsys)
    expected = {"dev-zero": "is a device", "fifo": "is a FIFO", "folder": "is a folder",
                "huge": f"is {LIMITS.prompts_file_bytes + 1:,} bytes; allowed: at most"}[kind]
    assert "batch.yaml:3: prompts_file: prompts file" in err and expected in err


def _png_header(width: int, height: int) -> bytes:
    """A PNG signature and IHDR chunk claiming width x height (enough for every header reader)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk


@pytest.mark.parametrize("kind", ["huge-pixels", "fifo", "not-an-image"])
def test_image_must_be_a_small_regular_image_file(tmp_path: Path, kind: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    image = tmp_path / "first.png"
    if kind == "huge-pixels":
        image.write_bytes(_png_header(16000, 16000) + b"\x00" * 100)
    elif kind == "fifo":
        os.mkfifo(image)
    else:
        image.write_bytes(b"GIF89a not what we take")
    err = _run(tmp_path, HEADER + "jobs:\n  - prompt: a fox\n    image: first.png\n", capsys)
    expected = {"huge-pixels": "is 16000x16000 = 256,000,000 pixels (decoding it needs 0.7 GiB)",
                "fifo": "is a FIFO", "not-an-image": "is not a PNG, JPEG or WebP image"}[kind]
    assert "batch.yaml:5: jobs[0].image:" in err and expected in err


@pytest.mark.parametrize("line, fragment", [
    ("steps: 1000000000", "jobs[0].steps: got 1000000000; allowed: an integer from 1 to 1000"),
    ("width: 32768", "jobs[0].width: got 32768; allowed: a positive multiple of 32 (VAE 16x times DiT patch 2) "
                     "up to 4096"),
    ("frames: 481\n    width: 1920\n    height: 1088",
     "frames x height x width: job 'big' asks for 481 frames of 1920x1088 = 246,840 DiT tokens; allowed: at most "
     "131,072 tokens"),
])
def test_job_cost_is_bounded_with_the_reason(tmp_path: Path, line: str, fragment: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(tmp_path, HEADER + f"jobs:\n  - name: big\n    prompt: a fox\n    {line}\n", capsys)
    assert "batch.yaml:" in err and fragment in err


def test_a_sweep_that_expands_past_the_job_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seeds = list(range(200))
    err = _run(tmp_path, HEADER + f"jobs: [a fox]\nsweep:\n  seed: {seeds}\n  crf: {list(range(52))}\n"
                                  f"  fps: {list(range(1, 3))}\n", capsys)
    assert "batch.yaml:4: sweep: the batch expands to 20,800 jobs" in err and "at most 20,000" in err
