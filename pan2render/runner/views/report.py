"""The HTML report (``DIR/index.html``), read-only on the ledger (``status``'s rows: job_status.py;
the posters and thumbnails it shows: posters.py).

The report is one page for looking at and comparing a batch: every finished video plays inline,
a swept batch is laid out as grids (one table per job of the batch, its rows and columns the swept
values), failed and unfinished jobs sit in place with their error, attempts and traceback, and
older versions of a job (same name and sweep values, another spec hash) are marked superseded.
It is written from the template ``templates/report.html`` into ``DIR/index.html`` with relative
links to the job folders, so the folder can be copied and opened anywhere without a server.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import threading
import time
import webbrowser
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pan2render.jobs import outdir
from pan2render.jobs.after import waiting_for
from pan2render.jobs.ledger import (
    Event,
    JobRecord,
    JobState,
    Ledger,
    Stage,
    StageRecord,
)
from pan2render.runner.protocol import artifacts as st
from pan2render.runner.protocol import outputs
from pan2render.runner.views import posters
from pan2render.runner.views.compare import comparisons
from pan2render.runner.views.format import printable
from pan2render.runner.views.job_status import job_status, long_video_text, superseded

REPORT_NAME = "index.html"
# Where the report goes when DIR/index.html is a page of the user's own, which is never overwritten.
REPORT_FALLBACK = "pan2-render-report.html"
_OURS = (b'<meta name="generator" content="pan2-render">', b"<title>pan2-render: ")  # (the second: older pages)
TILE_BOX = (320, 200)  # px: the largest a video is shown (width, height), aspect kept
# Spec fields never listed as "shared" or "varying": identity, provenance, or shown elsewhere.
_NOT_COMPARED = frozenset({"name", "sweep", "source", "image_sha256", "after"})


# ---------------------------------------------------------------------- the page's model
@dataclass(frozen=True)
class Tile:
    """One job as the page shows it."""

    id: str
    name: str
    state: str
    stage: str | None
    attempts: int
    label: str  # the values that vary (between jobs of its table), e.g. "seed 1"
    video: str | None  # relative to index.html
    poster: str | None
    params: str | None
    width: int  # display size in px
    height: int
    error: str | None
    traceback: str | None
    superseded_by: str | None
    lane: str | None = None  # a fast-lane job: its quality and speed against the exact job's
    input_image: str | None = None  # a thumbnail of the job's first frame (TI2V), relative to the page
    input_path: str | None = None  # that image's own path
    prompt: str = ""
    seconds: dict[str, float | None] = field(default_factory=dict)  # per stage, as the ledger recorded them
    preview: str | None = None  # a job without its video (running, interrupted, ...): its live preview
    preview_step: str | None = None  # "12/30": the step that preview shows
    long_video: str | None = None  # a chained or interpolated job: its segments (done) and its video's length
    after: list[str] | None = None  # a pending job that waits: the names in its `after` not all done


@dataclass
class HeaderCell:
    text: str
    rowspan: int


@dataclass
class GridRow:
    headers: list[HeaderCell]  # row headers that start on this row (nested axes use rowspan)
    cells: list[list[Tile]]  # per column: the current version first, then superseded ones


@dataclass
class Grid:
    name: str
    caption: str  # the prompt
    fixed: list[tuple[str, str]]  # fields constant in this table but varying in the batch
    row_axes: list[str]
    col_axis: str | None
    col_values: list[str]
    rows: list[GridRow] = field(default_factory=list)


NONE_SHOWN = "none"  # a field left unset (no image, the checkpoint's own timesteps)


def _fmt(value: Any) -> str:
    """A field's value as the page shows it: an empty string as "" (not a blank), unset as none."""
    if value is None:
        return NONE_SHOWN
    if value == "":
        return '""'
    return value if isinstance(value, str) else json.dumps(value)


def _sort_key(value: Any) -> tuple[int, Any]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value)
    return (1, _fmt(value))


def _compared(job: JobRecord) -> dict[str, str]:
    return {k: _fmt(v) for k, v in job.spec.to_dict().items() if k not in _NOT_COMPARED}


def _varying(jobs: list[JobRecord], compared: dict[str, dict[str, str]]) -> tuple[dict[str, str], list[str]]:
    """(fields with one value across ``jobs`` -> that value, names of the fields that differ);
    ``compared``: each job's fields as :func:`_compared` gives them, by id."""
    values: dict[str, set[str]] = {}
    for job in jobs:
        for k, v in compared[job.id].items():
            values.setdefault(k, set()).add(v)
    shared = {k: next(iter(v)) for k, v in values.items() if len(v) == 1}
    return shared, [k for k, v in values.items() if len(v) > 1]


