"""`status`, `status --json`, `show` and the report say what a pending job waits for (the names in
its `after` whose jobs are not all done), and stop saying it once those jobs are done."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from runner_helpers import write_batch

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import JobEvent, Ledger
from pan2render.runner.cli import main as cli


def _folder(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A folder whose batch has fox (swept over two seeds), owl after fox, and bat after owl and
    fox; nothing run yet."""
    batch = write_batch(tmp_path / "b.yaml", [{"name": "fox", "prompt": "a fox"},
                                              {"name": "owl", "prompt": "an owl", "after": ["fox"]},
                                              {"name": "bat", "prompt": "a bat", "after": ["owl", "fox"]}],
                        sweep={"seed": [1, 2]})
    out = tmp_path / "out"
    out.mkdir()
    specs = load_batch(batch).jobs
    ledger = Ledger.open(out)
    ledger.record_batch({"path": str(batch)}, specs, retries=1)
    ledger.close()
    return out, {f"{s.name}{s.seed}": s.job_id for s in specs}


def _status(out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, dict]]:
    cli.main(["status", str(out)])
    text = capsys.readouterr().out
    cli.main(["status", str(out), "--json"])
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)["jobs"]}
    print(text, file=sys.stderr)  # (stdout is what the next status is read from)
    return text, rows


def _finish(out: Path, *job_ids: str) -> None:
    ledger = Ledger.open(out)
    for job_id in job_ids:
        ledger.transition(job_id, JobEvent.START, reason="test")
        ledger.transition(job_id, JobEvent.FINISH, reason="test")
    ledger.close()


def test_status_show_and_the_report_say_what_a_pending_job_waits_for(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, ids = _folder(tmp_path)
    text, rows = _status(out, capsys)
    assert [rows[ids[f"fox{s}"]]["after"] for s in (1, 2)] == [None, None]
    assert rows[ids["owl1"]]["after"] == ["fox"] and rows[ids["bat2"]]["after"] == ["owl", "fox"]
    line = next(line for line in text.splitlines() if ids["bat1"] in line)
    assert line.split()[:4] == ["pending", "after:", "owl,", "fox"]

    cli.main(["show", str(out), ids["owl1"]])
    shown = capsys.readouterr().out
    assert "waits    after: fox (it starts once every job of that name is done)" in shown
    assert '  after            ["fox"]' in shown  # the spec, as recorded

    cli.main(["report", str(out)])
    capsys.readouterr()
    page = (out / "index.html").read_text()
    assert page.count("after: owl, fox") == 2 and page.count("after: fox<") == 2  # bat's tiles, owl's

    # One fox done: the owls still wait for the other one (a name stands for every job of its sweep).
    _finish(out, ids["fox1"])
    _, rows = _status(out, capsys)
    assert rows[ids["owl1"]]["after"] == ["fox"]
    # Both done: the owls may start; the bats wait for the owls alone.
    _finish(out, ids["fox2"])
    text, rows = _status(out, capsys)
    assert rows[ids["owl1"]]["after"] is None and rows[ids["bat1"]]["after"] == ["owl"]
    assert next(line for line in text.splitlines() if ids["owl2"] in line).split()[:2] == ["pending", "conditioning"]
