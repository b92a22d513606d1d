"""``pan2-render run``'s scheduler: the one scheduler (``serve/scheduler.py``) serving one batch in this
process until every job of it is done or failed, then ending with it. Before it starts,
:func:`prepare_jobs` brings the batch's jobs to a runnable state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.runner.cluster.executor import Executor
from pan2render.runner.cluster.ray_cluster import GcsLost
from pan2render.runner.protocol.failures import ClusterLostError
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.jobflow import BatchFlow, JobFlow
from pan2render.runner.serve.progress import RunLog, RunProgress
from pan2render.runner.serve.scheduler import Scheduler, ServedBatch
from pan2render.runner.serve.session import prepare_jobs
from pan2render.runner.serve.steps import PAN2_FLOW

__all__ = ["Driver", "RunSummary"]


@dataclass(frozen=True)
class RunSummary:
    done: list[str]
    failed: list[str]
    groups_created: int
    seconds: float

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


class Driver:
    """The scheduler serving one batch until every job of it is done or failed (``pan2-render run``)."""

    def __init__(self, *, out_dir: Path, ledger: Ledger, executor: Executor, config: ServingConfig,
                 progress: RunProgress | None = None, on_job_end: Callable[[], None] | None = None,
                 flow: JobFlow = PAN2_FLOW):
        if progress is None:  # stderr only (the CLI passes one that also writes DIR/run.log)
            log = RunLog(None)
            progress = RunProgress(log=log, live=config.progress and log.is_terminal)
        self.out_dir = Path(out_dir)
        self.ledger = ledger
        self.config = config
        self.progress = progress
        self.scheduler = Scheduler(executor=executor, config=config)
        self.batch = ServedBatch(flow=BatchFlow(out_dir=self.out_dir, ledger=ledger, flow=flow,
                                                max_redos=config.max_redos, say=progress.say,
                                                upcoming=lambda: self.scheduler.upcoming(self.batch)),
                                 progress=progress, on_job_end=on_job_end)

    def run(self, job_ids: list[str], *, prepared: bool = False) -> RunSummary:
        """Run the named jobs to done or failed. ``prepared``: prepare_jobs already ran (it decodes
        every done video to check it, so the CLI runs it once, before deciding to start Ray)."""
        t0 = time.monotonic()
        if not prepared:
            prepare_jobs(out_dir=self.out_dir, ledger=self.ledger, job_ids=job_ids,
                         retries=self.config.retries, say=self.progress.say)
        s = self.scheduler
        s.serve(self.batch, job_ids)
        now = self.ledger.jobs(job_ids)
        self.progress.begin(total=len(now), done=sum(j.state is JobState.DONE for j in now),
                            failed=sum(j.state is JobState.FAILED for j in now))
        try:
            while s.busy:
                s.tick()
        except KeyboardInterrupt as e:
            # The CLI raises it with a stop signal's name (Ray's calls may raise a bare one).
            s.interrupt_all(f"interrupted ({e.args[0] if e.args else 'Ctrl-C or a stop signal'})")
            raise
        except ClusterLostError as e:
            s.interrupt_all(f"the cluster was lost: {e}", outcome="requeued", detail="the cluster was lost")
            if isinstance(e, GcsLost):
                left = sum(j.state is JobState.PENDING for j in self.ledger.jobs(job_ids))
                raise ClusterLostError(
                    f"{e}. The {left} unfinished job(s) are pending, none was charged an attempt for the "
                    f"loss; finished jobs are intact. Start the cluster again (`ray start --head` on its "
                    f"head node), then `pan2-render resume {self.out_dir}` (with --address naming the new "
                    f"head) finishes the batch") from e
            raise
        finally:
            self.progress.close()
            s.close()
        if self.batch.stop is not None:
            raise self.batch.stop
        final = self.ledger.jobs(job_ids)
        return RunSummary(done=[j.id for j in final if j.state is JobState.DONE],
                          failed=[j.id for j in final if j.state is JobState.FAILED],
                          groups_created=s.pool.created, seconds=time.monotonic() - t0)
