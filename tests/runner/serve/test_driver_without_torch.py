"""The driver never imports torch (seconds before a run can start Ray): it counts GPUs through NVML,
checks artifacts with numpy, computes params.json's noise levels without it, and unpickles the
workers' replies without it; only the workers' processes import it."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def test_the_drivers_checks_read_what_the_workers_wrote(tmp_path: Path) -> None:
    """The numpy checks against the torch-packed files: the digest, the key, non-finite values."""
    import torch

    from pan2render.runner.protocol import artifacts
    from pan2render.runner.worker import packing

    emb = torch.randn(512, 16)
    path = tmp_path / "e.safetensors"
    path.write_bytes(packing.pack_embedding(emb, key="k", text_encoder_id="t"))
    assert artifacts.check_embedding(tmp_path, "e.safetensors", key="k") is None
    assert "another prompt" in (artifacts.check_embedding(tmp_path, "e.safetensors", key="other") or "")
    data = bytearray(path.read_bytes())
    data[-4:] = np.float32(1.5).tobytes()  # one value changed: its recorded digest no longer matches
    path.write_bytes(bytes(data))
    assert "sha256" in (artifacts.check_embedding(tmp_path, "e.safetensors", key="k") or "")
    path.write_bytes(bytes(data[:100]))
    assert "unreadable" in (artifacts.check_embedding(tmp_path, "e.safetensors", key="k") or "")
    bad = emb.clone()
    bad[3, 3] = float("inf")
    path.write_bytes(packing.pack_embedding(bad, key="k", text_encoder_id="t"))
    assert "non-finite" in (artifacts.check_embedding(tmp_path, "e.safetensors", key="k") or "")


def test_gpus_are_counted_as_ray_counts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from pan2render.runner.cluster import choose, devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.visible(4) == 4
    assert [devices.visible(4, v) for v in ("", "NoDevFiles", "0,1", "3", "0,1,2,3,4,5")] == [0, 0, 2, 1, 4]
    monkeypatch.setattr(devices, "torch_build", lambda: "cpu")
    monkeypatch.setattr(devices, "nvml_device_count", lambda: 8)
    assert devices.cuda_gpu_count() == 0  # a CPU wheel cannot use them
    monkeypatch.setattr(devices, "torch_build", lambda: "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert devices.cuda_gpu_count() == 2
    assert choose.local_gpus(None, max_gpus=1) == (2, 2, None)
    monkeypatch.setattr(devices, "nvml_device_count", lambda: 0)
    gpus, cuda, why = choose.local_gpus(None, max_gpus=2)
    assert (gpus, cuda) == (2, 0) and why is not None and why.startswith("no CUDA GPU found")
    assert choose.local_gpus(3, max_gpus=2) == (3, 0, None)


@pytest.mark.parametrize(("text", "build"), [
    ("cuda: Optional[str] = '12.8'\ngit_version = 'x'\nhip: Optional[str] = None\n", "cuda"),
    ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", "cpu"),
    ("cuda = None\nhip = '6.2.41133'\n", "rocm"),
    ("__version__ = '2.13.0'\n", None),  # unreadable: NVML alone decides
])
def test_the_torch_build_is_read_without_importing_torch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, build: str | None) -> None:
    from pan2render.runner.cluster import devices

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (tmp_path / "torch" / "version.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # find_spec then looks on sys.path
    assert devices.torch_build() == build


def test_the_installed_torch_build_is_read() -> None:
    import torch

    from pan2render.runner.cluster import devices

    assert devices.torch_build() == ("cuda" if torch.version.cuda else "rocm" if torch.version.hip else "cpu")


_DRIVER_SIDE = r"""
import pickle, sys
from pathlib import Path
from pan2render.runner.cli import main as cli
from pan2render.runner.cluster import choose, executor, local_executor, ray_executor
from pan2render.runner.cluster import ray_cluster as cluster
from pan2render.runner.protocol import artifacts, outputs
from pan2render.runner.serve import driver, jobflow, pool, repair, scheduler, steps as stages
from pan2render.runner.views import report, status as views
from pan2render.runner.protocol.messages import LoadReply
out = Path(sys.argv[1])
choose.local_gpus(None, max_gpus=1)
assert artifacts.check_embedding(out, "emb.safetensors", key="k") is None
job = pickle.loads(Path(sys.argv[2]).read_bytes())
assert artifacts.check_latents(out, artifacts.Recorded("lat.safetensors", None, None), spec=job) is None
assert len(outputs._schedule(job, {"num_train_timesteps": 1000})) == 4
reply = pickle.loads(Path(sys.argv[3]).read_bytes())
assert isinstance(reply, LoadReply) and reply.versions["torch"]
from pan2render.runner.cluster import sim_model  # the simulated GPUs' answers, a video among them
assert len(sim_model.mp4_bytes(5, 48, 32, 8.0)) > 0
print("torch imported:", "torch" in sys.modules)
assert "torch" not in sys.modules, "the driver imported torch"
"""


def test_the_driver_side_never_imports_torch(tmp_path: Path) -> None:
    from runner_helpers import spec

    from pan2render.runner.protocol.messages import LoadCall, WorkerConfig
    from pan2render.runner.worker import packing
    from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY, FakePipeline
    from pan2render.runner.worker.render_worker import RenderWorker
    from pan2render.runner.worker.versions import runtime_versions

    emb = FakePipeline("m").encode_prompt("x")
    (tmp_path / "emb.safetensors").write_bytes(packing.pack_embedding(emb, key="k", text_encoder_id="t"))
    job = spec("s", steps=4)
    (tmp_path / "lat.safetensors").write_bytes(packing.pack_latents(
        FakePipeline("m").sample(prompt_embeds=emb, height=job.height, width=job.width, frames=job.frames, steps=1,
                                 guidance=1.0, seed=0),
        spec_hash=job.spec_hash, seed=0, steps=1, model_id="m"))
    (tmp_path / "spec.pickle").write_bytes(pickle.dumps(job))
    reply = RenderWorker(rank=0, world_size=1, config=WorkerConfig(
        pipeline_factory=FAKE_FACTORY)).execute(LoadCall(model="m"), 0).value
    assert reply.versions["torch"] == runtime_versions()["torch"]
    (tmp_path / "reply.pickle").write_bytes(pickle.dumps(reply))
    done = subprocess.run([sys.executable, "-c", _DRIVER_SIDE, str(tmp_path), str(tmp_path / "spec.pickle"),
                           str(tmp_path / "reply.pickle")], capture_output=True, text=True, timeout=120)
    print(done.stdout, done.stderr)
    assert done.returncode == 0
