"""The HTML report, parsed: videos with posters, sweep grids, failed tiles, superseded versions,
the throttled refresh during a run, and the size it must handle (500 jobs)."""

from __future__ import annotations

import shutil
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pan2render.jobs.ledger import JobEvent, Ledger, Stage, StageEvent
from pan2render.jobs.spec import JobSpec
from pan2render.media.video import encode_mp4
from pan2render.runner.cli import main as cli
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.protocol.messages import WorkerConfig
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver
from pan2render.runner.views.job_status import job_statuses
from pan2render.runner.views.report import ReportUpdater, write_report
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def job(name: str, *, steps: int = 2, **sweep: float) -> JobSpec:
    fields = {"seed": 0, "guidance": 2.5, "flow_shift": 5.0, **sweep}
    return JobSpec(name=name, model="tiny", prompt=f"a clip of {name}", negative_prompt="", image=None,
                   image_sha256=None, steps=steps, height=32, width=48, frames=5, fps=8.0,
                   sampler="unipc", gpus=1, crf=18, preset="tiny-preview", sweep=dict(sweep), **fields)


def render(out: Path, jobs: list[JobSpec], *, faults: dict | None = None, on_job_end=None) -> None:
    out.mkdir(exist_ok=True)
    ledger = Ledger.open(out)
    ledger.add_jobs(jobs, retries=0)
    ex = LocalExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY, faults=faults or {}))
    Driver(out_dir=out, ledger=ledger, executor=ex, config=ServingConfig(retries=0, progress=False, poll_s=0.01),
           on_job_end=on_job_end).run([j.job_id for j in jobs])
    ledger.close()


class Page(HTMLParser):
    """The parts of index.html the tests look at: videos, tiles, grid headers, tracebacks."""

    def __init__(self, text: str):
        super().__init__()
        self.videos: list[dict[str, str | None]] = []
        self.tiles: list[dict[str, str | None]] = []  # attrs of each <figure class="tile ...">
        self.tables: list[dict[str, list[str]]] = []  # per grid: col / row header texts
        self.tracebacks: list[str] = []
        self.scripts = 0
        self._th: str | None = None
        self._text: list[str] = []
        self._in_pre = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if tag == "video":
            self.videos.append(a)
        elif tag == "figure" and "tile" in cls:
            self.tiles.append(a)
        elif tag == "table":
            self.tables.append({"col": [], "row": []})
        elif tag == "th" and ("col" in cls or "row" in cls):
            self._th, self._text = cls[0], []
        elif tag == "pre":
            self._in_pre, self._text = True, []
        elif tag == "script" or (tag == "link" and a.get("rel") == "stylesheet"):
            self.scripts += 1

    def handle_data(self, data: str) -> None:
        if self._th or self._in_pre:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "th" and self._th:
            self.tables[-1][self._th].append("".join(self._text).strip())
            self._th = None
        elif tag == "pre" and self._in_pre:
            self.tracebacks.append("".join(self._text))
            self._in_pre = False


def tiles_with(page: Page, cls: str) -> list[dict[str, str | None]]:
    return [t for t in page.tiles if cls in (t.get("class") or "").split()]


