"""``pan2-render repair DIR``: rebuild a missing or damaged ledger from what is on disk.

The ledger is the one file an overnight run cannot lose, yet everything it knows is also written
elsewhere: the jobs' specs in the backup copy (``ledger.sqlite.bak``, refreshed once the batch is
recorded and after each job done), in each job's latents (safetensors metadata carries the spec)
and, where outputs carry one, in ``DIR/<job>/params.json``; what is finished in the artifacts
themselves. Repair gathers the specs (backup, then ``--batch``, then the job folders), re-checks
every artifact exactly as ``resume`` does (latents: readable, this spec's hash, finite; video:
decodes to the spec's frame count and size), writes a fresh ledger under a temp name and renames it
into place. The damaged file (and any journal of it) is moved aside, never deleted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from pan2render.durable import fsync_dir
from pan2render.jobs.ledger import BACKUP_NAME, LEDGER_NAME, JobState, Ledger, LedgerError, Stage
from pan2render.jobs.spec import Batch, JobSpec
from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.outputs import PARAMS_NAME
from pan2render.runner.serve.jobflow import JobFlow
from pan2render.runner.serve.steps import PAN2_FLOW

# What a job folder holds that repair reads (a spec) or re-checks (an artifact).
JOB_FILES = (PARAMS_NAME, artifacts.LATENTS_NAME, artifacts.VIDEO_NAME)


@dataclass
class RepairSummary:
    jobs: int = 0
    done: int = 0
    sampled: int = 0  # latents valid, video still to make
    healthy: bool = False  # the ledger needed no repair
    moved_aside: list[str] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)  # where specs came from -> how many

    def describe(self) -> str:
        if self.healthy:
            return f"the ledger is healthy ({self.jobs} job(s)); nothing was changed"
        if not self.jobs:
            return ("no job could be rebuilt: no backup, no job folder with latents or params.json; give "
                    "the batch with --batch BATCH")
        came = ", ".join(f"{n} from {src}" for src, n in self.sources.items())
        aside = f"; the damaged ledger is kept as {', '.join(self.moved_aside)}" if self.moved_aside else ""
        return (f"ledger rebuilt: {self.jobs} job(s) ({came}): {self.done} done (video re-checked), "
                f"{self.sampled} with valid latents, {self.jobs - self.done - self.sampled} to render"
                f"{aside}. `pan2-render resume` finishes the rest")


@dataclass
class _Found:
    spec: JobSpec
    attempts: int = 0
    documents: dict[str, str] = field(default_factory=dict)  # as the backup recorded them


def repair(out_dir: Path, *, batch: Batch | None, retries: int, say: Callable[[str], None],
           flow: JobFlow = PAN2_FLOW) -> RepairSummary:
    """Rebuild ``out_dir``'s ledger (the caller holds the folder lock). Each job's stages are
    re-checked by ``flow``'s declaration (``JobFlow.proven``), as ``resume`` checks them."""
    path = out_dir / LEDGER_NAME
    if path.is_file():
        problem = _ledger_problem(path)
        if problem is None:
            led = Ledger.open_readonly(out_dir)
            try:
                return RepairSummary(jobs=len(led.jobs()), healthy=True)
            finally:
                led.close()
        say(f"{path}: {problem}")
    summary = RepairSummary()
    found, meta = _from_backup(out_dir, summary, say)
    if batch is not None:
        meta = meta or {"path": batch.path, "model": batch.model, "preset": batch.preset}
        _add(found, batch.jobs, "the batch file", summary)
    _add(found, _from_job_folders(out_dir, say), "the job folders", summary)
    if not found:
        return summary

    tmp = out_dir / f".{LEDGER_NAME}.repair-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    fresh = Ledger.open_file(tmp)
    try:
        fresh.set_meta("batch", meta or {"path": None, "model": None, "preset": None})
        if flow.stages != PAN2_FLOW.stages:
            fresh.set_meta("stages", list(flow.stages))
        for item in found.values():
            done, done_stages = flow.proven(out_dir, item.spec)
            state = JobState.DONE if done else JobState.PENDING
            summary.done += done
            summary.sampled += not done and Stage.SAMPLING.value in done_stages
            fresh.restore_job(item.spec, state=state, attempts=item.attempts, retries=retries,
                              stages=done_stages, reason="rebuilt by `pan2-render repair` from the artifacts")
            if state is JobState.DONE:  # the exact text of its params.json, which resume compares
                for name, body in item.documents.items():
                    fresh.set_document(item.spec.job_id, name, body)
    finally:
        fresh.close()
    summary.jobs = len(found)
    _move_aside(path, summary)
    os.replace(tmp, path)
    fsync_dir(out_dir)
    led = Ledger.open(out_dir)
    try:
        led.backup()
    finally:
        led.close()
    return summary


