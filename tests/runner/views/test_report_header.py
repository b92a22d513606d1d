"""The report says what was run and with what: each batch file (a link to its copy in _batches/)
with its --set / --sweep flags, an empty negative prompt as "" rather than a blank, an unset field
as none, and each job's input image beside its video."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from runner_helpers import write_batch

from pan2render.media.video import png_bytes
from pan2render.runner.cli import main as cli


def test_the_report_shows_the_batch_files_flags_empty_values_and_input_images(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_pipeline: None) -> None:
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")
    image = tmp_path / "harbour.png"
    image.write_bytes(png_bytes(np.full((64, 96, 3), 200, np.uint8)))
    batch = write_batch(tmp_path / "b.yaml", [{"name": "still", "prompt": "a harbour", "image": "harbour.png"},
                                              {"name": "plain", "prompt": "a field"}],
                        defaults={"steps": 2, "negative_prompt": ""})
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress", "--set", "crf=20"]) == 0
    page = (out / "index.html").read_text()

    assert re.search(r'<a href="_batches/001-b.yaml" title="[^"]*b.yaml">b.yaml</a> <code>--set crf=20</code>', page)
    shown = dict(re.findall(r"<dt>([^<]+)</dt><dd[^>]*>([^<]*)</dd>", page))
    assert shown["negative_prompt"] == "&#34;&#34;" and shown["crf"] == "20"
    assert "image -" not in page and "image none" in page  # the plain job's label: it has no image
    (thumb,) = re.findall(r'<img class="input" src="([^"]+)"', page)
    assert thumb.startswith("_report/still-") and (out / thumb).read_bytes().startswith(b"\x89PNG")