def _display_size(width: int, height: int) -> tuple[int, int]:
    scale = min(TILE_BOX[0] / width, TILE_BOX[1] / height)
    return round(width * scale), round(height * scale)


def _tile(out_dir: Path, job: JobRecord, stages: dict[Stage, StageRecord], *, label: str,
          newer: str | None, after: list[str] | None, say: Callable[[str], None], make_poster: bool) -> Tile:
    # (the tile shows the ledger's state)
    status = job_status(out_dir, job, stages, newer, live=True, after=after)
    video = poster = None
    if status.video:
        video = str(stages[Stage.ENCODE].artifact)
        poster = posters.poster(out_dir, job.id, out_dir / video, stages[Stage.ENCODE].sha256, say, make=make_poster)
    params = outputs.params_relpath(job.id)
    tb = None
    if job.error_stage:
        tb = stages[job.error_stage].traceback
    width, height = _display_size(job.spec.width, job.spec.height)
    return Tile(id=job.id, name=job.name, state=job.state.value, stage=status.stage, attempts=job.attempts,
                label=label, video=video, poster=poster,
                params=params if (out_dir / params).is_file() else None, width=width, height=height,
                error=job.error, traceback=tb, superseded_by=newer,
                input_image=posters.input_thumbnail(out_dir, job, say, make=make_poster), input_path=job.spec.image,
                prompt=job.spec.prompt, seconds=status.seconds,
                preview=st.preview_relpath(job.id) if status.preview and not video else None,
                preview_step=f"{status.preview['step']}/{status.preview['steps']}" if status.preview else None,
                long_video=long_video_text(status.long_video) or None, after=status.after)


def _grid(name: str, jobs: list[JobRecord], tiles: dict[str, Tile], batch_varying: list[str],
          newer: dict[str, str], compared: dict[str, dict[str, str]]) -> Grid:
    current = [j for j in jobs if j.id not in newer]
    axes = sorted({k for j in jobs for k in j.spec.sweep})
    shared, _ = _varying(current, compared)
    fixed = [(k, shared[k]) for k in batch_varying if k in shared and k not in axes and k != "prompt"]
    prompts = sorted({j.spec.prompt for j in current})
    values = {a: sorted({j.spec.sweep.get(a) for j in jobs}, key=_sort_key) for a in axes}
    row_axes, col_axis = (axes[:-1], axes[-1]) if axes else ([], None)
    grid = Grid(name=name, caption=" / ".join(prompts), fixed=fixed, row_axes=row_axes, col_axis=col_axis,
                col_values=[_fmt(v) for v in values[col_axis]] if col_axis else [])
    by_cell: dict[str, list[Tile]] = {}
    for job in sorted(jobs, key=lambda j: (j.id in newer, -j.position)):  # current version first
        key = json.dumps([_fmt(job.spec.sweep.get(a)) for a in axes])
        by_cell.setdefault(key, []).append(tiles[job.id])
    row_values = list(itertools.product(*(values[a] for a in row_axes)))
    # The rows are every combination of the row axes' values, in order: the rows sharing a prefix
    # of ``depth + 1`` values are contiguous, as many as the axes after it make.
    spans = [math.prod(len(values[a]) for a in row_axes[depth + 1:]) for depth in range(len(row_axes))]
    for r, combo in enumerate(row_values):
        headers = []
        for depth in range(len(row_axes)):
            # A nested header starts where its prefix changes and spans the rows that share it.
            if r == 0 or row_values[r - 1][:depth + 1] != combo[:depth + 1]:
                headers.append(HeaderCell(_fmt(combo[depth]), spans[depth]))
        cells = []
        for v in values[col_axis] if col_axis else [None]:
            key = json.dumps([_fmt(x) for x in (*combo, v)] if col_axis else [])
            cells.append(by_cell.get(key, []))
        grid.rows.append(GridRow(headers=headers, cells=cells))
    return grid


def _wall_seconds(events: list[Event]) -> float:
    """Time during which at least one job was running (the union of every attempt's interval), so
    the idle time between a run and a later resume does not count."""
    started: dict[str, float] = {}
    intervals: list[tuple[float, float]] = []
    last = 0.0
    for e in events:
        last = max(last, e.at)
        if e.job_id is None:
            continue
        if e.started:
            started[e.job_id] = e.at
        elif e.ended() is not None and e.job_id in started:
            intervals.append((started.pop(e.job_id), e.at))
    intervals += [(t, last) for t in started.values()]  # still running (or its driver died)
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _duration(seconds: float) -> str:
    s = max(0, round(seconds))  # (a clock stepped back between two stamps)
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


