"""A CPU worker decodes on a fixed number of threads whatever share of the cores it got
(``WorkerConfig.threads``: the cores over ``--cpu-gpus``), then gives its sampling its share back:
the VAE's convolutions give other bits on another number of threads (the tiny model's 512x512
decode differs in 62 pixels of 5 frames between 1 and 2), so the same latents must decode alike
whatever the number of logical GPUs. (libx264's side: tests/media/test_video.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pan2render.jobs.spec import JobSpec
from pan2render.runner.protocol.messages import DecodeCall, LoadCall, WorkerConfig
from pan2render.runner.worker import packing
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY, FakePipeline
from pan2render.runner.worker.render_worker import RenderWorker
from pan2render.runner.worker.threads import CPU_DECODE_THREADS


@pytest.fixture()
def threads_back() -> Any:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("share", [1, 2, 3])
def test_the_decode_runs_on_the_same_threads_whatever_the_workers_share(
        share: int, threads_back: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    decode = FakePipeline.decode

    def counting(self: FakePipeline, latents: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return decode(self, latents, **kw)

    monkeypatch.setattr(FakePipeline, "decode", counting)
    spec = JobSpec(name="v", model="tiny", prompt="p", negative_prompt="", image=None, image_sha256=None, seed=0,
                   steps=2, guidance=1.0, height=32, width=48, frames=9, fps=8.0, flow_shift=5.0, sampler="unipc",
                   gpus=1, crf=18, preset="tiny-preview")
    w = RenderWorker(rank=0, world_size=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY, threads=share))
    assert w.execute(LoadCall(model="tiny"), 0).ok
    pipe = FakePipeline("tiny")
    latents = packing.pack_latents(pipe.sample(prompt_embeds=pipe.encode_prompt("p"), height=32, width=48, frames=9,
                                               steps=2, guidance=1.0, seed=0), spec_hash=spec.spec_hash, seed=0,
                                   steps=2, model_id="fake")
    assert w.execute(DecodeCall(model="tiny", job_id=spec.job_id, spec=spec, latents=latents), 1).ok
    assert seen == [CPU_DECODE_THREADS] and torch.get_num_threads() == share  # (the sampling's share again)