def test_report_of_a_sweep_with_failures_and_superseded_versions(tmp_path: Path) -> None:
    sweep = [{"guidance": g, "flow_shift": f} for g in (2.0, 3.5) for f in (3.0, 5.0)]
    first = [job(n, **s) for n in ("a", "b") for s in sweep]
    render(tmp_path, first, faults={"fail": {"job": "b", "stage": "sampling"}})
    # The batch edited (a's steps) and run again into the same folder: a's 4 old videos are older
    # versions now; b's jobs are unchanged, still failed.
    second = [job("a", steps=3, **s) for s in sweep]
    render(tmp_path, second)

    path = write_report(tmp_path)
    page = Page(path.read_text())
    print(f"{len(page.videos)} videos, {len(page.tiles)} tiles, tables {page.tables}")
    done = [j for j in first[:4] + second]
    assert len(page.videos) == len(done) == 8  # one per done job, older versions included
    for v in page.videos:
        assert v["preload"] == "none" and "muted" in v and "loop" in v
        assert (tmp_path / str(v["src"])).is_file() and (tmp_path / str(v["poster"])).is_file()
        assert str(v["poster"]).endswith(".png")
    assert {v["src"] for v in page.videos} == {f"{j.job_id}/video.mp4" for j in done}
    # One table per job of the batch; rows and columns exactly the swept values.
    assert page.tables == [{"row": ["3.0", "5.0"], "col": ["2.0", "3.5"]}] * 2
    failed = tiles_with(page, "failed")
    assert sorted(t["id"] for t in failed) == sorted(j.job_id for j in first[4:])
    assert len(page.tracebacks) == 4 and all("Traceback" in tb and "injected failure" in tb
                                             for tb in page.tracebacks)
    old = tiles_with(page, "superseded")
    assert sorted(t["id"] for t in old) == sorted(j.job_id for j in first[:4])
    assert page.scripts == 0  # self-contained: no script, no external stylesheet
    assert "a clip of a" in path.read_text() and "attempts 1" in path.read_text()

    ledger = Ledger.open_readonly(tmp_path)
    rows = {r.id: r for r in job_statuses(tmp_path, ledger)}
    ledger.close()
    for old_job, new_job in zip(first[:4], second):
        assert rows[old_job.job_id].superseded_by == new_job.job_id
    assert all(rows[j.job_id].superseded_by is None for j in second + first[4:])