@dataclass(frozen=True)
class BatchFile:
    """A batch file the folder was run with, for the page's header."""

    name: str
    path: str
    flags: str  # the --set / --sweep flags, as typed
    copy: str | None  # its copy in DIR/_batches/, relative to the page


def _batch_files(recorded: list[dict[str, Any]]) -> list[BatchFile]:
    return [BatchFile(name=Path(b.get("path") or "?").name, path=str(b.get("path") or "?"),
                      flags=" ".join(b.get("flags", [])), copy=b.get("copy")) for b in recorded]


@dataclass(frozen=True)
class BatchView:
    """A batch's jobs as the report lays them out: one tile per job (in the ledger's order) and, for
    a swept batch, its grids (one table per job of the batch file, its axes the swept fields)."""

    tiles: dict[str, Tile]
    grids: list[Grid]
    gallery: list[Tile]  # a batch without sweeps: its tiles, current versions first
    shared: dict[str, str]  # fields with one value across the current jobs
    current: list[JobRecord]  # the jobs no newer version supersedes
    n_superseded: int


def _batch_view(out_dir: Path, jobs: list[JobRecord], stages: dict[str, dict[Stage, StageRecord]], *,
                say: Callable[[str], None], make_posters: bool, lanes: bool) -> BatchView:
    """``make_posters``: make the posters and thumbnails not made yet; ``lanes``: measure (and keep)
    each fast-lane video's quality against its exact job's."""
    newer = superseded(jobs)
    current = [j for j in jobs if j.id not in newer]
    compared = {j.id: _compared(j) for j in jobs}  # (each spec's dict once: they are read four times)
    shared, varying = _varying(current, compared)
    swept = any(j.spec.sweep for j in jobs)
    waits = waiting_for(jobs)
    by_name: dict[str, list[JobRecord]] = {}
    for job in jobs:
        by_name.setdefault(job.name, []).append(job)

    tiles: dict[str, Tile] = {}
    for group in by_name.values():
        # A tile's label: what varies inside its table when grids are shown, else across the batch.
        inner = _varying([j for j in group if j.id not in newer], compared)[1] if swept else varying
        shown = [k for k in inner if k != "prompt"]
        for job in group:
            label = ", ".join(f"{k} {compared[job.id][k]}" for k in shown)
            tiles[job.id] = _tile(out_dir, job, stages[job.id], label=label, newer=newer.get(job.id),
                                  after=waits.get(job.id), say=say, make_poster=make_posters)
    if lanes:
        tiles = _with_lanes(out_dir, tiles)
    grids = [_grid(name, group, tiles, varying, newer, compared) for name, group in by_name.items()] if swept else []
    gallery = [] if swept else [tiles[j.id] for j in sorted(jobs, key=lambda j: (j.id in newer, j.position))]
    return BatchView(tiles=tiles, grids=grids, gallery=gallery, shared=shared, current=current,
                     n_superseded=len(newer))


def batch_view(out_dir: Path, *, say: Callable[[str], None] = print) -> BatchView:
    """The report's layout of a batch, read from its ledger and nothing else: no poster or thumbnail
    is made (one the report made is named) and no fast-lane comparison is measured. For the farm's
    web monitor, which reads while the farm writes."""
    ledger = Ledger.open_readonly(out_dir)
    try:
        jobs = ledger.jobs()
        found = ledger.all_stages()
        stages = {j.id: found.get(j.id, {}) for j in jobs}
    finally:
        ledger.close()
    return _batch_view(out_dir, jobs, stages, say=say, make_posters=False, lanes=False)


def _with_lanes(out_dir: Path, tiles: dict[str, Tile]) -> dict[str, Tile]:
    ledger = Ledger.open_readonly(out_dir)
    try:  # a fast video's PSNR / SSIM against the exact one (kept in its folder once measured)
        for row in comparisons(out_dir, ledger):
            tiles[row.job_id] = dataclasses.replace(tiles[row.job_id], lane=row.summary())
    finally:
        ledger.close()
    return tiles


