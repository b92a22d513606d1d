"""A full disk under the farm's queue: a submit that cannot be recorded records nothing and is
answered 507 with the space the batch needs; a queue write refused later is reported (the log, the
status) while the farm goes on answering, and is made once space returns. With an injected ENOSPC,
and on a real small filesystem where this machine lets the test mount one."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from runner_helpers import serving_farm

from pan2render.runner.farm.queue import FarmQueue

BATCH = {"model": "tiny", "preset": "tiny-preview", "defaults": {"steps": 2},
         "jobs": [{"name": "fox", "prompt": "a fox"}]}


def _post(url: str, token: str, base: Path, out: str) -> tuple[int, dict[str, Any]]:
    body = {"text": yaml.safe_dump(BATCH), "name": "b.yaml", "base": str(base), "out": out}
    req = urllib.request.Request(f"{url}/api/batches", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str, token: str, path: str) -> Any:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _full(*_: Any, **__: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_an_injected_enospc_records_nothing_then_the_farm_resumes_writing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with serving_farm(tmp_path) as (farm, url, token):
        with monkeypatch.context() as m:
            m.setattr(FarmQueue, "add", _full)
            code, body = _post(url, token, tmp_path, "out")
        assert code == 507 and "the disk is full" in body["error"] and "GiB" in body["error"], body
        assert "Nothing was recorded" in body["error"]
        assert not (tmp_path / "out").exists() and _get(url, token, "/api/batches?all=1") == []

        real = FarmQueue.transition
        with monkeypatch.context() as m:
            m.setattr(FarmQueue, "transition", _full)  # every later queue write: refused
            code, body = _post(url, token, tmp_path, "out")
            assert code == 201
            deadline = time.monotonic() + 60
            while not _get(url, token, "/api/status").get("write_error"):
                assert time.monotonic() < deadline, "the refused write was never reported"
                time.sleep(0.1)
            assert _get(url, token, "/api/status")["batches"][0]["state"] == "active"  # reads still answered
        assert FarmQueue.transition is real
        deadline = time.monotonic() + 60
        while _get(url, token, f"/api/batches/{body['id']}")["state"] != "done":  # written once space is back
            assert time.monotonic() < deadline, "the queue was not written again"
            time.sleep(0.1)
        assert _get(url, token, "/api/status")["write_error"] is None
    logged = capsys.readouterr().out
    assert "the queue could not be written" in logged and "the queue is written again" in logged


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "small"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=700", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("this machine does not let the test mount a small filesystem")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_real_full_filesystem_under_the_farm(tmp_path: Path, small_fs: Path) -> None:
    root = small_fs / "farm"
    root.mkdir(mode=0o700)
    filler = small_fs / "filler"
    with serving_farm(tmp_path, root=root) as (farm, url, token):
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)  # the filesystem full to its last block
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        code, body = _post(url, token, tmp_path, "out")
        assert code == 507 and not (tmp_path / "out").exists(), body
        filler.unlink()
        code, body = _post(url, token, tmp_path, "out")
        assert code == 201, body