def test_status_marks_superseded_versions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    render(tmp_path, [job("fox", seed=0)])
    render(tmp_path, [job("fox", steps=3, seed=0)])
    capsys.readouterr()
    assert cli.main(["status", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    print(table)
    assert f"superseded by {job('fox', steps=3, seed=0).job_id}" in table
    assert "2 done (1 superseded by a newer version)" in table


def test_report_refreshes_as_jobs_end_and_never_fails_the_run(tmp_path: Path) -> None:
    messages: list[str] = []
    updater = ReportUpdater(tmp_path, say=messages.append, min_interval_s=0.0)
    jobs = [job("a", seed=s) for s in range(3)]
    render(tmp_path, jobs, on_job_end=updater.request)
    updater.close()
    page = Page((tmp_path / "index.html").read_text())
    print(updater.writes, messages)
    assert updater.writes >= 2 and not messages  # during the run, and the final page
    assert len(page.videos) == 3

    # Requests within the interval coalesce; close() always writes the final page.
    throttled = ReportUpdater(tmp_path, say=messages.append, min_interval_s=3600.0)
    throttled.request()
    deadline = time.monotonic() + 30
    while throttled.writes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(50):
        throttled.request()
    throttled.close()
    assert throttled.writes == 2

    # A report that cannot be written is reported, and the caller carries on.
    broken = ReportUpdater(tmp_path / "not-a-run", say=messages.append)
    assert broken.close() is None
    print(messages)
    assert len(messages) == 1 and "could not write" in messages[0] and "no ledger" in messages[0]


def test_report_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    render(tmp_path, [job("a", seed=0)])
    opened: list[str] = []
    monkeypatch.setattr("webbrowser.open", lambda uri: opened.append(uri) or True)
    assert cli.main(["report", str(tmp_path), "--open"]) == 0
    assert opened == [(tmp_path / "index.html").resolve().as_uri()]


def test_report_of_500_jobs_is_written_in_under_5_s(tmp_path: Path) -> None:
    """Stated requirement: a 500-job ledger's report in < 5 s (its posters made already). The
    ledger is built directly (no workers): 400 done jobs sharing one small video, 50 failed, 50
    pending, over a 2-prompt x 250-value sweep."""
    sample = tmp_path / "sample.mp4"
    import numpy as np

    encode_mp4(np.random.default_rng(0).integers(0, 255, (17, 64, 64, 3), dtype=np.uint8), sample,
               fps=8, crf=18)
    out = tmp_path / "out"
    out.mkdir()
    specs = [job(n, seed=s) for n in ("a", "b") for s in range(250)]
    ledger = Ledger.open(out)
    ledger.add_jobs(specs, retries=0)
    size = sample.stat().st_size
    for i, spec in enumerate(specs):
        ledger.transition(spec.job_id, JobEvent.START, reason="test")
        if i < 400:
            (out / spec.job_id).mkdir()
            shutil.copyfile(sample, out / spec.job_id / "video.mp4")
            ledger.set_stage(spec.job_id, Stage.ENCODE, StageEvent.FINISH, artifact=f"{spec.job_id}/video.mp4",
                             sha256=f"{i:064x}", size=size, seconds=0.5)
            ledger.transition(spec.job_id, JobEvent.FINISH, reason="test")
        elif i < 450:
            ledger.set_stage(spec.job_id, Stage.SAMPLING, StageEvent.FAIL, error="boom",
                             traceback="Traceback (most recent call last):\n  boom")
            ledger.transition(spec.job_id, JobEvent.FAIL, error="boom", error_stage=Stage.SAMPLING, reason="test")
        else:
            ledger.transition(spec.job_id, JobEvent.INTERRUPT, reason="test")
    ledger.close()

    # A run makes each poster once, as its job ends (the report refreshes then); the first write
    # here makes all 400 at once, a one-off a folder from before the report pays.
    t0 = time.perf_counter()
    write_report(out)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    path = write_report(out)
    seconds = time.perf_counter() - t0
    page = Page(path.read_text())
    print(f"500-job report: {seconds:.2f} s (the first, making 400 posters: {first:.2f} s), "
          f"{path.stat().st_size / 1e6:.2f} MB, {len(page.videos)} videos")
    assert len(page.videos) == 400 and len(tiles_with(page, "failed")) == 50
    assert len(tiles_with(page, "pending")) == 50
    assert seconds < 5.0


def test_three_swept_fields_nest_as_row_headers(tmp_path: Path) -> None:
    jobs = [job("a", flow_shift=f, guidance=g, seed=s) for f in (3.0, 5.0) for g in (2.0, 3.5) for s in (0, 1)]
    render(tmp_path, jobs)
    text = write_report(tmp_path).read_text()
    page = Page(text)
    print(page.tables)
    # Rows: flow_shift (outer, spanning 2 rows) x guidance; columns: seed.
    assert page.tables == [{"row": ["3.0", "2.0", "3.5", "5.0", "2.0", "3.5"], "col": ["0", "1"]}]
    assert text.count('rowspan="2"') == 2 and len(page.videos) == 8


def test_text_from_the_batch_is_escaped_in_the_page(tmp_path: Path) -> None:
    """Prompts, names and errors come from batch files: in the page they are text, never markup."""
    evil = '"><script>alert(1)</script><img src=x onerror=alert(2)>'
    jobs = [job(f"ok{evil}"), job(f"bad{evil}")]
    render(tmp_path, jobs, faults={"fail": {"job": f"bad{evil}", "stage": "sampling"}})
    text = write_report(tmp_path).read_text()
    page = Page(text)
    print(text[text.find("<main") if "<main" in text else 0:][:1500])
    assert page.scripts == 0 and "<img" not in text and "onerror=alert(2)&gt;" in text
    assert text.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 3  # a name, a prompt, an error


def test_bidi_and_control_characters_of_an_old_ledger_show_as_escapes(tmp_path: Path) -> None:
    """Validation refuses them now; a ledger written before may hold them: the page shows each as an
    escape, so "gnp<RLO>exe" cannot read as "exe.png" and no control reaches the browser."""
    jobs = [job("gnp\u202eexe.png"), job("colour\x1b[31m")]
    render(tmp_path, jobs)
    text = write_report(tmp_path).read_text()
    assert "\u202e" not in text and "\x1b" not in text
    assert "gnp\\u202eexe.png" in text and "colour\\x1b[31m" in text
