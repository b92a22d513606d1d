"""`status` shows where a running sampling stands (its step, as the scheduler recorded it from the
workers' reports, and its step checkpoint), and `status --json` is one object: the run's state,
elapsed, ETA, flags, counts, and every job with its swept values and progress."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from runner_helpers import ThreadedExecutor, write_batch

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import FolderLock, JobEvent, Ledger, Stage, StageEvent
from pan2render.runner.cli import main as cli
from pan2render.runner.protocol.artifacts import SAMPLING_STEP_DOC, STEP_CHECKPOINT_DOC
from pan2render.runner.protocol.messages import WorkerConfig
from pan2render.runner.serve import watch
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def _sampling_folder(tmp_path: Path) -> tuple[Path, str]:
    """A folder whose run is live (its lock held), one job sampling at step 37 of 50 with a step
    checkpoint at 30, the others pending; run with two flags."""
    batch = write_batch(tmp_path / "b.yaml", [{"name": "fox", "prompt": "a fox"}], sweep={"seed": [1, 2, 3]},
                        defaults={"steps": 50})
    out = tmp_path / "out"
    out.mkdir()
    ledger = Ledger.open(out)
    specs = load_batch(batch).jobs
    ledger.record_batch({"path": str(batch)}, specs, retries=1)
    ledger.set_meta("runs", [{"command": "run", "started": time.time() - 30, "pid": os.getpid(), "host": "here",
                              "flags": ["--set", "steps=50"], "gpus": 1}])
    job = specs[1].job_id
    ledger.transition(job, JobEvent.START, reason="test")
    ledger.set_stage(job, Stage.CONDITIONING, StageEvent.FINISH, seconds=0.1)
    ledger.set_stage(job, Stage.SAMPLING, StageEvent.START)
    ledger.set_document(job, SAMPLING_STEP_DOC, json.dumps({"step": 37, "steps": 50, "rate": 1.5, "at": time.time()}))
    ledger.set_document(job, STEP_CHECKPOINT_DOC, json.dumps(
        {"artifact": f"{job}/sampling.ckpt.safetensors", "sha256": "0" * 64, "size": 1, "step": 30, "total": 50}))
    ledger.close()
    return out, job


def test_status_and_show_say_the_step_of_a_running_sampling_and_its_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, job = _sampling_folder(tmp_path)
    lock = FolderLock(out)
    lock.acquire()
    try:
        assert cli.main(["status", str(out)]) == 4
        text = capsys.readouterr().out
        assert cli.main(["show", str(out), job]) == 0
        shown = capsys.readouterr().out
        assert cli.main(["status", str(out), "--json"]) == 4
        doc = json.loads(capsys.readouterr().out)
    finally:
        lock.release()
    print(text)
    row = next(line for line in text.splitlines() if job in line)
    assert row.startswith("running  sampling 37/50 (checkpoint at 30)")
    assert "progress sampling 37/50 (checkpoint at 30)" in shown

    assert doc["run"]["state"] == "running" and doc["run"]["pid"] == os.getpid()
    assert 29 < doc["run"]["elapsed_s"] < 120 and doc["run"]["eta_s"] > 0 and doc["run"]["eta_from"]
    assert doc["run"]["flags"] == ["--set", "steps=50"]
    assert doc["counts"] == {"pending": 2, "running": 1, "done": 0, "failed": 0, "cancelled": 0, "interrupted": 0,
                             "total": 3, "superseded": 0}
    assert doc["exit_code"] == 4
    jobs = {j["id"]: j for j in doc["jobs"]}
    assert [j["sweep"] for j in doc["jobs"]] == [{"seed": 1}, {"seed": 2}, {"seed": 3}]
    assert jobs[job]["progress"]["step"] == 37 and jobs[job]["progress"]["checkpoint_step"] == 30
    assert all(j["progress"] is None for i, j in jobs.items() if i != job)

    # The run gone (the lock released): the sampling is interrupted; its checkpoint is what is left.
    capsys.readouterr()
    assert cli.main(["status", str(out)]) == 4
    row = next(line for line in capsys.readouterr().out.splitlines() if job in line)
    assert row.startswith("interrupted  sampling (checkpoint at 30)")


def test_the_step_shown_is_never_behind_its_step_checkpoint(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The step is recorded at most every 5 s, a checkpoint as its step is reached: a step read
    behind the checkpoint is the checkpoint's (the sampling is at least there), in the table and
    the JSON alike; never `sampling 15/50 (checkpoint at 30)`."""
    out, job = _sampling_folder(tmp_path)
    ledger = Ledger.open(out)
    ledger.set_document(job, SAMPLING_STEP_DOC, json.dumps({"step": 15, "steps": 50, "rate": 1.5, "at": time.time()}))
    ledger.close()
    lock = FolderLock(out)
    lock.acquire()
    try:
        cli.main(["status", str(out)])
        text = capsys.readouterr().out
        cli.main(["status", str(out), "--json"])
        doc = json.loads(capsys.readouterr().out)
    finally:
        lock.release()
    row = next(line for line in text.splitlines() if job in line)
    print(row)
    assert row.startswith("running  sampling 30/50 (checkpoint at 30)")
    progress = next(j["progress"] for j in doc["jobs"] if j["id"] == job)
    assert progress["step"] == 30 and progress["checkpoint_step"] == 30


