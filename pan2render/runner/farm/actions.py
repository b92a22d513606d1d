"""What a client may ask of the farm, each run on its main thread (the queue's and the ledgers'
one writer) and durable before it is answered: in the queue, in the batch's ledger, or both.

A user acts on their own batches; the admin (the farm's own token) on every one. Each action
says what it did and refuses with the reason (:class:`FarmRequestError` and its status: 403 not
yours, 404 no such batch or job, 409 not in a state for it, 422 cannot be rendered as things
stand, 507 the disk is full).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pan2render.jobs import disk
from pan2render.jobs.ledger import TERMINAL_JOB_STATES, FolderLockedError, JobRecord, Ledger
from pan2render.runner.farm.queue import BatchEvent, QueuedBatch, QueueError
from pan2render.runner.farm.users import User
from pan2render.runner.protocol.artifacts import estimated_bytes
from pan2render.runner.serve import errors
from pan2render.runner.serve.errors import UnrecordedWork
from pan2render.runner.serve.session import BatchRequest, BatchSession, model_folder_problems

if TYPE_CHECKING:
    from pan2render.runner.farm.service import Farm

PRIORITY_RANGE = (-1000, 1000)  # a batch's priority: an integer in this range, higher first


class FarmRequestError(RuntimeError):
    """A client's request the farm refuses, with the HTTP status its answer carries (and ``extra``,
    fields its JSON answer carries beside the error)."""

    def __init__(self, message: str, *, status: int = 409, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.extra = extra or {}


def refused(e: QueueError) -> FarmRequestError:
    """A refusal of the queue as a client hears it: an unknown batch is 404, the rest a conflict."""
    return FarmRequestError(str(e), status=404 if str(e).startswith("no batch") else 409)


class Actions:
    def __init__(self, farm: Farm):
        self.farm = farm

    # ------------------------------------------------------------------ helpers
    def _row(self, batch_id: str, user: User | None, doing: str) -> QueuedBatch:
        """The batch, if ``user`` may act on it (None: the farm itself, the admin)."""
        try:
            row = self.farm.queue.get(batch_id)
        except QueueError as e:
            raise refused(e) from None
        if user is not None and not user.admin and row.owner != user.name:
            raise FarmRequestError(f"batch {row.id} is {row.owner}'s: only its owner or the farm's admin may "
                                   f"{doing} it", status=403)
        return row

    @staticmethod
    def _job(row: QueuedBatch, ledger: Ledger | None, query: str) -> JobRecord:
        """The batch's job ``query`` names (id, unique id prefix or name), from the ledger the farm
        holds while it serves the batch, else read-only from its folder."""
        from pan2render.runner.views.status import JobNotFound, find_job

        try:
            led = ledger or Ledger.open_readonly(Path(row.out_dir))
        except Exception as e:  # the folder gone or damaged since the batch ended
            raise FarmRequestError(f"batch {row.id} is {row.state.value}; its ledger cannot be read ({e})",
                                   status=404) from e
        try:
            return find_job(led, query)
        except JobNotFound as e:
            raise FarmRequestError(str(e), status=404) from e
        finally:
            if led is not ledger:
                led.close()

    def _transition(self, row: QueuedBatch, event: BatchEvent, reason: str) -> QueuedBatch:
        try:
            return self.farm.queue.transition(row.id, event, reason=reason)
        except QueueError as e:
            raise refused(e) from None

    # ------------------------------------------------------------------ submitting
    def submit(self, request: BatchRequest, *, owner: str, priority: int = 0, preempt: bool = False,
               video_id: str | None = None, video: dict[str, Any] | None = None) -> dict[str, Any]:
        """Record the batch in its folder's ledger, queue it, serve it; nothing recorded when any
        of it fails. ``preempt``: its jobs may stop a lower-priority batch's sampling at a step
        boundary to take its group (that job continues from its step checkpoint after)."""
        check_priority(priority)
        farm, out = self.farm, str(request.out_dir)
        if (other := farm.queue.active_for(out)) is not None:
            raise FarmRequestError(f"{out} is already served by batch {other.id} on this farm; wait for it to end "
                                   f"or cancel it, or choose another output folder")
        if broken := model_folder_problems(request.batch.jobs):
            raise FarmRequestError(errors.broken_checkpoints(broken, resume=None), status=422)
        title = (f"submit {request.batch.path} {' '.join(request.overrides.flags())}".rstrip()
                 + f" (farm {farm.root}, priority {priority}, owner {owner})")
        created = not request.out_dir.exists()
        try:
            session = BatchSession.record(request, stream=None, title=title)
        except (FolderLockedError, UnrecordedWork) as e:
            raise FarmRequestError(str(e)) from e
        except Exception as e:
            if created:
                _remove_if_ours(request.out_dir)
            raise _full_or(e, request) from e
        try:
            row = farm.queue.add(out_dir=out, batch_path=request.batch.path, owner=owner, priority=priority,
                                 job_ids=session.job_ids, preempt=preempt, video_id=video_id, video=video)
        except BaseException as e:
            session.unrecord()
            session.close()
            if created:
                _remove_if_ours(request.out_dir)
            raise _full_or(e, request) from e
        farm.log(f"{row.id}: submitted by {owner}: {len(row.job_ids)} job(s) into {out}, priority {priority}")
        farm.serve(row, session, revive_cancelled=True)
        return farm.describe(row.id)

    # ------------------------------------------------------------------ changing a batch
    def pause(self, batch_id: str, *, paused: bool, user: User | None = None) -> dict[str, Any]:
        row = self._row(batch_id, user, "pause" if paused else "unpause")
        row = self._transition(row, BatchEvent.PAUSE if paused else BatchEvent.UNPAUSE,
                               "paused by a client" if paused else "unpaused by a client")
        if (s := self.farm.served.get(row.id)) is not None:
            s.row = row
            s.session.log.line(f"farm: batch {row.id} {'paused: no new job of it starts' if paused else 'unpaused'}")
        return self.farm.describe(row.id)

    def set_priority(self, batch_id: str, priority: int, *, user: User | None = None) -> dict[str, Any]:
        check_priority(priority)
        row = self._row(batch_id, user, "reprioritise")
        row = self.farm.queue.set_priority(row.id, priority)
        if (s := self.farm.served.get(row.id)) is not None:
            s.row = row
            self.farm.scheduler.reorder()
        return self.farm.describe(row.id)

    def cancel(self, batch_id: str, *, job: str | None = None, user: User | None = None) -> dict[str, Any]:
        """The batch (or one of its jobs, by id, unique id prefix or name): queued jobs are cancelled
        now, a sampling in progress stops at its next step, a job past its sampling finishes. In the
        queue and the ledger before the answer: a farm killed meanwhile cancels, not renders, them."""
        row = self._row(batch_id, user, "cancel")
        s = self.farm.served.get(row.id)
        if job is None:
            row = self._transition(row, BatchEvent.CANCEL, "cancelled by a client")
            if s is None:
                return self.farm.describe(row.id)
            s.row = row
            stopped = self.farm.scheduler.cancel(s.batch, None, reason="the batch was cancelled")
        else:
            target = self._job(row, s.session.ledger if s is not None else None, job)
            if target.state in TERMINAL_JOB_STATES:
                raise FarmRequestError(f"job {target.name} ({target.id}) of batch {row.id} is already "
                                       f"{target.state.value}: nothing to cancel, nothing changed", extra={
                                           "job": {"id": target.id, "name": target.name, "state": target.state.value}})
            if s is None:
                raise FarmRequestError(f"batch {row.id} is {row.state.value}: none of its jobs runs or waits (job "
                                       f"{target.name} is {target.state.value}; `retry {row.id}` runs it again)")
            stopped = self.farm.scheduler.cancel(s.batch, [target.id], reason="cancelled by a client")
        s.session.log.line(f"farm: cancel of {'batch ' + row.id if job is None else 'job ' + job}: "
                           f"{len(stopped)} sampling(s) stop at their next step")
        return self.farm.describe(row.id)

    def retry(self, batch_id: str, *, user: User | None = None) -> dict[str, Any]:
        """An ended batch back in the queue: its failed, cancelled and interrupted jobs run again."""
        row = self._row(batch_id, user, "retry")
        if row.id in self.farm.served:
            raise FarmRequestError(f"batch {row.id} is {row.state.value}: it is being served; retry it once it ends")
        if broken := self.farm.broken_model_folders(row):
            raise FarmRequestError(errors.broken_checkpoints(broken, resume=None), status=422)
        if not row.state.ended:
            raise FarmRequestError(f"batch {row.id} is {row.state.value}: only an ended batch can be retried")
        session = BatchSession.reopen(Path(row.out_dir), stream=None, job_ids=row.job_ids,
                                      title=f"farm: retry of batch {row.id} ({{batch}})")
        try:
            row = self._transition(row, BatchEvent.RETRY, "retried by a client")
        except BaseException:
            session.close()
            raise
        self.farm.serve(row, session, revive_cancelled=True)
        return self.farm.describe(row.id)

    def hide(self, batch_id: str, *, user: User | None = None, remove_files: bool = False) -> dict[str, Any]:
        """No longer listed (an ended batch; a video deleted through the API); its folder is kept
        unless ``remove_files`` (then removed whole, ledger included: only a folder the farm made
        for a video, whose every file is its own)."""
        row = self._row(batch_id, user, "delete")
        if not row.state.ended:
            raise FarmRequestError(f"batch {row.id} is {row.state.value}: cancel it or let it end first")
        try:
            row = self.farm.queue.hide(row.id, reason="deleted by a client")
        except QueueError as e:
            raise refused(e) from None
        removed = False
        if remove_files and row.video_id is not None and Path(row.out_dir).is_relative_to(self.farm.videos_root):
            shutil.rmtree(row.out_dir, ignore_errors=True)
            removed = not Path(row.out_dir).exists()
        return self.farm.describe(row.id) | {"files_removed": removed}


def check_priority(priority: object) -> None:
    low, high = PRIORITY_RANGE
    if type(priority) is not int or not low <= priority <= high:
        raise FarmRequestError(f"priority {priority!r}: an integer from {low} to {high} (higher runs first)",
                               status=400)


def _full_or(e: BaseException, request: BatchRequest) -> BaseException:
    """A write refused for space as a 507 that says how much the batch needs; anything else as is."""
    if not disk.is_disk_full(e):
        return e
    need = sum(estimated_bytes(j) for j in request.batch.jobs)
    try:
        free = disk.free_bytes(request.out_dir if request.out_dir.exists() else request.out_dir.parent)
    except OSError:
        free = 0
    return FarmRequestError(f"the disk is full: the batch could not be recorded ({e}); its artifacts need about "
                            f"{need / 2**30:.2f} GiB in {request.out_dir}, {free / 2**30:.2f} GiB is free there. "
                            f"Nothing was recorded: free some space and submit it again", status=507)


def _remove_if_ours(out: Path) -> None:
    """A folder this submit created and failed to record into: removed, so that nothing is left."""
    shutil.rmtree(out, ignore_errors=True)
