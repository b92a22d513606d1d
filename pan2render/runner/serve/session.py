"""A batch served in its output folder, by `run`, `resume` or the farm: the one place that records a
batch in its ledger and holds the folder while the scheduler serves it.

A :class:`BatchSession` holds ``DIR/.lock`` (so no other process writes the folder), the ledger,
the run log (``DIR/run.log``) and the report that is kept current as jobs end. ``record`` writes a
validated batch (:class:`BatchRequest`, what a client asks for) into the ledger in one
transaction; ``reopen`` continues what a ledger already holds. Either way the ledger stays the
truth for the batch: ``status``, ``show``, ``report`` and ``resume DIR`` work with or without a farm.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pan2render.hints import command
from pan2render.jobs import disk
from pan2render.jobs.ledger import (
    BACKUP_NAME,
    LEDGER_NAME,
    TERMINAL_JOB_STATES,
    EventKind,
    FolderLock,
    JobEvent,
    JobState,
    Ledger,
    Stage,
)
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import Batch, JobSpec
from pan2render.long_video import video_frames
from pan2render.model_files import folder_problems
from pan2render.runner.protocol import artifacts, outputs
from pan2render.runner.protocol.artifacts import CANCEL_DOC
from pan2render.runner.serve import errors
from pan2render.runner.serve.errors import UnrecordedWork
from pan2render.runner.serve.progress import RUN_LOG_NAME, RunLog
from pan2render.tiny_dit import TINY_MODEL


@dataclass(frozen=True)
class BatchRequest:
    """A validated batch to render into ``out_dir`` (an absolute path), with the flags it was given.
    Validation happens where the batch is read (the client), so a bad batch never reaches a farm."""

    out_dir: Path
    batch: Batch
    overrides: Overrides
    retries: int = 2
    prune: bool = False  # drop the folder's jobs that are not in this batch and not done

    def to_json(self) -> dict[str, Any]:
        b = self.batch
        return {"out_dir": str(self.out_dir), "retries": self.retries, "overrides": self.overrides.to_json(),
                "prune": self.prune,
                "batch": {"path": b.path, "model": b.model, "preset": b.preset, "weights_files": b.weights_files,
                          "text": b.text, "jobs": [j.to_dict() for j in b.jobs]}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BatchRequest:
        b = d["batch"]
        batch = Batch(path=b["path"], model=b["model"], preset=b["preset"], weights_files=b.get("weights_files") or {},
                      jobs=[JobSpec.from_dict(j) for j in b["jobs"]], text=b.get("text"))
        return cls(out_dir=Path(d["out_dir"]), batch=batch, overrides=Overrides.from_json(d.get("overrides")),
                   retries=int(d.get("retries", 2)), prune=bool(d.get("prune", False)))


def prepare_jobs(*, out_dir: Path, ledger: Ledger, job_ids: list[str], retries: int,
                 say: Callable[[str], None], revive_cancelled: bool = False) -> None:
    """Bring the named jobs to a runnable state (idempotent; needs no workers): a job a client
    cancelled while it ran (its cancel recorded, the driver stopped before the job did) cancelled,
    interrupted ones back to pending, failed ones (and cancelled ones when ``revive_cancelled``:
    the batch is run again, or retried, by whoever cancelled it) revived with a fresh retry budget,
    done ones whose video no longer checks out (missing, size/sha256 mismatch, does not decode)
    invalidated back to decode."""
    asked = ledger.with_document(CANCEL_DOC)
    for job in ledger.jobs(job_ids):
        if job.id in asked:
            if job.state not in TERMINAL_JOB_STATES:
                ledger.transition(job.id, JobEvent.CANCEL, reason=f"{asked[job.id]} (the cancel was recorded before "
                                                                  f"the previous driver stopped)")
                job = ledger.job(job.id)
            ledger.delete_document(job.id, CANCEL_DOC)
        if job.state is JobState.RUNNING:
            ledger.transition(job.id, JobEvent.INTERRUPT, reason="the previous driver stopped while this job ran")
        elif job.state is JobState.FAILED or (job.state is JobState.CANCELLED and revive_cancelled):
            ledger.transition(job.id, JobEvent.REVIVE, retries=retries,
                              reason=f"resumed: a {job.state.value} job gets a fresh retry budget")
        elif job.state is JobState.DONE:
            rec = ledger.stages(job.id)[Stage.ENCODE]
            problem = artifacts.check_video(out_dir, artifacts.recorded(rec), frames=video_frames(job.spec),
                                            width=job.spec.width, height=job.spec.height)
            if problem:
                # Stages first: a crash between the two writes leaves a done job whose video is
                # checked again next time, never a pending job whose encode stage claims done.
                ledger.reset_stages(job.id, Stage.DECODE, reason=problem)
                ledger.transition(job.id, JobEvent.INVALIDATE, reason=problem)
                say(f"{job.name}: {problem}; encoding it again")
            elif fixed := outputs.restore_params(out_dir, ledger, job):
                ledger.log(job.id, EventKind.PARAMS_REWRITTEN, fixed)
                say(f"{job.name}: {fixed}; rewritten")



class BatchSession:
    """One output folder held for serving its batch: the lock, the ledger, the run log. Close it
    (or use it as a context manager) when the batch is served; the lock is released last."""

    def __init__(self, out_dir: Path, *, lock: FolderLock, ledger: Ledger, log: RunLog, job_ids: list[str],
                 flags: list[str]):
        self.out_dir = out_dir
        self.lock = lock
        self.ledger = ledger
        self.log = log
        self.job_ids = job_ids
        self.flags = flags
        self.added: list[str] = []  # the jobs `record` added to the ledger

    # ------------------------------------------------------------------ opening
    @classmethod
    def record(cls, request: BatchRequest, *, stream: TextIO | None, title: str) -> BatchSession:
        """Hold ``request.out_dir`` and record the batch in its ledger (one transaction); ``title``:
        the run log's first line (the command as typed). ``stream``: where the log's lines also go
        (None: the run log alone)."""
        out, batch, overrides = request.out_dir, request.batch, request.overrides
        out.mkdir(parents=True, exist_ok=True)
        lock = FolderLock(out)
        lock.acquire()
        try:
            if (why := unrecorded_work(out)) is not None:
                raise UnrecordedWork(why)
            try:
                ledger = Ledger.open(out)
            except Exception as e:  # told apart by errors.explain
                raise errors.NothingRecorded(e) from e
            log = RunLog(out / RUN_LOG_NAME, stream=stream)
        except BaseException:
            lock.release()
            raise
        session = cls(out, lock=lock, ledger=ledger, log=log, job_ids=[j.job_id for j in batch.jobs],
                      flags=overrides.flags())
        try:
            previous = ledger.get_meta("batch") or {}
            try:
                added, present = ledger.record_batch(
                    {"path": batch.path, "model": batch.model, "preset": batch.preset,
                     "weights_files": batch.weights_files, "overrides": overrides.to_json()},
                    batch.jobs, retries=request.retries)
            except Exception as e:
                raise errors.NothingRecorded(e) from e
            session.added = added
            log.line(title)
            keep_batch_copy(out, ledger, batch, overrides.flags(), log)
            warn_if_no_backup(ledger, log)
            new = set(added)
            n_old = note_superseded(ledger, batch, new, previous.get("weights_files") or {}, log)
            if request.prune:
                prune_jobs(ledger, keep={j.job_id for j in batch.jobs}, log=log)
            # The batch's own specs are the ones just recorded for its new jobs.
            warn_if_short_of_space(out, [s for s in batch.jobs if s.job_id in new], log)
            n_done = sum(state is JobState.DONE for state in ledger.job_states(present).values())
            log.line(f"{out}: {len(added)} new job(s)" + (f" ({n_old} superseding an older version)" if n_old else "")
                     + f", {len(present)} already in the ledger ({n_done} done, skipped unless their video is "
                     f"corrupt); log: {out / RUN_LOG_NAME}")
        except BaseException:
            session.close()
            raise
        return session

    @classmethod
    def reopen(cls, out_dir: Path, *, stream: TextIO | None, title: str,
               job_ids: list[str] | None = None) -> BatchSession:
        """Hold a folder whose ledger holds a batch, to continue it (``job_ids``: those of it to
        serve, default every job in the ledger)."""
        lock = FolderLock(out_dir)
        lock.acquire()
        try:
            ledger = Ledger.open(out_dir)
        except BaseException:
            lock.release()
            raise
        log = RunLog(out_dir / RUN_LOG_NAME, stream=stream)
        batch = ledger.get_meta("batch", {}) or {}
        # The recorded specs are the batch as run, --set/--sweep applied: serving them repeats them.
        flags = Overrides.from_json(batch.get("overrides")).flags()
        jobs = ledger.jobs(job_ids)  # (every job when None)
        ids = job_ids if job_ids is not None else [j.id for j in jobs]
        session = cls(out_dir, lock=lock, ledger=ledger, log=log, job_ids=ids, flags=flags)
        described = f"{batch.get('path', '?')} {' '.join(flags)}".strip()
        log.line(title.format(batch=described))
        warn_if_short_of_space(out_dir, [j.spec for j in jobs if j.state is not JobState.DONE], log)
        return session

    # ------------------------------------------------------------------ serving
    def prepare(self, *, retries: int, revive_cancelled: bool = False) -> bool:
        """Bring the jobs to a runnable state (see prepare_jobs); True when every one has
        ended (done with its video intact, or cancelled and kept so), so no worker is needed."""
        prepare_jobs(out_dir=self.out_dir, ledger=self.ledger, job_ids=self.job_ids, retries=retries,
                     say=self.log.line, revive_cancelled=revive_cancelled)
        return all(s in (JobState.DONE, JobState.CANCELLED) for s in self.ledger.job_states(self.job_ids).values())

    def unrecord(self) -> None:
        """Take back what ``record`` added (its jobs), when what was to follow it failed (the farm
        could not queue the batch): best effort, as the disk that refused that may refuse this."""
        try:
            if self.added:
                self.ledger.drop_jobs(self.added, reason="the batch could not be queued; nothing of it was kept")
        except Exception as e:  # the answer says the batch was refused; the log says what stayed
            self.log.line(f"warning: the jobs just recorded could not be taken back ({type(e).__name__}: {e})")

    def note_run(self, *, command: str, gpus: int, cpu_gpus: int | None = None) -> None:
        """The ledger's list of runs (`status` shows the last: who serves the folder, with which flags;
        `resume` takes the logical GPUs of the last, ``cpu_gpus``, when given none)."""
        self.ledger.set_meta("runs", [*self.ledger.get_meta("runs", []), {
            "command": command, "started": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
            "flags": self.flags, "gpus": gpus, "cpu_gpus": cpu_gpus}])

    def counts(self) -> dict[str, int]:
        states = list(self.ledger.job_states(self.job_ids).values())  # (the farm publishes them twice a second)
        return {state.value: states.count(state) for state in JobState} | {"total": len(states)}

    def close(self) -> None:
        try:
            self.log.close()
            self.ledger.close()
        finally:
            self.lock.release()

    def __enter__(self) -> BatchSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def note_superseded(ledger: Ledger, batch: Batch, added: set[str], old_files: dict[str, Any], log: RunLog) -> int:
    """Each new job that is a new version of one the folder holds (the same name and sweep values,
    another id: the batch was edited, or the checkpoint replaced in place) is named, with what
    changed, in the ledger and here. Returns how many."""
    # The newest version of each; only the jobs recorded before are read (none in a new folder).
    old = {j.spec.version_key: j for j in ledger.jobs([i for i in ledger.job_states() if i not in added])}
    found = [(prev.id, spec.job_id, _what_changed(spec, prev.spec, old_files, batch.weights_files))
             for spec in batch.jobs if spec.job_id in added and (prev := old.get(spec.version_key)) is not None]
    if found:  # in one transaction: a batch edited and run again supersedes every job of it
        ledger.log_many([(prev, EventKind.SUPERSEDED, f"by {new}: {why}") for prev, new, why in found])
    for prev, new, why in found[:SUPERSEDED_SHOWN]:
        log.line(f"{prev} is superseded by {new}: {why}")
    n = len(found)
    if n > SUPERSEDED_SHOWN:
        log.line(f"... and {n - SUPERSEDED_SHOWN} more superseded job(s) (`{command('status', ledger.path.parent)}` "
                 f"marks each)")
    return n


SUPERSEDED_SHOWN = 20  # lines naming superseded jobs; the rest are counted (status marks every one)


def _what_changed(new: JobSpec, old: JobSpec, old_files: dict[str, Any], new_files: dict[str, Any]) -> str:
    """What made ``new`` another job than ``old``, for a person: fields with their values, the
    weights with the files that changed."""
    parts = []
    for name, before, after in new.changes_from(old):
        if name == "weights":
            changed = sorted(r for r in set(old_files) | set(new_files) if old_files.get(r) != new_files.get(r))
            files = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            # Folders recorded before the digest covered every byte hold sampled fingerprints: their
            # jobs are superseded by the new digest alone, whether or not the weights changed.
            if any("sampled_sha256" in (fp or {}) for fp in old_files.values()):
                parts.append(f"the weights' digest of {new.model} now covers every byte (it sampled each file before)")
            else:
                parts.append(f"the weights in {new.model} changed" + (f" ({files})" if files else ""))
        elif name == "image_sha256":
            parts.append("the image's content changed")
        elif name == "lora_digests":
            parts.append("a LoRA file's content or scale changed")
        else:
            parts.append(f"{name} {_shown(before)} -> {_shown(after)}")
    return ", ".join(parts) or "its spec changed"


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


BATCHES_DIR = "_batches"  # DIR/_batches/NNN-<stem>.yaml: each batch file the folder was run with


def keep_batch_copy(out: Path, ledger: Ledger, batch: Batch, flags: list[str], log: RunLog) -> None:
    """Keep a copy of the batch file (as read) and its flags in ``DIR/_batches/``, written atomically,
    and list it in the ledger (meta ``batches``, which `status` and the report show). The same
    file with the same flags as the last one kept is not copied again."""
    from pan2render.runner.protocol.artifacts import sha256_bytes, write_artifact

    kept = ledger.get_meta("batches", []) or []
    data = (batch.text or "").encode()
    digest = sha256_bytes(data) if batch.text is not None else None
    entry = {"path": batch.path, "flags": flags, "sha256": digest, "at": time.time()}
    if kept and all(kept[-1].get(k) == entry[k] for k in ("path", "flags", "sha256")):
        return
    copy = None
    if batch.text is not None:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(batch.path).stem)[:60].strip("-.") or "batch"
        copy = f"{BATCHES_DIR}/{len(kept) + 1:03d}-{stem}.yaml"
        try:
            write_artifact(out, copy, data)
            write_artifact(out, copy.removesuffix(".yaml") + ".json",
                           (json.dumps({"batch": batch.path, "flags": flags, "sha256": digest,
                                        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                       indent=1) + "\n").encode())
        except OSError as e:  # a record for the user, never worth the batch
            log.line(f"warning: the copy of the batch file could not be kept in {out / BATCHES_DIR}: {e}")
            copy = None
    ledger.set_meta("batches", [*kept, {**entry, "copy": copy}])


def prune_jobs(ledger: Ledger, *, keep: set[str], log: RunLog) -> None:
    """``run --prune``: the folder's jobs that are not in the batch and not done are dropped from
    the ledger (their folders stay on disk), so `resume` no longer renders them."""
    drop = [j for j in ledger.jobs() if j.id not in keep and j.state is not JobState.DONE]
    if not drop:
        log.line("--prune: every job of the folder that is not done is in this batch; nothing dropped")
        return
    ledger.drop_jobs([j.id for j in drop], reason="not in the batch of `run --prune`")
    names = ", ".join(j.id for j in drop[:10]) + (f" and {len(drop) - 10} more" if len(drop) > 10 else "")
    log.line(f"--prune: dropped {len(drop)} job(s) no longer in the batch ({names}); done jobs are kept")


def warn_if_no_backup(ledger: Ledger, log: RunLog) -> None:
    """The ledger's backup is taken quietly (its failure never fails a job); say when it failed."""
    if ledger.backup_error:
        log.line(f"warning: the ledger's backup could not be written ({ledger.backup_error}); `repair` would "
                 f"have only the job folders to rebuild it from")


