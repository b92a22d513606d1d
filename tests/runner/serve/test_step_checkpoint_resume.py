"""Which step checkpoint a sampling continues from (BatchFlow.step_checkpoint): the file on disk,
checked on its own (its digest, its job, its model), not against the ledger's record of it. A
driver SIGKILLed after renaming a newer checkpoint into place and before recording it leaves the
ledger one checkpoint behind the file; the newer file is as good a place to continue from."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from runner_helpers import spec

from pan2render.jobs.ledger import Ledger
from pan2render.models.sampler_state import SamplerState, pack_sampler_state
from pan2render.models.samplers import StepState
from pan2render.runner.cluster.executor import Group
from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.artifacts import STEP_CHECKPOINT_DOC
from pan2render.runner.protocol.messages import LoadReply
from pan2render.runner.serve.attempt import JobRun
from pan2render.runner.serve.jobflow import BatchFlow
from pan2render.runner.serve.steps import PAN2_FLOW
from pan2render.step_checkpoint import CheckpointKey

MODEL_ID = "tiny-0123"


def _checkpoint(spec_hash: str, *, step: int, total: int = 10, model_id: str = MODEL_ID,
                latent: float | None = None) -> bytes:
    key = CheckpointKey(model_id=model_id, sampler="euler", total_steps=total, latent_shape=(1, 2, 1, 2, 2),
                        seed=0, guidance=2.5, spec_hash=spec_hash)
    latents = torch.full(key.latent_shape, float(step) if latent is None else latent)
    state = SamplerState(key=key, latents=latents, schedule=torch.linspace(1, 0, total + 1),
                         generator=torch.Generator().manual_seed(0).get_state(),
                         sampler=StepState(step=step, tensors={}, counters={}))
    return pack_sampler_state(state, spec_hash=spec_hash)


def _set_up(tmp_path: Path) -> tuple[BatchFlow, JobRun, list[str]]:
    out = tmp_path / "out"
    out.mkdir()
    ledger = Ledger.open(out)
    job = spec("long")
    ledger.add_jobs([job], retries=2)
    said: list[str] = []
    flow = BatchFlow(out_dir=out, ledger=ledger, flow=PAN2_FLOW, say=said.append)
    group = Group(id="g0x1", size=1, handle=None)
    group.loads[job.model] = LoadReply(model_id=MODEL_ID, text_encoder_id="t", backend="none", world_size=1,
                                       device="cpu", attention="n/a", load_s=0.0, warmup_s=0.0)
    return flow, JobRun(job=ledger.job(job.job_id), group=group), said


def test_a_checkpoint_newer_than_its_record_is_continued_from(tmp_path: Path) -> None:
    flow, run, said = _set_up(tmp_path)
    flow.write_step_checkpoint(run, _checkpoint(run.job.spec.spec_hash, step=3), step=3)
    # Killed between the rename of step 6's file into place and its record: the ledger says step 3.
    newer = _checkpoint(run.job.spec.spec_hash, step=6)
    (flow.out_dir / artifacts.step_checkpoint_relpath(run.job.id)).write_bytes(newer)
    assert json.loads(flow.ledger.document(run.job.id, STEP_CHECKPOINT_DOC))["step"] == 3
    assert flow.step_checkpoint(run) == newer and run.checkpoint_step == 6
    assert said == ["long: continuing its sampling from the step checkpoint at step 6/10"]


def test_a_checkpoint_with_no_record_yet_is_continued_from(tmp_path: Path) -> None:
    """Killed after the first checkpoint's rename, before anything was recorded."""
    flow, run, _ = _set_up(tmp_path)
    first = _checkpoint(run.job.spec.spec_hash, step=2)
    path = flow.out_dir / artifacts.step_checkpoint_relpath(run.job.id)
    path.parent.mkdir()
    path.write_bytes(first)
    assert flow.step_checkpoint(run) == first and run.checkpoint_step == 2


def test_a_damaged_or_foreign_checkpoint_is_dropped_and_the_sampling_starts_over(tmp_path: Path) -> None:
    flow, run, said = _set_up(tmp_path)
    path = flow.out_dir / artifacts.step_checkpoint_relpath(run.job.id)
    flow.write_step_checkpoint(run, _checkpoint(run.job.spec.spec_hash, step=3), step=3)
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 1
    path.write_bytes(bytes(damaged))
    assert flow.step_checkpoint(run) is None
    assert "damaged: its sha256 does not match its contents" in said[-1] and "sampling from step 0" in said[-1]
    assert not path.exists() and flow.ledger.document(run.job.id, STEP_CHECKPOINT_DOC) is None
    path.write_bytes(_checkpoint("e" * 64, step=5))  # another job's (another spec hash)
    assert flow.step_checkpoint(run) is None and "belongs to spec_hash 'eeeeeeeeeeee'" in said[-1]
    assert not path.exists()


def test_a_cached_jobs_checkpoint_is_dropped_before_its_sampling_starts(tmp_path: Path) -> None:
    """A step cache's residuals are not in a checkpoint: the sampling starts from step 0, so the
    checkpoint goes before it starts (not in the sampling's reply, minutes later, while `status`
    showed the restarted sampling behind it)."""
    flow, run, said = _set_up(tmp_path)
    cached = dataclasses.replace(run.job.spec, cache="magcache")
    flow.ledger.add_jobs([cached], retries=2)
    run = JobRun(job=flow.ledger.job(cached.job_id), group=run.group)
    flow.write_step_checkpoint(run, _checkpoint(cached.spec_hash, step=3), step=3)
    run.checkpoint_step = 0  # (a new attempt)
    assert flow.step_checkpoint(run) is None
    assert flow.ledger.document(run.job.id, STEP_CHECKPOINT_DOC) is None
    assert not (flow.out_dir / artifacts.step_checkpoint_relpath(run.job.id)).exists()
    assert "a step cache's kept residuals are not in a step checkpoint" in said[-1]


@pytest.mark.parametrize(("made", "why"), [
    (dict(model_id="Wan2.2-TI2V-5B-0123456789"), "stale: it belongs to model_id 'Wan2.2-TI2V-5B-0123456789'"),
    (dict(step=0), "damaged: step 0 is not a boundary"),
    (dict(step=10), "damaged: step 10 is not a boundary"),
    (dict(step=3, latent=float("nan")), "damaged: non-finite latents"),
])
def test_a_checkpoint_of_another_model_at_no_boundary_or_with_nan_latents_is_refused(
        tmp_path: Path, made: dict, why: str) -> None:
    """Each checks out as a file (its own digest is right) and is still refused by the driver before
    the sampling starts: another model's (the group's loaded model id, not the job's alone), one
    after no step or after the last, one whose latents are not finite."""
    flow, run, said = _set_up(tmp_path)
    path = flow.out_dir / artifacts.step_checkpoint_relpath(run.job.id)
    flow.write_step_checkpoint(run, _checkpoint(run.job.spec.spec_hash, **{"step": 3, **made}), step=3)
    run.checkpoint_step = 0  # (a new attempt)
    assert flow.step_checkpoint(run) is None
    assert why in said[-1] and "sampling from step 0" in said[-1]
    assert not path.exists() and flow.ledger.document(run.job.id, STEP_CHECKPOINT_DOC) is None
