"""The driver's side of a run without torch: it counts GPUs through NVML, checks artifacts with
numpy and computes params.json's noise levels without it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest


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


def test_gpus_are_counted_as_ray_counts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from pan2render.runner import cli, devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.visible(4) == 4
    assert [devices.visible(4, v) for v in ("", "NoDevFiles", "0,1", "3", "0,1,2,3,4,5")] == [0, 0, 2, 1, 4]
    monkeypatch.setattr(devices, "torch_build", lambda: "cpu")
    monkeypatch.setattr(devices, "nvml_device_count", lambda: 8)
    assert devices.cuda_gpu_count() == 0  # a CPU wheel cannot use them
    monkeypatch.setattr(devices, "torch_build", lambda: "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert devices.cuda_gpu_count() == 2
    assert cli._local_gpus(None, max_gpus=1) == (2, 2, None)
    monkeypatch.setattr(devices, "nvml_device_count", lambda: 0)
    gpus, cuda, why = cli._local_gpus(None, max_gpus=2)
    assert (gpus, cuda) == (2, 0) and why is not None and why.startswith("no CUDA GPU found")
    assert cli._local_gpus(3, max_gpus=2) == (3, 0, None)


@pytest.mark.parametrize(("text", "build"), [
    ("cuda: Optional[str] = '12.8'\ngit_version = 'x'\nhip: Optional[str] = None\n", "cuda"),
    ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", "cpu"),
    ("cuda = None\nhip = '6.2.41133'\n", "rocm"),
    ("__version__ = '2.13.0'\n", None),  # unreadable: NVML alone decides
])
def test_the_torch_build_is_read_without_importing_torch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, build: str | None) -> None:
    from pan2render.runner import devices

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (tmp_path / "torch" / "version.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # find_spec then looks on sys.path
    assert devices.torch_build() == build


def test_the_installed_torch_build_is_read() -> None:
    import torch

    from pan2render.runner import devices

    assert devices.torch_build() == ("cuda" if torch.version.cuda else "rocm" if torch.version.hip else "cpu")