def warn_if_short_of_space(out: Path, jobs: list[JobSpec], log: RunLog) -> None:
    """Before starting: warn (only) when the unfinished jobs' artifacts may not fit. An estimate:
    each write is checked against its real size, and a full disk stops the batch cleanly."""
    from pan2render.runner.protocol.artifacts import estimated_bytes

    need = sum(estimated_bytes(spec) for spec in jobs)
    free = disk.free_bytes(out)
    if need + disk.HEADROOM_BYTES > free:
        log.line(f"warning: {len(jobs)} job(s) need about {need / 2**30:.2f} GiB in {out} but only "
                 f"{free / 2**30:.2f} GiB is free; the batch will stop when the disk fills (`resume` "
                 f"continues once space is freed)")


def model_folder_problems(specs: list[JobSpec]) -> dict[str, list[str]]:
    """Checkpoint folder -> every reason its load would fail (from its files alone, no weights
    read), for the folders the jobs name that have any. Checked once per batch before any job
    starts: a broken folder would fail every job's load the same way."""
    models = sorted({s.model for s in specs if s.model != TINY_MODEL})
    found = {m: folder_problems(Path(m)) for m in models}
    return {m: problems for m, problems in found.items() if problems}


def recorded(out: Path | None) -> bool:
    """Does ``out`` hold a ledger with a recorded batch (so that `resume` has something to do)?"""
    if out is None or not (out / LEDGER_NAME).is_file() or (out / LEDGER_NAME).stat().st_size == 0:
        return False  # (an empty file is what SQLite calls an empty database)
    try:
        ledger = Ledger.open_readonly(out)
    except Exception:  # damaged or unreadable: its own message says what to do
        return True
    try:
        return ledger.has_batch()
    finally:
        ledger.close()


