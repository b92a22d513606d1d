"""Text views of a batch and an output folder for the CLI: the plan of a dry run, ``show`` (one
job's whole history) and ``status`` (every job, with elapsed time and an ETA). All read-only."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pan2render.hints import command
from pan2render.jobs.after import waiting_for
from pan2render.jobs.ledger import Event, EventKind, FolderLock, JobRecord, JobState, Ledger, StageState, stage_name
from pan2render.jobs.spec import JobSpec
from pan2render.runner.views.estimates import JobEstimate, Plan
from pan2render.runner.views.eta import BatchEta
from pan2render.runner.views.format import duration, table
from pan2render.runner.views.job_status import (
    INTERRUPTED,
    JobStatus,
    counts_lines,
    job_statuses,
    long_video_of,
    long_video_text,
    preview_of,
    shown_error,
    shown_state,
)

# ---------------------------------------------------------------------------------------- tables

def sweep_keys(specs: list[JobSpec]) -> list[str]:
    """The swept fields of a batch, in first-seen order: one column each."""
    return list(dict.fromkeys(k for s in specs for k in s.sweep))


def _value(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def format_plan(jobs: list[JobSpec], *, done: set[str], the_plan: Plan) -> str:
    """A dry run's table: one row per job, the swept fields as columns, and the estimate."""
    keys = sweep_keys(jobs)
    fixed = [k for k in ("steps", "guidance", "gpus") if k not in keys]  # a swept one has its column
    est = {e.job.job_id: e for e in the_plan.estimates}
    rows = []
    for j in jobs:
        e = est.get(j.job_id)
        rows.append([j.job_id, *(_value(j.sweep.get(k, "")) for k in keys), f"{j.width}x{j.height}x{j.frames}",
                     *(_value(getattr(j, k)) for k in fixed),
                     "done, skip" if j.job_id in done else _job_estimate(e)])
    return table(["id", *keys, "size", *fixed, "est. GPU time"], rows)


def _job_estimate(e: JobEstimate | None) -> str:
    if e is None or e.times is None:
        return "?"
    return ("~" if e.source == "reference" else "") + duration(e.gpu_seconds)


def format_estimate(the_plan: Plan, *, gpus_note: str) -> str:
    """The estimate's two lines: the figures (a guess's range where the reference table gave
    them), then which figures they came from."""
    n = len(the_plan.estimates)
    if not n:
        return "estimate: nothing to render"
    if len(the_plan.unknown) == n:
        return f"estimate: none for the {n} job(s)\n  from: {the_plan.sources()}"
    low, high = the_plan.spread
    guess = "" if (low, high) == (1.0, 1.0) else "~"
    rng = "" if not guess else (f" (a guess: {duration(the_plan.gpu_seconds * low)} to "
                                f"{duration(the_plan.gpu_seconds * high)})")
    unknown = f", {len(the_plan.unknown)} job(s) not counted" if the_plan.unknown else ""
    return (f"estimate: {n} job(s), GPU time {guess}{duration(the_plan.gpu_seconds)}{rng}, wall time "
            f"~{duration(the_plan.wall_seconds)} on {the_plan.gpus} GPU(s) ({gpus_note}){unknown}\n"
            f"  from: {the_plan.sources()}")


# ---------------------------------------------------------------------------------------- show
class JobNotFound(LookupError):
    """``show``'s JOB matches no job, or several."""


def find_job(ledger: Ledger, query: str) -> JobRecord:
    """A job by its id, a unique id prefix, or its name when one job has it."""
    jobs = ledger.jobs()
    for match in ([j for j in jobs if j.id == query], [j for j in jobs if j.id.startswith(query)],
                  [j for j in jobs if j.name == query]):
        if len(match) == 1:
            return match[0]
        if len(match) > 1:
            listed = ", ".join(j.id for j in match[:8]) + (" ..." if len(match) > 8 else "")
            raise JobNotFound(f"{query!r} matches {len(match)} jobs ({listed}); give more of the id")
    raise JobNotFound(f"no job {query!r} in {ledger.path.parent} (an id, a unique id prefix, or a unique "
                      f"name; `{command('status', ledger.path.parent)}` lists them)")


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


@dataclass
class _Attempt:
    started: float
    on: str
    ended: str = "still running, or the driver stopped"
    traceback: str | None = None


