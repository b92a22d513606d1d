"""The calls the scheduler keeps in flight beside a job's sampling, on its group's I/O lane
(``JobRun.sides``): one fetch of its newest step checkpoint (when ``checkpoint_every`` > 0) and one of
its newest live preview (when ``preview_every`` > 0). Each waits on the worker for something newer
than what the driver holds, and is asked again once answered, while the sampling goes on.

What they bring is kept off the ledger's hot path where it can be: a step checkpoint is an artifact
(written, then recorded: ``BatchFlow.record_step_checkpoint``); a preview is only a file, replaced
in the job's folder (``DIR/<job>/preview.webp``, its note inside), and the batch's progress holds
its step for the farm's monitor. A fetch that failed is dropped: the sampling's own reply says
what became of the group.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pan2render.runner.cluster.executor import Call, Executor, GroupDied
from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.messages import (
    CheckpointReply,
    FetchCheckpointCall,
    FetchPreviewCall,
    PreviewReply,
    WorkerCall,
)
from pan2render.runner.serve.attempt import JobRun
from pan2render.runner.serve.serving import ServedBatch


class SideFetches:
    """``call(run, message)`` issues a call on the run's group, with its deadline."""

    def __init__(self, executor: Executor, call: Callable[[JobRun, WorkerCall], Call]) -> None:
        self.ex = executor
        self._call = call
        self._preview_failed: set[Path] = set()  # batches whose folder refused a preview (said once)

    def start(self, run: JobRun) -> None:
        """The run's SampleCall just went out."""
        spec = run.job.spec
        if spec.checkpoint_every > 0:
            run.sides.append(self._call(run, FetchCheckpointCall(job_id=run.job.id, after_step=run.checkpoint_step)))
        if spec.preview_every > 0:
            run.sides.append(self._call(run, FetchPreviewCall(job_id=run.job.id, after_step=run.preview_step)))

    def on_reply(self, batch: ServedBatch, run: JobRun, call: Call) -> None:
        """``call``, one of ``run.sides``, is answered: what it brought kept, the next one asked for."""
        run.sides = [c for c in run.sides if c is not call]
        try:
            reply = self.ex.result(call)
        except GroupDied:
            return
        value = reply.value if reply.failure is None else None
        if isinstance(value, CheckpointReply):
            try:
                batch.flow.record_step_checkpoint(run, value)
            except Exception as e:  # a checkpoint not written costs only its minutes
                batch.progress.say(f"{run.job.name}: step checkpoint not written: {type(e).__name__}: {e}")
        elif isinstance(value, PreviewReply):
            self._keep_preview(batch, run, value)
        if not run.sampling:
            return
        if isinstance(call.message, FetchCheckpointCall):
            after = value.step if isinstance(value, CheckpointReply) else run.checkpoint_step
            run.sides.append(self._call(run, FetchCheckpointCall(job_id=run.job.id, after_step=after)))
        else:
            run.sides.append(self._call(run, FetchPreviewCall(job_id=run.job.id, after_step=run.preview_step)))

    def _keep_preview(self, batch: ServedBatch, run: JobRun, reply: PreviewReply) -> None:
        """The picture replaces the job's preview file; its step goes to the batch's progress."""
        if reply.step <= run.preview_step:
            return
        try:
            artifacts.write_preview(batch.flow.out_dir, artifacts.preview_relpath(run.job.id), reply.image)
        except Exception as e:  # a preview is never worth a job: said once per batch, then dropped
            if batch.flow.out_dir not in self._preview_failed:
                self._preview_failed.add(batch.flow.out_dir)
                batch.progress.say(f"{run.job.name}: preview not written: {type(e).__name__}: {e}")
            return
        run.preview_step = reply.step
        batch.progress.preview(run.job.id, step=reply.step, total=reply.total_steps)
