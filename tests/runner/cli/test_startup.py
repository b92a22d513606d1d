"""What a run says about its start-up, and what its worker does at a model's load.

- The load's phases (``LoadReply.phases``) and the run log's start-up lines: Ray ready, a group
  placed, its worker up, its model loaded with each phase, in seconds since the command started.
- The worker's warm-up runs what a job's decode runs (decode, yuv420p, the host copy), on the
  shortest latent whose decode covers every shape.
- Every GPU-lane call runs on one thread of the worker, whichever thread it arrives on.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import write_batch

from pan2render.phases import Phase
from pan2render.runner.cli import main as cli
from pan2render.runner.protocol.messages import LoadReply

PHASES_OF_A_LOAD = ["imports", "DiT", "VAE", "text encoder"]  # the attention warm-up is the warm-up's
STAMP = r"[+-]\d+\.\d\d s"  # seconds since the command started


def test_the_tiny_models_load_reports_its_phases_and_the_log_its_start_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pan2render.runner.serve.jobflow import BatchFlow

    loads: list[tuple[LoadReply, float]] = []
    real = BatchFlow.record_load

    def keep(self: BatchFlow, run: Any, load: LoadReply, seconds: float) -> None:
        loads.append((load, seconds))
        real(self, run, load, seconds)

    monkeypatch.setattr(BatchFlow, "record_load", keep)
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")  # `pan2-render run` in this process
    monkeypatch.delenv("PAN2_RENDER_PIPELINE", raising=False)  # the embedded tiny model
    batch = write_batch(tmp_path / "b.yaml", [{"name": "fox", "prompt": "a red fox"}],
                        defaults={"steps": 2, "frames": 5, "width": 32, "height": 32})
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--no-progress"]) == 0

    ((load, seconds),) = loads
    print("phases:", load.phases, "load_s", load.load_s, "warmup_s", load.warmup_s, "call", seconds)
    assert all(isinstance(p, Phase) for p in load.phases)
    assert [p.name for p in load.phases] == PHASES_OF_A_LOAD  # in the order they ran; no warm-up on the CPU
    assert all(p.seconds >= 0 for p in load.phases)
    assert sum(p.seconds for p in load.phases) <= load.load_s + load.warmup_s <= seconds
    assert load.worker is not None and load.worker.ready_at >= load.worker.process_started_at

    log = (out / "run.log").read_text()
    print(log)
    assert re.search(rf"start-up: the in-process cluster ready at {STAMP}, \d+\.\d\d s after it was asked for", log)
    assert re.search(rf"start-up: group local-\d+ \(1 GPU\) placed at {STAMP} \(asked for at {STAMP}\)", log)
    assert re.search(rf"start-up: group local-\d+ worker process \(rank 0\) up at {STAMP} \(started", log)
    line = re.search(rf"start-up: group local-\d+ loaded tiny at {STAMP} in \d+\.\d s "
                     r"\(pipeline \d+\.\d s, warm-up \d+\.\d s\): (.*)", log)
    assert line, log
    assert [part.rsplit(" ", 2)[0] for part in line.group(1).split(", ")][:4] == PHASES_OF_A_LOAD
    assert len(re.findall(r"start-up: group .* loaded", log)) == 1  # one group, one load


def test_the_warm_up_decodes_through_what_a_jobs_decode_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from pan2render.media import yuv
    from pan2render.runner.protocol.messages import LoadCall, Warmup, WorkerConfig
    from pan2render.runner.worker.fake_pipeline import load_warming_pipeline
    from pan2render.runner.worker.render_worker import RenderWorker

    converted: list[tuple[int, ...]] = []
    real = yuv.rgb_to_yuv420

    def counting(frames: Any) -> Any:
        converted.append(tuple(frames.shape))
        return real(frames)

    monkeypatch.setattr(yuv, "rgb_to_yuv420", counting)
    worker = RenderWorker(rank=0, world_size=1,
                          config=WorkerConfig(pipeline_factory="pan2render.runner.worker.fake_pipeline:load_warming_pipeline"))
    reply = worker.execute(LoadCall(model="warm", warmup=Warmup(height=32, width=48, frames=17, guidance=2.5)), 0)
    assert reply.ok, reply.failure
    load = reply.value
    print("phases:", load.phases)
    assert [p.name for p in load.phases] == ["imports", "warm-up decode", "warm-up sampling"]
    assert load.warmup_s >= load.phases[-1].seconds + load.phases[-2].seconds
    # The decode ran on the first 2 of the 5 latent frames (17 frames) and through the yuv420p
    # conversion a job's decode runs: 5 frames of 32x48.
    assert [tuple(x.shape) for x in load_warming_pipeline("warm", "cpu").warm_decoded] == [(48, 2, 2, 3)]
    assert converted == [(5, 32, 48, 3)]


def test_every_gpu_lane_call_runs_on_the_workers_one_thread() -> None:
    """Ray hands a threaded actor's calls to a pool of threads; PyTorch keeps cuDNN's autotuning
    per thread: the worker runs them all on one thread, so the jobs find what the load tuned."""
    import threading

    from pan2render.runner.protocol.messages import CollectCall, LoadCall, WorkerCall, WorkerConfig
    from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY
    from pan2render.runner.worker.render_worker import RenderWorker

    ran: list[tuple[str, int]] = []

    class Noting(RenderWorker):
        def _run(self, call: WorkerCall) -> Any:
            ran.append((type(call).__name__, threading.get_ident()))
            return super()._run(call)

    worker = Noting(rank=0, world_size=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    callers = []
    for seq, model in enumerate(["a", "b", "c"]):  # each call from a thread of its own
        t = threading.Thread(target=worker.execute, args=(LoadCall(model=model), seq))
        t.start()
        t.join()
        callers.append(t.ident)
    collect = threading.Thread(target=worker.execute, args=(CollectCall(job_id="none"),))
    collect.start()
    collect.join()
    lane = {ident for name, ident in ran if name == "LoadCall"}
    print("ran:", ran, "callers:", callers)
    assert len(lane) == 1 and not lane & {threading.get_ident(), *callers}
    assert [ident for name, ident in ran if name == "CollectCall"] == [collect.ident]  # the I/O lane: its own
