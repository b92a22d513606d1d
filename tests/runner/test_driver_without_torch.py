"""The driver's side of a run without torch: it checks artifacts with numpy and computes
params.json's noise levels without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def test_the_drivers_checks_read_what_the_workers_wrote(tmp_path: Path) -> None:
    """The numpy checks against the torch-packed files: the digest, the key, non-finite values."""
    import torch

    from pan2render.runner import stages

    emb = torch.randn(512, 16)
    path = tmp_path / "e.safetensors"
    path.write_bytes(stages.pack_embedding(emb, key="k", text_encoder_id="t"))
    assert stages.check_embedding(tmp_path, "e.safetensors", key="k") is None
    assert "another prompt" in (stages.check_embedding(tmp_path, "e.safetensors", key="other") or "")
    data = bytearray(path.read_bytes())
    data[-4:] = np.float32(1.5).tobytes()  # one value changed: its recorded digest no longer matches
    path.write_bytes(bytes(data))
    assert "sha256" in (stages.check_embedding(tmp_path, "e.safetensors", key="k") or "")
    path.write_bytes(bytes(data[:100]))
    assert "unreadable" in (stages.check_embedding(tmp_path, "e.safetensors", key="k") or "")
    bad = emb.clone()
    bad[3, 3] = float("inf")
    path.write_bytes(stages.pack_embedding(bad, key="k", text_encoder_id="t"))
    assert "non-finite" in (stages.check_embedding(tmp_path, "e.safetensors", key="k") or "")
