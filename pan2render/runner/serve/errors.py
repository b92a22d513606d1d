"""Failures of the environment as one paragraph for the terminal; tracebacks go to a log file.

A user at 3 a.m. needs what happened, to which path or cluster, and what to do, not a stack of
frames from sqlite3 or Ray. :func:`explain` writes that paragraph for every failure the CLI can
meet; :func:`write_log` keeps the traceback where someone debugging can find it.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import tempfile
import time
from pathlib import Path

from pan2render.hints import command
from pan2render.jobs.disk import is_disk_full, sqlite_error_name
from pan2render.jobs.ledger import LedgerError
from pan2render.jobs.outdir import UnsafePathError, create_new, real_dir
from pan2render.runner.protocol.failures import BatchStopped, ClusterLostError

LOG_DIR = "_logs"


class UnrecordedWork(RuntimeError):
    """The folder holds rendered job folders but no ledger that records them: a new batch there
    would render them again over their videos (`repair` first). The message says so."""


class NothingRecorded(RuntimeError):
    """Recording a new batch in the ledger failed: nothing of it was recorded (one transaction)."""

    def __init__(self, cause: BaseException):
        self.cause = cause
        super().__init__(str(cause))


def explain(e: BaseException, *, folder: Path | None, resume: str | None = None) -> str:
    """One paragraph: what happened, where, and what to do. ``resume``: the command that continues
    the batch, where one is recorded to continue; None: the command itself is to be run again."""
    where = str(folder) if folder is not None else "the output folder"
    then = f"`{resume}` continues where the batch stopped" if resume else "run the same command again"
    if isinstance(e, UnrecordedWork):
        return str(e)
    if isinstance(e, NothingRecorded):
        return (f"{explain(e.cause, folder=folder)} Nothing of the batch was recorded in {where}, so no "
                f"command will report any of it as done: once that is fixed, run the same command again.")
    if isinstance(e, BatchStopped):
        return (f"{explain(e.cause, folder=folder, resume=resume)} The batch stopped: the jobs that were running "
                f"went back to pending without being charged an attempt, finished jobs are intact.")
    if isinstance(e, (LedgerError, ClusterLostError, UnsafePathError)):
        return str(e)
    if is_disk_full(e):
        return (f"the disk holding {where} is full ({e}). Free space there (or move the folder to a larger "
                f"disk), then {then}.")
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        path = e.filename or where
        return (f"{path} cannot be written ({e.strerror}): the filesystem is read-only or this user lacks "
                f"permission. Give this user write access to {where}, then {then}.")
    if isinstance(e, sqlite3.Error) and sqlite_error_name(e) in ("SQLITE_BUSY", "SQLITE_LOCKED"):
        return (f"the ledger in {where} stayed locked by another process for longer than its 10 s "
                f"wait ({e}); run the command again in a moment.")
    if isinstance(e, sqlite3.Error):
        repair = f"`{command('repair', where)}`" if folder is not None else "`pan2-render repair DIR`"
        return (f"the ledger in {where} failed ({type(e).__name__}: {e}). If it is damaged, {repair} rebuilds "
                f"it from its backup and the finished artifacts.")
    if isinstance(e, OSError):
        path = f"{e.filename}: " if e.filename else ""
        return f"{path}{e.strerror or e} ({type(e).__name__}). Fix that, then {then}."
    intact = f"Finished jobs are intact; `{resume}` continues." if resume else "Then run the same command again."
    return (f"unexpected {type(e).__name__}: {e}. This is likely a bug in pan2-render: please report it "
            f"with the log named below. {intact}")


def broken_checkpoints(broken: dict[str, list[str]], *, resume: str | None, recorded: bool = True) -> str:
    """The paragraph for checkpoint folders that cannot be loaded (``broken``: folder -> problems):
    no job was started, none was charged. ``resume``: the command that renders the recorded jobs
    once the folder is fixed; None where the farm refused to queue or continue the batch.
    ``recorded=False``: `run` refused the batch before recording it."""
    listed = "; ".join(f"{folder}: " + " / ".join(p.removeprefix(folder).lstrip("/: ") or p for p in problems)
                       for folder, problems in broken.items())
    then = ("nothing was recorded. Fix the folder (or point `model` at a complete one), then run the same command "
            "again." if not recorded else
            f"the jobs stay pending. Fix the folder (or point `model` at a complete one), then `{resume}` renders "
            f"them." if resume is not None else
            "the farm does not serve the batch. Fix the folder (or point `model` at a complete one), then submit "
            "it again (or `pan2-render retry` it, where it was queued).")
    return (f"the checkpoint cannot be loaded ({listed}). No job was started and none was charged an attempt "
            f"(every job would fail its load the same way): {then}")


def write_log(folder: Path | None, text: str) -> Path | None:
    """Write ``text`` (a traceback) to ``DIR/_logs/error-<time>-<pid>.log``, or to the temp folder
    when DIR cannot take it (it may be the full disk). None if nowhere can."""
    name = f"error-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}.log"
    candidates = ([folder / LOG_DIR] if folder is not None and folder.is_dir() else []) + \
                 [Path(tempfile.gettempdir()) / "pan2-render"]
    for log_dir in candidates:
        try:
            log_dir.parent.mkdir(parents=True, exist_ok=True)
            path = real_dir(log_dir) / name
            with os.fdopen(create_new(path), "w") as f:
                f.write(text)
            return path
        except OSError:  # a full disk, no permission, or a link at _logs: the next place
            continue
    return None