def test_an_interrupted_farm_batch_is_continued_by_farm_start(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A batch a farm served, the farm killed: `farm start` continues it from the farm's queue (the
    folder's last run says so); `resume DIR` is how a `run`'s folder goes on."""
    out, job = _sampling_folder(tmp_path)
    for command, says, not_said in (("run", "`pan2-render resume", "farm start"),
                                    ("farm", "`pan2-render farm start` (with that farm's --root) continues", None)):
        ledger = Ledger.open(out)
        ledger.set_meta("runs", [{**ledger.get_meta("runs")[-1], "command": command}])
        ledger.close()
        assert cli.main(["status", str(out)]) == 4
        head = capsys.readouterr().out.split("\n")[1]
        assert "1 job(s) interrupted" in head and says in head, head
        assert not_said is None or not_said not in head
        assert cli.main(["status", str(out), "--json"]) == 4
        assert json.loads(capsys.readouterr().out)["run"]["command"] == command


def test_a_batch_with_a_failed_job_exits_1_even_while_others_are_unfinished(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's exit codes: 1 some job failed, 4 not finished with none failed. A failed job
    decides, whatever else is pending or running: a script waiting on `status` learns of the failure
    at once, not when the last job ends."""
    out, job = _sampling_folder(tmp_path)  # one running, two pending
    ledger = Ledger.open(out)
    pending = next(j.id for j in ledger.jobs() if j.id != job)
    ledger.transition(pending, JobEvent.START, reason="test")
    ledger.transition(pending, JobEvent.FAIL, reason="test", error="ValueError: boom")
    ledger.close()
    lock = FolderLock(out)
    lock.acquire()
    try:
        assert cli.main(["status", str(out)]) == 1
        capsys.readouterr()
        assert cli.main(["status", str(out), "--json"]) == 1
        doc = json.loads(capsys.readouterr().out)
    finally:
        lock.release()
    assert doc["exit_code"] == 1 and (doc["counts"]["failed"], doc["counts"]["pending"], doc["counts"]["running"]) \
        == (1, 1, 1)
    assert cli.main(["status", str(out)]) == 1  # the run gone too (its job interrupted): still 1


def test_the_scheduler_records_the_steps_the_workers_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake sampling of 12 steps of 0.1 s, the recording interval made 0: the ledger holds the
    step of the sampling as reported while it ran."""
    monkeypatch.setenv("PAN2_FAKE_STEP_SECONDS", "0.1")
    monkeypatch.setattr(watch, "STEP_RECORD_EVERY_S", 0.0)
    batch = write_batch(tmp_path / "b.yaml", [{"name": "slow", "prompt": "x"}], defaults={"steps": 12})
    out = tmp_path / "out"
    out.mkdir()
    ledger = Ledger.open(out)
    specs = load_batch(batch).jobs
    ledger.add_jobs(specs, retries=0)
    seen: list[int] = []
    real = Ledger.set_each_document

    def spy(self: Ledger, name: str, bodies: dict[str, str]) -> None:
        if name == SAMPLING_STEP_DOC:
            seen.extend(json.loads(body)["step"] for body in bodies.values())
        real(self, name, bodies)

    monkeypatch.setattr(Ledger, "set_each_document", spy)
    ex = ThreadedExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    Driver(out_dir=out, ledger=ledger, executor=ex, config=ServingConfig(retries=0, progress=False, poll_s=0.2)).run(
        [s.job_id for s in specs])
    recorded = json.loads(ledger.document(specs[0].job_id, SAMPLING_STEP_DOC))
    ledger.close()
    print("steps recorded:", seen)
    assert len(seen) >= 2 and seen == sorted(seen) and 1 <= seen[0] < 12
    assert recorded["steps"] == 12 and recorded["step"] == seen[-1]


def test_status_show_and_the_report_give_a_preview_of_a_running_or_interrupted_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The preview a sampling left (its step in the file's own note): `status --json` and `show`
    give its path and step, while the job runs and once it is interrupted; the report shows it in
    the job's tile; a job without one has none."""
    import numpy as np

    from pan2render.media.video import webp_strip
    from pan2render.preview_file import PreviewNote, with_note
    from pan2render.runner.views.report import write_report

    out, job = _sampling_folder(tmp_path)
    tile = np.full((4, 6, 3), 90, np.uint8)
    note = PreviewNote(step=35, total_steps=50, frames=(0, 1, 2), map="test", at=time.time())
    (out / job).mkdir()
    (out / job / "preview.webp").write_bytes(with_note(webp_strip([tile] * 3, height=88), note))
    path = str((out / job / "preview.webp").absolute())
    for live in (True, False):
        lock = FolderLock(out)
        if live:
            lock.acquire()
        try:
            assert cli.main(["status", str(out), "--json"]) == 4
            doc = json.loads(capsys.readouterr().out)
            assert cli.main(["show", str(out), job]) == 0
            shown = capsys.readouterr().out
        finally:
            if live:
                lock.release()
        jobs = {j["id"]: j for j in doc["jobs"]}
        assert jobs[job]["state"] == ("running" if live else "interrupted")
        assert jobs[job]["preview"] == {"path": path, "step": 35, "steps": 50}
        assert all(j["preview"] is None for i, j in jobs.items() if i != job)
        assert f"preview  {path} (step 35/50)" in shown
    page = write_report(out, say=print).read_text()
    assert f'<img class="preview" src="{job}/preview.webp"' in page and "preview at step 35/50" in page
    assert page.count('class="preview"') == 1