def _ledger_problem(path: Path) -> str | None:
    try:
        led = Ledger.open_file_readonly(path)
    except LedgerError as e:
        return e.problem
    try:
        return None if led.has_batch() else "holds no batch"
    finally:
        led.close()


def _from_backup(out_dir: Path, summary: RepairSummary,
                 say: Callable[[str], None]) -> tuple[dict[str, _Found], dict[str, Any] | None]:
    found: dict[str, _Found] = {}
    path = out_dir / BACKUP_NAME
    if not path.is_file():
        return found, None
    try:
        led = Ledger.open_file_readonly(path)
    except LedgerError as e:
        say(f"the backup {path} is not usable either ({e.problem}); rebuilding from the job folders")
        return found, None
    try:
        meta = led.get_meta("batch")
        for job in led.jobs():
            found[job.id] = _Found(job.spec, attempts=job.attempts, documents=led.documents(job.id))
    finally:
        led.close()
    if found:
        summary.sources["the backup"] = len(found)
    return found, meta


def _add(found: dict[str, _Found], specs: list[JobSpec], source: str, summary: RepairSummary) -> None:
    n = 0
    for spec in specs:
        if spec.job_id not in found:
            found[spec.job_id] = _Found(spec)
            n += 1
    if n:
        summary.sources[source] = n


def _from_job_folders(out_dir: Path, say: Callable[[str], None]) -> list[JobSpec]:
    """Specs recorded beside the artifacts: params.json if present, else the latents' metadata.
    A spec counts only if it names its own folder (its job id is the folder's name)."""
    specs = []
    for folder in sorted(out_dir.iterdir()):
        if folder.name.startswith((".", "_")) or folder.is_symlink() or not folder.is_dir():
            continue
        spec = _spec_from_params(folder / PARAMS_NAME) or _spec_from_latents(folder / artifacts.LATENTS_NAME)
        if spec is None:
            continue
        if spec.job_id != folder.name:
            say(f"{folder}: its recorded spec belongs to job {spec.job_id}, not this folder; skipped")
            continue
        specs.append(spec)
    return specs


_SPEC_FIELDS = {f.name for f in dataclasses.fields(JobSpec)}


def _spec_from_dict(d: Any) -> JobSpec | None:
    """A JobSpec from a dict holding its fields (at the top or under "spec"); None if it does not."""
    if isinstance(d, dict) and isinstance(d.get("spec"), dict):
        d = d["spec"]
    if not isinstance(d, dict):
        return None
    try:
        return JobSpec.from_dict({k: v for k, v in d.items() if k in _SPEC_FIELDS})
    except (TypeError, KeyError, ValueError):
        return None


def _spec_from_params(path: Path) -> JobSpec | None:
    if not path.is_file():
        return None
    try:
        return _spec_from_dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _spec_from_latents(path: Path) -> JobSpec | None:
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get("spec")
        return None if text is None else _spec_from_dict(json.loads(text))
    except (SafetensorError, OSError, ValueError):
        return None


def _move_aside(path: Path, summary: RepairSummary) -> None:
    """The damaged ledger and its journal (which belongs to it: left beside a new ledger, SQLite
    would roll it into that one) move to ``*.damaged-<time>``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for victim in (path, path.with_name(path.name + "-journal")):
        if victim.exists():
            dest = victim.with_name(f"{victim.name}.damaged-{stamp}")
            os.replace(victim, dest)
            summary.moved_aside.append(dest.name)