def report_context(out_dir: Path, *, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Everything the template shows, read from the ledger (posters are made as needed)."""
    ledger = Ledger.open_readonly(out_dir)
    try:
        jobs = ledger.jobs()
        found = ledger.all_stages()
        stages = {j.id: found.get(j.id, {}) for j in jobs}
        events = ledger.events()
        batch = ledger.get_meta("batch", {}) or {}
        batch_files = ledger.get_meta("batches", []) or []
        if not batch_files and batch.get("path"):  # a folder recorded before copies were kept
            runs = ledger.get_meta("runs", []) or []
            batch_files = [{"path": batch["path"], "flags": runs[-1].get("flags", []) if runs else [], "copy": None}]
    finally:
        ledger.close()
    view = _batch_view(out_dir, jobs, stages, say=say, make_posters=True, lanes=True)
    counts = {s.value: sum(j.state is s for j in view.current) for s in JobState}
    gpu_s = sum((r.seconds or 0.0) * j.spec.gpus for j in jobs for r in stages[j.id].values())
    return {
        "title": f"pan2-render: {out_dir.resolve().name}",
        "folder": str(out_dir.resolve()),
        "batch": batch.get("path"),
        "total": len(view.current),
        "counts": counts,
        "n_superseded": view.n_superseded,
        "gpu_time": _duration(gpu_s),
        "wall_time": _duration(_wall_seconds(events)),
        "shared": sorted((k, v) for k, v in view.shared.items() if v != NONE_SHOWN),
        "batch_files": _batch_files(batch_files),
        "grids": view.grids,
        "gallery": view.gallery,
        "written_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
    }


def _shown(value: Any) -> Any:
    """A value as a template writes it: text with its control and bidi characters as escapes; markup
    already made (a macro's output) as it is."""
    import markupsafe

    return printable(value, lines=True) if isinstance(value, str) and not isinstance(value, markupsafe.Markup) \
        else value


def render_html(context: dict[str, Any]) -> str:
    return _template().render(**context)


@functools.cache
def _template() -> Any:  # compiled once a process (~0.15 s: a farm writes a report for each batch it ends)
    import jinja2
    # Every value shown is escaped, its control and bidi characters as visible escapes too.
    env = jinja2.Environment(loader=jinja2.PackageLoader("pan2render.runner.views", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, finalize=_shown)
    return env.get_template("report.html")


def write_report(out_dir: Path, *, say: Callable[[str], None] = print) -> Path:
    """Write ``DIR/index.html`` (atomically: a browser reloading it never sees half a page), or
    ``DIR/pan2-render-report.html`` when index.html is a page of the user's own (said once, when
    that file is first written). A symlink at either name is refused (UnsafePathError)."""
    path = report_path(out_dir)
    outdir.refuse_link(path)
    if path.name == REPORT_FALLBACK and not path.exists():
        say(f"report: {out_dir / REPORT_NAME} is not a pan2-render report: it is left as it is, and the report "
            f"is written to {path}")
    st.write_atomic(path, render_html(report_context(out_dir, say=say)).encode())
    return path


def report_path(out_dir: Path) -> Path:
    """Where the report of ``out_dir`` is: index.html unless that is a page of the user's own."""
    path = out_dir / REPORT_NAME
    try:
        fd = outdir.open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return path
    except outdir.UnsafePathError:
        return path  # refused by the writer, naming it
    with os.fdopen(fd, "rb") as f:
        head = f.read(4096)
    return path if any(mark in head for mark in _OURS) else out_dir / REPORT_FALLBACK


def open_in_browser(path: Path) -> bool:
    return webbrowser.open(path.resolve().as_uri())


class ReportUpdater:
    """Keeps ``DIR/index.html`` current during a run: :meth:`request` after a job ends (returns at
    once), at most one write every ``min_interval_s`` on a background thread, and :meth:`close`
    writes the final page. Writing never fails the run: an error is reported and the run goes on."""

    def __init__(self, out_dir: Path, *, say: Callable[[str], None], min_interval_s: float = 5.0):
        self.out_dir = out_dir
        self.min_interval_s = min_interval_s
        self._say = say
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one write at a time (the thread's and close()'s)
        self.writes = 0

    def request(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="report", daemon=True)
            self._thread.start()
        self._wanted.set()

    def close(self) -> Path | None:
        self._stop.set()
        self._wanted.set()
        if self._thread is not None:
            self._thread.join()
        return self._write()

    def _loop(self) -> None:
        last = float("-inf")
        while True:
            self._wanted.wait()
            if self._stop.is_set():
                return
            # Throttle: wait out the interval (a stop cuts it short: close() writes anyway).
            if self._stop.wait(max(0.0, last + self.min_interval_s - time.monotonic())):
                return
            self._wanted.clear()
            self._write()
            last = time.monotonic()

    def _write(self) -> Path | None:
        with self._lock:
            try:
                path = write_report(self.out_dir, say=self._say)
            except Exception as e:  # a report is never worth a job
                self._say(f"report: could not write {self.out_dir / REPORT_NAME}: {type(e).__name__}: {e}")
                return None
            self.writes += 1
            return path
