"""Where each job of an output folder stands, as ``status`` shows it (and ``status --json``,
the report and the farm's monitor read it): one row per job, read-only on the ledger, cheap
enough for hundreds of jobs (a done job's video is checked for presence and size, not decoded)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pan2render.jobs.after import waiting_for
from pan2render.jobs.ledger import (
    FolderLock,
    JobRecord,
    JobState,
    Ledger,
    Stage,
    StageRecord,
    StageState,
    stage_name,
    superseded,
)
from pan2render.long_video import is_long, video_fps, video_frames
from pan2render.preview_file import read_preview
from pan2render.runner.protocol import artifacts as st

# The state shown for a job the ledger calls running when no run holds the folder: its run was
# stopped or killed while it ran (`resume` continues it).
INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class JobStatus:
    id: str
    name: str
    state: str  # a JobState's value, or INTERRUPTED
    # done: "encode"; failed: the failing stage (None: it never ran); else the first unfinished stage
    stage: str | None
    attempts: int
    error: str | None
    video: str | None  # absolute path of a finished video, else None
    seconds: dict[str, float | None]  # per stage
    superseded_by: str | None = None  # id of the newer version of this job (same name and sweep)
    problem: str | None = None  # a done job whose video is missing or not the recorded size
    # A job not done whose sampling left a live preview: {"path" (absolute), "step", "steps"}
    preview: dict[str, Any] | None = None
    # A chained or interpolated job (:func:`long_video_of`); None for a job of one clip.
    long_video: dict[str, Any] | None = None
    # A pending job that waits for the jobs it runs after: the names in its `after` not all done.
    after: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "state": self.state, "stage": self.stage,
                "attempts": self.attempts, "error": self.error, "video": self.video,
                "seconds": self.seconds, "superseded_by": self.superseded_by, "problem": self.problem,
                "preview": self.preview, "after": self.after, "long_video": self.long_video}


def job_statuses(out_dir: Path, ledger: Ledger, jobs: list[JobRecord] | None = None) -> list[JobStatus]:
    """Every job's row (``jobs``: the ledger's jobs when the caller read them already)."""
    jobs = ledger.jobs() if jobs is None else jobs
    newer = superseded(jobs)
    live = FolderLock.holder(out_dir) is not None
    stages = ledger.all_stages()
    waits = waiting_for(jobs)
    return [job_status(out_dir, job, stages.get(job.id, {}), newer.get(job.id), live=live, after=waits.get(job.id))
            for job in jobs]


def job_status(out_dir: Path, job: JobRecord, stages: dict[Stage, StageRecord], newer: str | None, *,
               live: bool, after: list[str] | None = None) -> JobStatus:
    video = problem = None
    enc = stages[Stage.ENCODE]
    if job.state is JobState.DONE:
        # Cheap checks only (status must stay fast on hundreds of jobs): present, recorded size.
        problem = st.check_present(out_dir, st.Recorded(enc.artifact, enc.sha256, enc.size))
    if enc.state is StageState.DONE and enc.artifact and not problem and (out_dir / enc.artifact).is_file():
        video = str((out_dir / enc.artifact).absolute())
    state = INTERRUPTED if job.state is JobState.RUNNING and not live else job.state.value
    return JobStatus(id=job.id, name=job.name, state=state, stage=_stage_of(job, stages),
                     attempts=job.attempts, error=job.error, video=video,
                     seconds={stage_name(s): r.seconds for s, r in stages.items()}, superseded_by=newer,
                     problem=problem, preview=None if job.state is JobState.DONE else preview_of(out_dir, job.id),
                     after=after, long_video=long_video_of(out_dir, job))


def long_video_of(out_dir: Path, job: JobRecord) -> dict[str, Any] | None:
    """A chained or interpolated job's video: its segments and how many are done (their records in
    its folder: a stat each, not their check), its frames, rate and length; None for a job of one clip."""
    spec = job.spec
    if not is_long(spec):
        return None
    done = 0
    while done < spec.segments and (out_dir / st.segment_relpath(job.id, done + 1, st.SEGMENT_RECORD_NAME)).is_file():
        done += 1
    frames, fps = video_frames(spec), video_fps(spec)
    return {"segments": spec.segments, "segments_done": spec.segments if job.state is JobState.DONE else done,
            "frames": frames, "fps": fps, "seconds": round(frames / fps, 3), "interpolate": spec.interpolate}


def long_video_text(info: dict[str, Any] | None) -> str:
    """``3 segments (2 done), 49 frames at 8 fps = 6.1 s``; "" for a job of one clip."""
    if info is None:
        return ""
    parts = []
    if info["segments"] > 1:
        done = "" if info["segments_done"] == info["segments"] else f" ({info['segments_done']} done)"
        parts.append(f"{info['segments']} segments{done}")
    if info["interpolate"] > 1:
        parts.append(f"interpolated x{info['interpolate']}")
    return f"{', '.join(parts)}, {info['frames']} frames at {info['fps']:g} fps = {info['seconds']:.1f} s"


def preview_of(out_dir: Path, job_id: str) -> dict[str, Any] | None:
    """The job's live preview, where its sampling left one (a regular file with its note)."""
    path = out_dir / st.preview_relpath(job_id)
    note = read_preview(path)
    if note is None:
        return None
    return {"path": str(path.absolute()), "step": note.step, "steps": note.total_steps}


def _stage_of(job: JobRecord, stages: dict[Stage | str, StageRecord]) -> str | None:
    """The stage a job stands at: the failed one, else its first stage not done, else its last. A
    failed job that failed no stage never ran (a job it runs after failed): None."""
    if job.state is JobState.FAILED:
        return job.error_stage
    for s, r in stages.items():
        if r.state is not StageState.DONE:
            return stage_name(s)
    return stage_name(list(stages)[-1])


def shown_state(r: JobStatus) -> str:
    """The state as status shows it: a done job whose video is missing or damaged gets a ``!``."""
    return r.state + ("!" if r.problem else "")


def shown_error(r: JobStatus, width: int = 100) -> str:
    """The error column of status: the video problem or the job's error, after a note naming the
    newer version when this one is superseded."""
    if r.problem:
        error = f"VIDEO PROBLEM: {r.problem}; `pan2-render resume` re-encodes it"
    else:
        error = (r.error or "").splitlines()[0][:width] if r.error else ""
    note = f"superseded by {r.superseded_by}" if r.superseded_by else ""
    return "; ".join(x for x in (note, error) if x)


def counts_lines(rows: list[JobStatus]) -> list[str]:
    """The closing lines of status: jobs per state, and the damaged videos if any."""
    counts = {s: sum(r.state == s for r in rows) for s in [*(s.value for s in JobState), INTERRUPTED]}
    n_old = sum(r.superseded_by is not None for r in rows)
    lines = [(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no jobs")
             + (f" ({n_old} superseded by a newer version)" if n_old else "")]
    damaged = sum(bool(r.problem) for r in rows)
    if damaged:
        lines.append(f"{damaged} done job(s) marked ! have a missing or damaged video")
    return lines
