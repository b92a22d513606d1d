"""`pan2-render calibrate` on the tiny model: one exact job gives both MagCache's ratios and the
previews' latent -> RGB map, each kept beside the model's id, and the model's previews then use the
fitted map instead of one fitted on the VAE alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pan2render.runner.cli import main as cli


def test_calibrate_fits_the_preview_map_and_keeps_it_beside_the_model_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PAN2_RENDER_CACHE", str(tmp_path / "cache"))
    assert cli.main(["calibrate", "tiny", "--preset", "tiny-preview", "--device", "cpu"]) == 0
    said = capsys.readouterr().out
    print(said)
    magcache, = (tmp_path / "cache" / "magcache").glob("*.json")
    fitted, = (tmp_path / "cache" / "preview").glob("*.json")
    assert magcache.stem == fitted.stem  # one model id
    doc = json.loads(fitted.read_text())
    assert len(doc["weight"]) == 48 and len(doc["bias"]) == 3 and doc["source"].startswith(f"fitted on {fitted.stem}")
    assert doc["quality"]["psnr_db"] > doc["quality"]["grey_psnr_db"]
    assert "latent -> RGB map fitted on 4 decodes" in said and str(fitted) in said

    from pan2render.models import PAN2Pipeline, PAN2PipelineConfig
    pipe = PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cpu"))
    assert pipe.model_id == fitted.stem
    assert pipe.preview_map.source == doc["source"]
