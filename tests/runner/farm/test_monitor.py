"""The web monitor's routes without a browser (an in-process farm, the fake pipeline): the page loads
without the token and holds no data, every read and action needs the token, a cross-site POST is
refused with it, only a served batch's own files come back, the stream sends the snapshot, and a
batch's view is the report's layout with each failed job's traceback.
tests/runner/farm/test_monitor_browser.py drives the page itself in Chromium."""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import ThreadedExecutor, serving_farm, submit_file, until

from pan2render.jobs.ledger import Ledger
from pan2render.preview_file import read_note
from pan2render.runner.farm.service import Farm

FAIL_BROKEN = {"fail": {"job": "broken", "stage": "sampling"}}


def _send(url: str, *, token: str | None = None, method: str = "GET", body: dict[str, Any] | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _snapshots(stream: Any) -> Iterator[dict[str, Any]]:
    """The snapshots a server-sent event stream brings, as they come (at most 100)."""
    for _ in range(100):
        lines = []
        while (line := stream.readline().decode()) != "\n":
            lines.append(line.rstrip("\n"))
        if lines[0].startswith(":"):
            continue  # a keep-alive
        assert lines[0] == "event: snapshot" and lines[1].startswith("data: "), lines
        yield json.loads(lines[1].removeprefix("data: "))



def _state(farm: Farm, batch_id: str) -> dict[str, Any]:
    return farm.ask(lambda: farm.describe(batch_id)).result(timeout=30)


def test_the_page_loads_without_the_token_and_every_read_and_action_needs_it(tmp_path: Path) -> None:
    with serving_farm(tmp_path) as (farm, url, token):
        b = submit_file(farm, tmp_path / "out", {"jobs": [{"name": "a", "prompt": "a"}]}, paused=True)
        code, headers, page = _send(url + "/")
        assert code == 200 and b"pan2-render farm" in page
        csp = headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "default-src 'none'" in csp
        assert headers["X-Content-Type-Options"] == "nosniff"
        # No inline script or style in the page: the CSP would block them, and they are where an
        # injection would land.
        assert not re.search(rb"<script(?![^>]*\bsrc=)", page) and b" style=" not in page and b"<style" not in page
        code, headers, script = _send(url + "/static/monitor.js")
        assert code == 200 and headers["Content-Type"].startswith("text/javascript") and b"textContent" in script
        assert b"innerHTML" not in script  # the page builds its DOM from text nodes only

        for path, method in [("/api/status", "GET"), ("/api/stream", "GET"), (f"/api/batches/{b}/view", "GET"),
                             (f"/api/batches/{b}/files/x/video.mp4", "GET"), (f"/api/batches/{b}/unpause", "POST"),
                             (f"/api/batches/{b}/priority", "POST"), (f"/api/batches/{b}/cancel", "POST")]:
            code, headers, answer = _send(url + path, method=method, body={"priority": 9} if method == "POST" else None)
            assert code == 401, (path, code)
            assert "token" in json.loads(answer)["error"] and headers["X-Content-Type-Options"] == "nosniff"
            code, _, _ = _send(url + path, method=method, token="not-the-token",
                               body={"priority": 9} if method == "POST" else None)
            assert code == 401, (path, code)
        d = _state(farm, b)
        assert (d["state"], d["priority"]) == ("paused", 0)  # nothing the refused requests asked happened
        code, _, answer = _send(url + f"/api/batches/{b}/unpause", method="POST", body={}, token=token)
        assert code == 200 and json.loads(answer)["state"] == "active"  # the same request with the token


def test_a_cross_site_post_is_refused_even_with_the_token(tmp_path: Path) -> None:
    with serving_farm(tmp_path) as (farm, url, token):
        b = submit_file(farm, tmp_path / "out", {"jobs": [{"name": "a", "prompt": "a"}]}, paused=True)
        pause = url + f"/api/batches/{b}/priority"
        code, _, answer = _send(pause, method="POST", body={"priority": 7}, token=token,
                                headers={"Origin": "http://evil.example"})
        assert code == 403 and "evil.example" in json.loads(answer)["error"]
        host = url.removeprefix("http://")
        # DNS rebinding: a page of evil.example whose name now points at 127.0.0.1 is same-origin
        # with itself, so only the Host header tells.
        code, _, answer = _send(pause, method="POST", body={"priority": 7}, token=token,
                                headers={"Host": "evil.example:" + host.split(":")[1],
                                         "Origin": "http://evil.example:" + host.split(":")[1]})
        assert code == 403 and "loopback" in json.loads(answer)["error"]
        assert _state(farm, b)["priority"] == 0
        code, _, answer = _send(pause, method="POST", body={"priority": 7}, token=token,
                                headers={"Origin": url})  # the page's own origin
        assert code == 200 and json.loads(answer)["priority"] == 7
        code, _, _ = _send(pause.replace("127.0.0.1", "localhost"), method="POST", body={"priority": 8}, token=token,
                           headers={"Origin": url.replace("127.0.0.1", "localhost")})
        assert code == 200 and _state(farm, b)["priority"] == 8


def test_only_a_served_batchs_own_files_are_served(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with serving_farm(tmp_path) as (farm, url, token):
        b = submit_file(farm, out, {"jobs": [{"name": "a", "prompt": "a"}]})
        until(lambda: _state(farm, b)["state"] == "done", "the batch to end")
        led = Ledger.open_readonly(out)
        job = led.jobs()[0].id
        led.close()
        files = url + f"/api/batches/{b}/files/"
        code, headers, video = _send(files + f"{job}/video.mp4", token=token)
        assert code == 200 and headers["Content-Type"] == "video/mp4", video
        assert video == (out / job / "video.mp4").read_bytes()
        code, _, params = _send(files + f"{job}/params.json", token=token)
        assert code == 200 and json.loads(params)
        (tmp_path / "secret.txt").write_text("not yours")
        (out / "planted").mkdir()
        os.symlink(tmp_path / "secret.txt", out / "planted" / "video.mp4")  # a link inside the folder
        os.symlink(tmp_path, out / "linked")  # a folder link inside the folder
        (tmp_path / "video.mp4").write_text("not yours either")
        for rel in ["ledger.sqlite", "run.log", "../secret.txt", "%2E%2E/secret.txt", f"{job}/../../secret.txt",
                    "planted/video.mp4", "linked/video.mp4", f"{job}/latents.safetensors", ".lock",
                    "_report/../ledger.sqlite", "/etc/passwd"]:
            code, _, answer = _send(files + rel, token=token)
            assert code == 404, (rel, code)
            assert b"not yours" not in answer and b"SQLite" not in answer
        code, _, _ = _send(url + f"/api/batches/b99/files/{job}/video.mp4", token=token)
        assert code == 404  # a batch the farm does not serve has no files here


def test_the_stream_sends_the_snapshot_and_a_batch_view_has_its_grid_and_tracebacks(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    with serving_farm(tmp_path, faults=FAIL_BROKEN, retries=0) as (farm, url, token):
        b = submit_file(farm, out, {"jobs": [{"name": "fox", "prompt": "a fox"}, {"name": "broken", "prompt": "b"}],
                                    "sweep": {"seed": [0, 1]}}, owner="ann", priority=3)
        req = urllib.request.Request(url + "/api/stream", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30) as stream:
            assert stream.headers["Content-Type"].startswith("text/event-stream")
            snaps = _snapshots(stream)
            first = next(snaps)
            snap = first if first["batches"] else next(s for s in snaps if s["batches"])  # (published every 0.5 s)
        assert set(first) >= {"batches", "groups", "running", "events", "queue_depth", "url"}
        rows = [(x["id"], x["owner"], x["priority"], x["counts"]["total"]) for x in snap["batches"]]
        assert rows == [(b, "ann", 3, 4)]
        assert any(e["batch"] == b and e["kind"] == "submitted" for e in snap["events"])

        until(lambda: _state(farm, b)["state"] == "failed", "the batch to end")
        code, _, answer = _send(url + f"/api/batches/{b}/view", token=token)
        view = json.loads(answer)
        jobs = {j["id"]: j for j in view["jobs"]}
        assert code == 200 and len(jobs) == 4 and view["folder"] == str(out)
        by_name = {(j["name"], j["label"]): j for j in jobs.values()}
        print(sorted(by_name))
        done, failed = by_name[("fox", "seed 0")], by_name[("broken", "seed 1")]
        assert done["state"] == "done" and done["video"].endswith("/video.mp4") and done["seconds"]["sampling"] > 0
        assert failed["state"] == "failed" and failed["stage"] == "sampling"
        assert "injected failure in sampling of job broken" in failed["error"]
        assert "Traceback (most recent call last)" in failed["traceback"]
        # The report's grids: one table per job of the file, the seeds as columns, cells by job id.
        assert [(g["name"], g["col_axis"], g["col_values"]) for g in view["grids"]] == [
            ("fox", "seed", ["0", "1"]), ("broken", "seed", ["0", "1"])]
        cells = [ids for g in view["grids"] for r in g["rows"] for ids in r["cells"]]
        assert sorted(i for ids in cells for i in ids) == sorted(jobs)
        assert any(e["job"] == failed["id"] and e["kind"] == "traceback" for e in view["events"])


def test_a_running_job_is_in_the_snapshot_with_its_stage(tmp_path: Path) -> None:
    slow = {"slow": {"job": "slow", "stage": "encode", "seconds": 1.0}}
    with serving_farm(tmp_path, faults=slow) as (farm, url, token):
        b = submit_file(farm, tmp_path / "out", {"jobs": [{"name": "slow", "prompt": "s"}]})
        seen: list[dict[str, Any]] = []

        def running() -> bool:
            seen[:] = farm.snapshot().get("running", [])
            return bool(seen)

        until(running, "the job to show as running")
        assert seen[0]["batch"] == b and seen[0]["job"].startswith("slow-") and seen[0]["stage"]
        assert seen[0]["stage_s"] >= 0
        until(lambda: _state(farm, b)["state"] == "done", "the batch to end")
        until(lambda: not farm.snapshot()["running"], "the running list to empty")


def test_a_running_jobs_preview_is_in_the_snapshot_and_served_as_a_regular_file_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake sampling of 40 steps of 0.1 s beside the farm's loop, a preview every 0.2 s: the
    snapshot's row names a newer step each time, its URL serves that picture; a link or a FIFO at
    a preview's name is not served; the job done, its preview is gone."""
    monkeypatch.setenv("PAN2_FAKE_STEP_SECONDS", "0.1")
    out = tmp_path / "out"
    with serving_farm(tmp_path, executor=ThreadedExecutor) as (farm, url, token):
        b = submit_file(farm, out, {"jobs": [{"name": "fox", "prompt": "f", "steps": 40, "preview_every": 0.2}]})
        rows: list[dict[str, Any]] = []

        def previewed(after: int) -> bool:
            row = next(iter(farm.snapshot().get("running", [])), None)
            if row is None or row["preview"] is None or row["preview"]["step"] <= after:
                return False
            rows.append(row)
            return True

        until(lambda: previewed(0), "a preview in the snapshot")
        until(lambda: previewed(rows[0]["preview"]["step"]), "a newer preview in the snapshot")
        first, later = rows[0], rows[-1]
        job = first["job"]
        assert first["preview"]["steps"] == 40 and later["preview"]["step"] > first["preview"]["step"]
        assert first["preview"]["url"] == f"/api/batches/{b}/files/{job}/preview.webp?step={first['preview']['step']}"
        code, headers, image = _send(url + later["preview"]["url"], token=token)
        assert code == 200 and headers["Content-Type"] == "image/webp" and image[:4] == b"RIFF"
        assert read_note(image).step >= later["preview"]["step"]  # (or a newer one, replaced since)
        code, _, _ = _send(url + later["preview"]["url"])
        assert code == 401  # a preview needs the token like every file
        (tmp_path / "secret.webp").write_bytes(b"RIFF not yours")
        for planted in ("linked", "fifo"):
            (out / planted).mkdir()
        os.symlink(tmp_path / "secret.webp", out / "linked" / "preview.webp")
        os.mkfifo(out / "fifo" / "preview.webp")  # opened without waiting: refused at once
        for rel in ("linked/preview.webp", "fifo/preview.webp", f"{job}/preview.png", f"{job}/.preview.webp.tmp-1"):
            code, _, answer = _send(url + f"/api/batches/{b}/files/{rel}", token=token)
            assert code == 404 and b"not yours" not in answer, rel
        until(lambda: _state(farm, b)["state"] == "done", "the batch to end")
        assert not (out / job / "preview.webp").exists()
        code, _, _ = _send(url + later["preview"]["url"], token=token)
        assert code == 404


@pytest.mark.parametrize("path", ["/static/monitor.py", "/static/../service.py", "/static/report.html"])
def test_nothing_but_the_pages_files_comes_from_the_package(tmp_path: Path, path: str) -> None:
    with serving_farm(tmp_path) as (farm, url, token):
        code, _, _ = _send(url + path, token=token)
        assert code in (401, 404)