def _attempts(events: list[Event]) -> list[_Attempt]:
    """Attempts from the job's events: each ``pending->running`` opens one, the next transition out
    of ``running`` closes it; the traceback event that follows a failure belongs to it."""
    out: list[_Attempt] = []
    for e in events:
        if e.started:
            out.append(_Attempt(started=e.at, on=e.detail))
        elif (ended := e.ended()) is not None and out:
            out[-1].ended = f"{ended.value} at {_when(e.at)}: {e.detail}"
        elif e.kind is EventKind.TRACEBACK and out:
            out[-1].traceback = e.detail
    return out


def format_show(out_dir: Path, ledger: Ledger, job: JobRecord) -> str:
    lines = [f"job      {job.id}", f"name     {job.name}",
             f"state    {job.state.value}" + (f" (stage {job.error_stage})" if job.error_stage else "")
             + f", {job.attempts} attempt(s), {job.retries_left} retries left",
             f"folder   {out_dir.absolute() / job.id}"]
    if job.error:
        lines.append(f"error    {job.error}")
    if job.state is JobState.PENDING and (waits := waiting_for(ledger.jobs()).get(job.id)):
        each = "each" if len(waits) > 1 else "that"
        lines.append(f"waits    after: {', '.join(waits)} (it starts once every job of {each} name is done)")
    at = next((stage_name(s) for s, r in ledger.stages(job.id).items() if r.state is not StageState.DONE), None)
    if at is not None and (progress := job_progress(ledger, job.id, job.state.value, at,
                                                    segments=job.spec.segments)) is not None:
        lines.append(f"progress {stage_text(at, progress)}")
    if (long := long_video_text(long_video_of(out_dir, job))):
        lines.append(f"video    {long}")
    if job.state is not JobState.DONE and (preview := preview_of(out_dir, job.id)) is not None:
        lines.append(f"preview  {preview['path']} (step {preview['step']}/{preview['steps']})")
    spec = job.spec.to_dict()
    source = spec.pop("source")
    lines.append("spec" + (f" (from {source['file']}:{source['line']})" if source else "") + ":")
    lines += [f"  {k:16} {json.dumps(v)}" for k, v in spec.items()]
    lines.append("stages:")
    st = ledger.stages(job.id)
    rows = []
    for s, r in st.items():
        art = "" if not r.artifact else f"{r.artifact} ({r.size} bytes)"
        rows.append([f"  {stage_name(s)}", r.state.value, "-" if r.seconds is None else f"{r.seconds:.2f} s", art,
                     (r.error or "").splitlines()[0][:120] if r.error else ""])
    lines.append(table(["  stage", "state", "seconds", "artifact", "error"], rows))
    events = ledger.events(job.id)
    attempts = _attempts(events)
    lines.append(f"attempts ({len(attempts)}):")
    for i, a in enumerate(attempts, 1):
        lines.append(f"  {i}. started {_when(a.started)} {a.on}; ended {a.ended}")
        if a.traceback:
            lines += [f"     | {t}" for t in a.traceback.rstrip().splitlines()]
    # The last failure's traceback also sits on its stage row (e.g. one from before this history).
    shown = {a.traceback for a in attempts}
    for s, r in st.items():
        tb = r.traceback
        if tb and tb not in shown:
            lines.append(f"  traceback of the failed {stage_name(s)} stage:")
            lines += [f"     | {t}" for t in tb.rstrip().splitlines()]
    lines.append(f"events ({len(events)}):")
    lines += [f"  {_when(e.at)}  {e.label:18} {e.detail.splitlines()[0] if e.detail else ''}"
              for e in events if e.kind is not EventKind.TRACEBACK]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- status
def holder(out_dir: Path) -> dict[str, Any] | None:
    """The live run holding the folder (its holder line: pid, host, started), or None."""
    return FolderLock.holder(out_dir)


