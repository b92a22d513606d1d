"""The scheduler's look-ahead (the prompts encoded ahead of their jobs) reads the queue from the
ledger only as far as it looks, whatever the queue's length: counted in specs parsed."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import write_batch

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import Ledger
from pan2render.jobs.spec import JobSpec
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.protocol.messages import WorkerConfig
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.jobflow import BatchFlow
from pan2render.runner.serve.progress import RunLog, RunProgress
from pan2render.runner.serve.scheduler import Scheduler, ServedBatch
from pan2render.runner.serve.steps import CONDITIONING_AHEAD_TEXTS, PAN2_FLOW
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def test_the_look_ahead_reads_no_spec_of_the_queued_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every conditioning call looks at the next jobs' prompts; reading every queued job's spec for
    it made a run of distinct prompts quadratic (a call every few jobs, each parsing the queue),
    and reading each one it looked at cost ~0.1 s a call: the queue keeps their prompts."""
    base = load_batch(write_batch(tmp_path / "one.yaml", [{"name": "fox", "prompt": "a fox"}])).jobs[0]
    parsed: list[str] = []  # the job names of the specs read from the ledger
    from_dict = JobSpec.from_dict

    def counted(d: dict[str, Any]) -> JobSpec:
        parsed.append(d["name"])
        return from_dict(d)

    executor = LocalExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    try:
        for n in (100, 400):
            out = tmp_path / f"out{n}"
            out.mkdir()
            ledger = Ledger.open(out)
            specs = [dataclasses.replace(base, name=f"j{i}", prompt=f"clip {i}") for i in range(n)]
            ledger.record_batch({"path": "b.yaml"}, specs, retries=1)
            scheduler = Scheduler(executor=executor, config=ServingConfig())
            batch = ServedBatch(flow=BatchFlow(out_dir=out, ledger=ledger, flow=PAN2_FLOW),
                                progress=RunProgress(log=RunLog(None), live=False))
            scheduler.serve(batch, [s.job_id for s in specs])
            with monkeypatch.context() as m:
                m.setattr(JobSpec, "from_dict", staticmethod(counted))
                parsed.clear()
                ahead = list(itertools.islice(scheduler.upcoming(batch), CONDITIONING_AHEAD_TEXTS))
            assert parsed == [], f"{len(parsed)} specs read to look ahead, {n} queued"
            assert [(j.job_id, j.prompts) for j in ahead] == [(s.job_id, (s.prompt, s.negative_prompt))
                                                             for s in specs[:CONDITIONING_AHEAD_TEXTS]]
            ledger.close()
    finally:
        executor.shutdown()
