"""`farm start` after a farm was killed with SIGKILL, on the same port: the folder's info still
names the killed farm, and the new one answers at that address before it writes its own. That
answer is the new farm's (it is still running: it holds the folder), not another start's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pan2render.runner.cli import farm as farm_cli
from pan2render.runner.cli import main as cli


class _Proc:
    def __init__(self, exits_with: int | None) -> None:
        self.pid = 4242
        self.exits_with = exits_with

    def poll(self) -> int | None:
        return self.exits_with

    def wait(self, timeout: float | None = None) -> int | None:
        return self.exits_with


class _Client:
    url = "http://127.0.0.1:54155"


@pytest.mark.parametrize("ours_exits_with", [None, farm_cli.EXIT_ALREADY_RUNNING])
def test_an_answer_before_the_new_farms_info_is_its_own_while_it_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        ours_exits_with: int | None) -> None:
    proc = _Proc(ours_exits_with)
    infos = iter([{"pid": 999}] * 3)  # the killed farm's, until ours writes its own
    calls = {"find": 0}

    def find(root: Path, timeout_s: float = 3.0) -> Any:
        calls["find"] += 1
        return None if calls["find"] == 1 else _Client()  # (the first: before the start, nothing answers)

    monkeypatch.setattr(farm_cli, "find_farm", find)
    monkeypatch.setattr(farm_cli, "read_info", lambda root: next(infos, {"pid": proc.pid}))
    monkeypatch.setattr(farm_cli.subprocess, "Popen", lambda *a, **kw: proc)
    monkeypatch.setattr(farm_cli.time, "sleep", lambda s: None)
    assert cli.main(["farm", "start", "--root", str(tmp_path / "farm")]) == 0
    out = capsys.readouterr().out
    print(out)
    if ours_exits_with is None:  # ours runs: it is the farm that answered, once its info says so
        assert "farm up at http://127.0.0.1:54155 (pid 4242)" in out
    else:  # ours ended, the folder held: another start's farm answers
        assert "a farm already runs" in out and "started at the same time" in out