def format_status(out_dir: Path, ledger: Ledger) -> tuple[str, int]:
    """The status table and status's exit code (:func:`status_code`)."""
    records = ledger.jobs()
    statuses = job_statuses(out_dir, ledger, records)
    jobs = {j.id: j for j in records}
    keys = sweep_keys([j.spec for j in jobs.values()])
    rows = []
    for r in statuses:
        spec = jobs[r.id].spec
        secs = sum(v for v in r.seconds.values() if v)
        video = os.path.relpath(r.video, out_dir.absolute()) if r.video else ""
        if r.long_video is not None:
            video = f"{video} ({long_video_text(r.long_video)})".strip()
        stage = stage_text(r.stage, job_progress(ledger, r.id, r.state, r.stage,
                                                 segments=spec.segments)) if r.stage else "-"
        if r.after:  # a pending job that cannot start yet: what it waits for
            stage = f"after: {', '.join(r.after)}"
        rows.append([shown_state(r), stage, str(r.attempts), r.id, *(_value(spec.sweep.get(k, "")) for k in keys),
                     f"{secs:.1f}" if secs else "-", video, shown_error(r, 80)])
    text = table(["state", "stage", "att", "id", *keys, "seconds", "video", "error"], rows)
    return "\n".join([_run_line(out_dir, ledger, jobs, statuses), text, *counts_lines(statuses)]), \
        status_code(statuses)


def status_document(out_dir: Path, ledger: Ledger) -> tuple[dict[str, Any], int]:
    """``status --json``: the folder's run (state, elapsed, ETA, flags), the batch files run there,
    counts, and every job with its swept values and progress; and status's exit code."""
    records = ledger.jobs()
    statuses = job_statuses(out_dir, ledger, records)
    jobs = {j.id: j for j in records}
    run = _run_state(out_dir, ledger, jobs)
    counts = {s: sum(r.state == s for r in statuses) for s in [*(s.value for s in JobState), INTERRUPTED]}
    code = status_code(statuses)
    return {
        "folder": str(out_dir.absolute()),
        "batch": (ledger.get_meta("batch", {}) or {}).get("path"),
        "batches": ledger.get_meta("batches", []) or [],
        "run": None if run is None else {
            "state": "running" if run.live is not None else "not running",
            "pid": (run.live or {}).get("pid"), "host": (run.live or {}).get("host"),
            "started_at": run.started, "elapsed_s": round(run.elapsed_s, 3),
            "eta_s": None if run.eta is None else round(run.eta.wall_seconds, 3),
            "eta_from": None if run.eta is None else run.eta.sources(), "flags": run.flags,
            "command": run.command},
        "counts": {**counts, "total": len(statuses), "superseded": sum(r.superseded_by is not None for r in statuses)},
        "exit_code": code,
        "jobs": [{**r.to_json(), "sweep": jobs[r.id].spec.sweep,
                  "progress": job_progress(ledger, r.id, r.state, r.stage, segments=jobs[r.id].spec.segments)}
                 for r in statuses],
    }, code


def job_progress(ledger: Ledger, job_id: str, state: str, stage: str | None, *,
                 segments: int = 1) -> dict[str, Any] | None:
    """Where a sampling stands: a chained job's segment (of ``segments``), its step as the run last
    recorded it (while the job runs) and its step checkpoint, which a stopped sampling continues
    from; None when none applies."""
    from pan2render.runner.protocol.artifacts import SAMPLING_STEP_DOC, STEP_CHECKPOINT_DOC

    if stage != "sampling":
        return None
    out: dict[str, Any] = {}
    if segments > 1:
        done = (long_video_of(ledger.path.parent, ledger.job(job_id)) or {}).get("segments_done", 0)
        out.update(segment=min(done + 1, segments), segments=segments)
    if state == JobState.RUNNING.value and (doc := ledger.document(job_id, SAMPLING_STEP_DOC)) is not None:
        out.update(json.loads(doc))
    if (doc := ledger.document(job_id, STEP_CHECKPOINT_DOC)) is not None:
        rec = json.loads(doc)
        out["checkpoint_step"] = rec["step"]
        out.setdefault("steps", rec["total"])
        # A checkpoint is recorded as its step is reached, the step at most every 5 s: a sampling
        # is at least where its checkpoint is (one it does not continue from is dropped before it
        # starts, BatchFlow.step_checkpoint), never behind it.
        if "step" in out and out["step"] < rec["step"]:
            out["step"] = rec["step"]
    return out or None


