"""``status`` rows and the HTML contact sheet (``DIR/index.html``), both read-only on the ledger."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pan2render.jobs.ledger import STAGES, JobRecord, JobState, Ledger, Stage, StageState
from pan2render.runner import stages as st


@dataclass(frozen=True)
class JobStatus:
    id: str
    name: str
    state: str
    stage: str | None  # done: "encode"; failed: the failing stage; else the first unfinished stage
    attempts: int
    error: str | None
    video: str | None  # absolute path of a finished video, else None
    seconds: dict[str, float | None]  # per stage
    problem: str | None = None  # a done job whose video is missing or not the recorded size

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "state": self.state, "stage": self.stage,
                "attempts": self.attempts, "error": self.error, "video": self.video,
                "seconds": self.seconds, "problem": self.problem}


def job_statuses(out_dir: Path, ledger: Ledger) -> list[JobStatus]:
    out = []
    for job in ledger.jobs():
        stages = ledger.stages(job.id)
        video = problem = None
        enc = stages[Stage.ENCODE]
        if job.state is JobState.DONE:
            # Cheap checks only (status must stay fast on hundreds of jobs): present, recorded size.
            problem = st.check_present(out_dir, st.Recorded(enc.artifact, enc.sha256, enc.size))
        if enc.state is StageState.DONE and enc.artifact and not problem and (out_dir / enc.artifact).is_file():
            video = str((out_dir / enc.artifact).absolute())
        out.append(JobStatus(id=job.id, name=job.name, state=job.state.value, stage=_stage_of(job, stages),
                             attempts=job.attempts, error=job.error, video=video,
                             seconds={s.value: stages[s].seconds for s in STAGES}, problem=problem))
    return out


def _stage_of(job: JobRecord, stages: dict[Stage, Any]) -> str | None:
    if job.state is JobState.FAILED and job.error_stage:
        return job.error_stage
    for s in STAGES:
        if stages[s].state is not StageState.DONE:
            return s.value
    return STAGES[-1].value


def shown_state(r: JobStatus) -> str:
    """The state as status shows it: a done job whose video is missing or damaged gets a ``!``."""
    return r.state + ("!" if r.problem else "")


def shown_error(r: JobStatus, width: int = 100) -> str:
    if r.problem:
        return f"VIDEO PROBLEM: {r.problem}; `pan2-render resume` re-encodes it"
    return (r.error or "").splitlines()[0][:width] if r.error else ""


def counts_lines(rows: list[JobStatus]) -> list[str]:
    """The closing lines of status: jobs per state, and the damaged videos if any."""
    counts = {s.value: sum(r.state == s.value for r in rows) for s in JobState}
    lines = [", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no jobs"]
    damaged = sum(bool(r.problem) for r in rows)
    if damaged:
        lines.append(f"{damaged} done job(s) marked ! have a missing or damaged video")
    return lines


def format_table(rows: list[JobStatus]) -> str:
    head = f"{'state':8} {'stage':13} {'att':>3}  {'id':50} error"
    lines = [head]
    for r in rows:
        lines.append(f"{shown_state(r):8} {r.stage or '-':13} {r.attempts:>3}  {r.id:50} {shown_error(r)}")
    return "\n".join(lines + counts_lines(rows))


def write_report(out_dir: Path) -> Path:
    """Write ``DIR/index.html``: a contact sheet (the thumbnail strip of every done job), then one
    section per job with its strip, resolved parameters and, if it failed, the error."""
    from pan2render.media.video import MediaError, thumbnail_strip  # noqa: PLC0415

    ledger = Ledger.open_readonly(out_dir)
    try:
        rows = job_statuses(out_dir, ledger)
        specs = {j.id: j.spec for j in ledger.jobs()}
    finally:
        ledger.close()
    # Strips are files next to index.html (DIR/_report/<id>.png), not data URIs: a sweep of a few
    # hundred jobs would otherwise make a page of tens of MB.
    strips: dict[str, str] = {}  # job id -> src relative to index.html
    for r in rows:
        if r.video:
            try:
                rel = f"_report/{r.id}.png"
                st.write_atomic(out_dir / rel, thumbnail_strip(r.video, n=6, height=96))
                strips[r.id] = rel
            except MediaError as e:  # listed without a strip; `resume` would re-encode it
                print(f"report: {r.id}: {e}")
    parts = [_HEAD.format(title=html.escape(f"pan2-render: {out_dir.name}"))]
    done = sum(r.state == "done" for r in rows)
    failed = [r for r in rows if r.state == "failed"]
    parts.append(f"<h1>{html.escape(str(out_dir))}</h1><p>{len(rows)} jobs: {done} done, "
                 f"{len(failed)} failed, {len(rows) - done - len(failed)} unfinished.</p>")
    parts.append('<div class="sheet">')
    for r in rows:
        if strips.get(r.id):
            parts.append(f'<a href="#{html.escape(r.id)}"><img src="{html.escape(strips[r.id])}" '
                         f'title="{html.escape(r.name)}"></a>')
    parts.append("</div>")
    if failed:
        parts.append("<h2>Failed</h2><ul>")
        for r in failed:
            parts.append(f'<li><a href="#{html.escape(r.id)}">{html.escape(r.name)}</a> '
                         f'({html.escape(r.stage or "?")}): <code>{html.escape(r.error or "")}</code></li>')
        parts.append("</ul>")
    parts.append("<h2>Jobs</h2>")
    for r in rows:
        spec = specs[r.id].to_dict()
        spec.pop("source", None)
        parts.append(f'<section id="{html.escape(r.id)}"><h3>{html.escape(r.name)} '
                     f'<span class="{r.state}">{r.state}</span></h3>')
        if strips.get(r.id):
            rel = Path(r.video or "").relative_to(out_dir.absolute()) if r.video else ""
            parts.append(f'<a href="{html.escape(str(rel))}"><img src="{html.escape(strips[r.id])}"></a>')
        if r.error:
            parts.append(f"<pre class=err>{html.escape(r.stage or '')}: {html.escape(r.error)}</pre>")
        parts.append(f"<p>id <code>{html.escape(r.id)}</code>, attempts {r.attempts}, seconds "
                     f"{html.escape(json.dumps({k: round(v, 2) for k, v in r.seconds.items() if v}))}</p>")
        parts.append(f"<pre>{html.escape(json.dumps(spec, indent=1, sort_keys=True))}</pre></section>")
    parts.append("</body></html>")
    path = out_dir / "index.html"
    st.write_atomic(path, "\n".join(parts).encode())
    return path


_HEAD = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title><style>
body{{font-family:sans-serif;margin:1.5em;background:#fafafa}} .sheet img{{height:48px;margin:2px}}
section{{border-top:1px solid #ccc;padding:.5em 0}} pre{{background:#eee;padding:.5em;font-size:12px;
white-space:pre-wrap}} .err{{background:#fdd}} .done{{color:green}} .failed{{color:#b00}}
.pending,.running{{color:#a60}}</style></head><body>"""
