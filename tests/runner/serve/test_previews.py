"""Live previews through the scheduler, on the tiny model (in this process, the worker's GPU lane on
a thread of its own as a Ray actor's is): while a job samples, its preview file is replaced with
newer steps; the job done, the file is gone; with previews off nothing is fetched or written; and
the latents are the same bytes either way (the same job id: ``preview_every`` is not hashed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from runner_helpers import RecordingExecutor, ThreadedExecutor, write_batch
from safetensors.numpy import load_file

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import JobState, Ledger
from pan2render.preview_file import read_note
from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.messages import DEFAULT_PIPELINE_FACTORY, FetchPreviewCall, WorkerConfig
from pan2render.runner.serve import sides
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver

STEPS = 8
STEP_S = 0.25  # each step of job "fox" sleeps this long first (a fault hook): ~2 s of sampling
EVERY_S = 0.3


class _Recording(RecordingExecutor, ThreadedExecutor):
    """Samplings beside the driver's loop, every call recorded."""


def _render(tmp_path: Path, name: str, *, preview_every: float) -> tuple[Path, _Recording, str]:
    batch = write_batch(tmp_path / f"{name}.yaml", [{"name": "fox", "prompt": "a fox in the snow"}],
                        defaults={"height": 32, "width": 64, "frames": 9, "steps": STEPS,
                                  "preview_every": preview_every, "checkpoint_every": 0})
    out = tmp_path / name
    out.mkdir()
    ledger = Ledger.open(out)
    specs = load_batch(batch).jobs
    ledger.add_jobs(specs, retries=0)
    ex = _Recording(gpus=1, config=WorkerConfig(pipeline_factory=DEFAULT_PIPELINE_FACTORY,
                                               faults={"slow_steps": {"job": "fox", "seconds": STEP_S}}))
    Driver(out_dir=out, ledger=ledger, executor=ex, config=ServingConfig(retries=0, progress=False, poll_s=0.01)).run(
        [specs[0].job_id])
    assert ledger.job(specs[0].job_id).state is JobState.DONE
    ledger.close()
    return out, ex, specs[0].job_id


def test_previews_replace_each_other_while_a_job_samples_and_leave_its_latents_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[tuple[int, bool, bytes]] = []  # (step, latents there yet?, the file's bytes)
    real = artifacts.write_preview

    def spy(out_dir: Path, relpath: str, data: bytes) -> None:
        real(out_dir, relpath, data)
        job = relpath.split("/")[0]
        written.append((read_note(data).step, (out_dir / artifacts.latents_relpath(job)).exists(),
                        (out_dir / relpath).read_bytes()))

    monkeypatch.setattr(sides.artifacts, "write_preview", spy)
    out, ex, job = _render(tmp_path, "on", preview_every=EVERY_S)
    steps = [step for step, _, _ in written]
    print(f"previews written at steps {steps} of {STEPS}")
    assert len(written) >= 2 and steps == sorted(set(steps)) and 1 <= steps[0] and steps[-1] < STEPS
    assert not any(after for _, after, _ in written)  # each while the job sampled (no latents yet)
    assert all(data[:4] == b"RIFF" and read_note(data).total_steps == STEPS for _, _, data in written)
    assert len({data for _, _, data in written}) == len(written)  # each a new picture
    assert not (out / artifacts.preview_relpath(job)).exists()  # the job done: its preview gone
    assert (FetchPreviewCall, "fox") in ex.side_calls

    written.clear()
    off, ex_off, same_job = _render(tmp_path, "off", preview_every=0)
    assert same_job == job  # preview_every is not in the job id
    assert written == [] and not any(c is FetchPreviewCall for c, _ in ex_off.side_calls)
    # Previews on or off: the same latents, bit for bit (the files' metadata holds each run's spec).
    on_latents, off_latents = (load_file(d / artifacts.latents_relpath(job))["latents"] for d in (out, off))
    assert on_latents.tobytes() == off_latents.tobytes()