def stage_text(stage: str, progress: dict[str, Any] | None) -> str:
    """``sampling 37/50 (checkpoint at 30)``, ``sampling segment 2/3 37/50``, or the stage alone."""
    if progress is None:
        return stage
    segment = f" segment {progress['segment']}/{progress['segments']}" if "segment" in progress else ""
    steps = f" {progress['step']}/{progress['steps']}" if "step" in progress else ""
    ckpt = f" (checkpoint at {progress['checkpoint_step']})" if "checkpoint_step" in progress else ""
    return f"{stage}{segment}{steps}{ckpt}"


EXIT_DONE, EXIT_FAILED, EXIT_UNFINISHED = 0, 1, 4
FARM = "farm"  # the runs meta's command of a batch a farm served (runner/farm/service.py notes it)


def status_code(statuses: list[JobStatus]) -> int:
    """What ``status`` exits with (the README's table): 0 every job done, 1 a job failed or a done
    job's video is missing or damaged, 4 not finished (jobs pending, running or interrupted, none
    failed). Versions superseded by a newer one of the same job do not count."""
    current = [r for r in statuses if r.superseded_by is None]
    if any(r.state == JobState.FAILED.value or r.problem for r in current):
        return EXIT_FAILED
    if any(r.state != JobState.DONE.value for r in current):
        return EXIT_UNFINISHED
    return EXIT_DONE


def batch_copies(ledger: Ledger) -> list[str]:
    """Each batch file the folder was run with, as its copy in DIR/_batches/ and its flags."""
    return [" ".join([b.get("copy") or f"{b.get('path')} (not kept)", *b.get("flags", [])])
            for b in ledger.get_meta("batches", []) or []]


def batches_kept(ledger: Ledger) -> str | None:
    copies = batch_copies(ledger)
    return f"batch files run here (copies): {'; '.join(copies)}" if copies else None


@dataclass(frozen=True)
class _RunState:
    """The folder's last run, as status shows it."""

    started: float
    elapsed_s: float
    flags: list[str]
    live: dict[str, Any] | None  # the holder's line (pid, host) while a run holds the folder
    eta: Plan | None  # while a run holds it and jobs are left
    command: str = "run"  # what served it: run, resume, or farm (a farm's queue)


def _run_state(out_dir: Path, ledger: Ledger, jobs: dict[str, JobRecord]) -> _RunState | None:
    runs = ledger.get_meta("runs", [])
    if not runs:
        return None
    last = runs[-1]
    live = holder(out_dir)
    started = float(last["started"])
    events = ledger.events()
    end = time.time() if live is not None else (events[-1].at if events else started)
    # The batch's one ETA, as the run (or farm) serving it computes it (views/eta.py).
    eta = None if live is None else BatchEta(out_dir, None, gpus=int(last.get("gpus") or 1)).plan(
        ledger, list(jobs.values()))
    return _RunState(started=started, elapsed_s=end - started, flags=list(last.get("flags", [])), live=live, eta=eta,
                     command=str(last.get("command") or "run"))


def _run_line(out_dir: Path, ledger: Ledger, jobs: dict[str, JobRecord], statuses: list[JobStatus]) -> str:
    run = _run_state(out_dir, ledger, jobs)
    flags = " ".join(run.flags) if run else ""
    head = f"{out_dir}: batch {ledger.get_meta('batch', {}).get('path', '?')}" + (f" {flags}" if flags else "")
    if (kept := batches_kept(ledger)) is not None:
        head += f"; {kept}"
    if run is None:
        return head
    live = run.live
    state = "not running" if live is None else \
        f"running (pid {live.get('pid', '?')} on {live.get('host', '?')})" if live else "running"
    line = f"{head}\n{state}; last run started {_when(run.started)}, elapsed {duration(run.elapsed_s)}"
    interrupted = sum(r.state == INTERRUPTED for r in statuses)
    if interrupted and run.command == FARM:
        line += (f"; {interrupted} job(s) interrupted (the farm serving the batch stopped while they ran): "
                 f"`{command('farm', 'start')}` (with that farm's --root) continues the batch from its queue; "
                 f"`{command('resume', out_dir)}` would render it here, outside the farm")
    elif interrupted:
        line += (f"; {interrupted} job(s) interrupted (the run stopped while they ran): "
                 f"`{command('resume', out_dir)}` continues")
    if run.eta is not None:
        line += f", ETA ~{duration(run.eta.wall_seconds)} ({run.eta.sources()})"
    return line
