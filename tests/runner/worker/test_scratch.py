"""What a worker leaves in the temp folder: nothing, even when it is killed in the middle of an
encode (an out-of-memory kill, a node drained): the next worker to start on the machine removes
what dead workers left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pan2render.runner.protocol.messages import WorkerConfig
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY
from pan2render.runner.worker.render_worker import RenderWorker

pytestmark = pytest.mark.timeout(60)

# A worker in its own process: it decodes one job and, in its encode, holds the written mp4 in its
# temp folder (the encoder's check of it, made long) until it is killed.
_WORKER = r"""
import dataclasses, time
from runner_helpers import spec
from pan2render.media import video
from pan2render.runner.protocol import artifacts
from pan2render.runner.worker import packing
from pan2render.runner.protocol.messages import DecodeCall, LoadCall, WorkerConfig
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY, FakePipeline
from pan2render.runner.worker.render_worker import RenderWorker

real = video.encode_mp4
def held(*args, **kw):
    seconds = real(*args, **kw)
    print("encoded", flush=True)
    time.sleep(600)
    return seconds
video.encode_mp4 = held
job = dataclasses.replace(spec("a"), frames=5, height=32, width=32)
pipe = FakePipeline(job.model)
lat = pipe.sample(prompt_embeds=pipe.encode_prompt(job.prompt), height=32, width=32, frames=5, steps=1,
                  guidance=1.0, seed=0)
worker = RenderWorker(rank=0, world_size=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
assert worker.execute(LoadCall(model=job.model), 0).ok
data = packing.pack_latents(lat, spec_hash=job.spec_hash, seed=0, steps=1, model_id=pipe.model_id)
reply = worker.execute(DecodeCall(model=job.model, job_id=job.job_id, spec=job, latents=data), 1)
print("decoded" if reply.ok else reply.failure.error, flush=True)
time.sleep(600)
"""


def _leftovers(tmp: Path) -> list[Path]:
    return [p for p in tmp.rglob("*") if p.is_file()]


def test_the_next_worker_removes_what_a_worker_killed_while_encoding_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _WORKER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        said = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}  # in either order
        assert said == {"decoded", "encoded"}, said
        partial = [p for p in _leftovers(tmp) if p.suffix == ".mp4"]
        assert partial, sorted(map(str, _leftovers(tmp)))  # the encode's file, in the temp folder
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # this process's temp folder is the same one
    RenderWorker(rank=0, world_size=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    assert _leftovers(tmp) == []


def test_a_live_workers_encode_folder_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a worker starting beside a live one (another group on the machine) does
    not touch its files."""
    from pan2render.runner.worker.scratch import encode_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with encode_folder() as folder:
        (folder / "video.mp4").write_bytes(b"being written")
        RenderWorker(rank=0, world_size=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
        assert (folder / "video.mp4").read_bytes() == b"being written"
    assert not folder.exists()