def unrecorded_work(out: Path) -> str | None:
    """Why ``run`` must not start in ``out``: its ledger is gone or holds no batch, yet job folders
    with artifacts are there (a ledger deleted or emptied). A run would record a new batch and
    render those jobs again over their videos; `repair` rebuilds the ledger from them. None when
    there is nothing of the kind."""
    from pan2render.runner.serve.repair import JOB_FILES  # numpy, safetensors

    if recorded(out) or not out.is_dir():
        return None
    folders = sorted(f.name for f in out.iterdir()
                     if not f.name.startswith((".", "_")) and not f.is_symlink() and f.is_dir()
                     and any((f / name).is_file() for name in JOB_FILES))
    backup = (out / BACKUP_NAME).is_file() and not (out / BACKUP_NAME).is_symlink()
    if not folders and not backup:
        return None
    found = " and ".join(([f"{len(folders)} job folder(s) with rendered artifacts (e.g. {folders[0]})"] if folders
                          else []) + ([f"the ledger's backup {BACKUP_NAME}"] if backup else []))
    return (f"{out} holds {found}, but its ledger {LEDGER_NAME} is missing or holds no batch (deleted or emptied): "
            f"a run now would render those jobs again over their videos. `{command('repair', out)}` rebuilds the "
            f"ledger from them (with `--batch BATCH` for jobs that left nothing on disk); then run again. "
            f"Nothing was written.")
