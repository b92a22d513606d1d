"""The farm's own HTTP API as any client meets it (plain HTTP, no pan2-render on the client's side):
a batch posted as YAML text renders; a bad one is refused with every problem and nothing queued;
folders and files outside the farm's roots are refused, never read or written; a user acts on their
own batches only, and the owner is always the token's user; a malformed request is a 4xx, never a
500 or a traceback in the farm's log; a request the main thread is too busy to answer in time is a
503 with an id, and is carried out later."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from runner_helpers import serving_farm, until

from pan2render.media.video import probe_mp4
from pan2render.runner.farm import api as api_module

BATCH = {"model": "tiny", "preset": "tiny-preview", "defaults": {"steps": 2},
         "jobs": [{"name": "fox", "prompt": "a fox"}, {"name": "owl", "prompt": "an owl"}]}


def send(url: str, *, token: str | None = None, method: str = "GET", body: Any = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text.decode(errors="replace")


def post_batch(url: str, token: str, tmp_path: Path, doc: dict[str, Any] | str, out: str,
               **extra: Any) -> tuple[int, Any]:
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False)
    return send(f"{url}/api/batches", token=token, method="POST",
                body={"text": text, "name": "b.yaml", "base": str(tmp_path), "out": out, **extra})



def test_a_batch_posted_as_yaml_text_renders(tmp_path: Path) -> None:
    with serving_farm(tmp_path) as (farm, url, token):
        code, b = post_batch(url, token, tmp_path, BATCH, "out")  # relative: inside the outputs root
        assert code == 201 and b["id"] == "b1" and b["counts"]["total"] == 2 and b["owner"] == "admin"
        assert b["out_dir"] == str((tmp_path / "out").resolve())
        until(lambda: send(f"{url}/api/batches/b1", token=token)[1]["state"] == "done", "the batch to render")
        assert len(list((tmp_path / "out").glob("*/video.mp4"))) == 2
        until(lambda: "2 done, 0 failed" in send(f"{url}/api/batches/b1/log?offset=0", token=token)[1]["text"],
              "the batch's closing lines")


def test_a_story_posted_to_the_farm_renders_its_segments_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    """Segments go through the farm's own validation (intake reads a batch as `run` does)."""
    story = {**BATCH, "jobs": [{"name": "story", "prompts": ["a fox wakes", "the fox runs", "the fox sleeps"]}]}
    bad = {**BATCH, "jobs": [{"name": "story", "prompts": ["a", "b"], "segments": 3}]}
    with serving_farm(tmp_path) as (farm, url, token):
        code, body = post_batch(url, token, tmp_path, bad, "bad")
        assert code == 422 and any(p.startswith(f"{tmp_path / 'b.yaml'}:10: jobs[0].segments: got 3 but the job "
                                                "lists 2 prompts") for p in body["problems"]), body
        code, b = post_batch(url, token, tmp_path, story, "out")
        assert code == 201
        until(lambda: send(f"{url}/api/batches/{b['id']}", token=token)[1]["state"] == "done", "the story to render")
        (video,) = list((tmp_path / "out").glob("story-*/video.mp4"))
        assert probe_mp4(video).frames == 3 * 17 - 2  # tiny-preview's 17 frames a segment, each join once
        (job,) = send(f"{url}/api/batches/{b['id']}/view", token=token)[1]["jobs"]
        assert job["long_video"] == "3 segments, 49 frames at 8 fps = 6.1 s"


def test_a_bad_batch_gets_every_problem_and_nothing_is_queued(tmp_path: Path) -> None:
    bad = "model: tiny\npreset: tiny-preview\njobs:\n  - prompt: a\n    steps: 0\n  - prompt: b\n    guidanse: 3\n"
    with serving_farm(tmp_path) as (farm, url, token):
        code, body = post_batch(url, token, tmp_path, bad, "out")
        assert code == 422 and "nothing was queued" in body["error"]
        assert any(p.startswith(f"{tmp_path / 'b.yaml'}:5: jobs[0].steps") for p in body["problems"]), body
        assert any(":7: jobs[1]" in p and "guidance" in p for p in body["problems"]), body  # did-you-mean
        assert send(f"{url}/api/batches?all=1", token=token)[1] == [] and not (tmp_path / "out").exists()
        code, body = post_batch(url, token, tmp_path, BATCH, "out", set=["steps=0"])
        assert code == 422 and any("--set steps=0" in p for p in body["problems"])


def test_folders_and_files_outside_the_roots_are_refused_unread(tmp_path: Path) -> None:
    inside = tmp_path / "inside"
    inside.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.mkfifo(outside / "frame.png")  # read, it would block whoever reads it
    (outside / "prompts.txt").write_text("a secret prompt\n")
    (inside / "link.png").symlink_to(outside / "frame.png")
    with serving_farm(inside) as (farm, url, token):
        code, body = post_batch(url, token, inside, BATCH, str(outside / "out"))
        assert code == 400 and "outside the folders this farm writes to" in body["error"]
        assert not (outside / "out").exists()
        code, body = post_batch(url, token, inside, BATCH, "../outside/out")  # a relative escape, the same
        assert code == 400 and not (outside / "out").exists()
        for doc in ({**BATCH, "defaults": {"image": str(outside / "frame.png")}},
                    {**BATCH, "defaults": {"image": "link.png"}},  # a link inside leading outside
                    {"model": "tiny", "preset": "tiny-preview", "prompts_file": str(outside / "prompts.txt")},
                    {**BATCH, "model": str(outside)}):
            code, body = post_batch(url, token, inside, doc, "out")
            assert code == 422 and any("outside the folders this farm reads from" in p for p in body["problems"]), body
            assert "secret" not in json.dumps(body)
        code, body = post_batch(url, token, inside, BATCH, "out", base=str(outside))
        assert code == 400 and body["error"].startswith("base ")
        assert send(f"{url}/api/batches?all=1", token=token)[1] == [] and not (inside / "out").exists()


def test_a_user_acts_on_their_own_batches_and_the_owner_is_the_tokens(tmp_path: Path) -> None:
    users = {"ann": "", "bob": ""}
    with serving_farm(tmp_path, users=users) as (farm, url, admin):
        code, b = post_batch(url, users["ann"], tmp_path, BATCH, "ann", owner="mallory\x1b[31m", priority=0)
        assert code == 201 and b["owner"] == "ann"  # the token's user, whatever the request says
        until(lambda: send(f"{url}/api/batches/b1", token=admin)[1]["state"] == "done", "the batch to render")
        assert send(f"{url}/api/whoami", token=users["bob"])[1] == {"user": "bob", "admin": False}
        for action, body in (("pause", {}), ("unpause", {}), ("cancel", {}), ("cancel", {"job": "fox"}),
                             ("retry", {}), ("hide", {}), ("priority", {"priority": 9})):
            code, answer = send(f"{url}/api/batches/{b['id']}/{action}", token=users["bob"], method="POST", body=body)
            assert code == 403 and "ann's" in answer["error"], (action, answer)
        assert send(f"{url}/api/stop", token=users["ann"], method="POST", body={})[0] == 403  # the admin's alone
        code, answer = send(f"{url}/api/batches/{b['id']}/retry", token=users["ann"], method="POST", body={})
        assert code == 200 and answer["state"] == "active", answer
        until(lambda: send(f"{url}/api/batches/b1", token=admin)[1]["state"] == "done", "the retried batch to end")
        code, answer = send(f"{url}/api/batches/{b['id']}/hide", token=admin, method="POST", body={})
        assert code == 200 and answer["hidden"]
        assert farm.ask(lambda: farm.queue.get(b["id"]).owner).result(timeout=30) == "ann"
        assert send(f"{url}/api/batches", token=admin)[1] == []  # hidden: no longer listed


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("POST", "/api/batches", {}, 400),
    ("POST", "/api/batches", {"request": {}}, 400),
    ("POST", "/api/batches", "a string", 400),
    ("POST", "/api/batches", None, 400),
    ("POST", "/api/batches", {"text": "jobs: 5", "out": "o"}, 422),
    ("POST", "/api/batches", {"text": 5, "out": "o"}, 400),
    ("POST", "/api/batches", {"text": "x", "out": "o", "priority": 1.5}, 400),
    ("POST", "/api/batches", {"text": "x", "out": "o", "priority": True}, 400),
    ("POST", "/api/batches/b1/priority", {"priority": "high"}, 400),
    ("POST", "/api/batches/b1/priority", {}, 400),
    ("POST", "/api/batches/b1/priority", {"priority": 10 ** 100}, 400),
    ("POST", "/api/batches/b1/priority", {"priority": 1.5}, 400),
    ("POST", "/api/batches/b1/priority", {"priority": True}, 400),
    ("RAW", "/api/batches/b1/priority", b'{"priority": NaN}', 400),
    ("RAW", "/api/batches/b1/priority", b'{"priority": Infinity}', 400),
    ("RAW", "/api/batches/b1/pause", b"[" * 100_000 + b"]" * 100_000, 400),
    ("RAW", "/api/batches/b1/pause", b"\xff\xfe not json", 400),
    ("POST", "/api/batches/b1/cancel", {"job": 5}, 400),
    ("GET", "/api/batches/b99/log", None, 404),
    ("GET", "/api/batches/b99999999999999999999999/log", None, 404),
    ("GET", f"/api/batches/b{2**63}", None, 404),
    ("GET", "/api/batches/b1/log?offset=99999999999999999999", None, 400),
    ("GET", "/api/batches/b1/log?offset=-1", None, 400),
    ("GET", "/api/requests/r1-nope", None, 404),
    ("GET", "/api/no-such-route", None, 404),
    ("PUT", "/api/batches", {}, 405),
])
def test_a_malformed_request_is_a_4xx_and_logs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       method: str, path: str, body: Any, status: int) -> None:
    with serving_farm(tmp_path) as (farm, url, token):
        assert post_batch(url, token, tmp_path, {**BATCH, "defaults": {"steps": 40}}, "out")[0] == 201
        capsys.readouterr()
        if method == "RAW":
            code, answer = send(url + path, token=token, method="POST", raw=body)
        else:
            code, answer = send(url + path, token=token, method=method,
                                raw=b"" if body is None and method == "POST" else None, body=body)
        assert code == status, answer
        assert isinstance(answer, dict) and answer.get("error"), answer
        logged = capsys.readouterr().out
        assert "Traceback" not in logged and "API error" not in logged, logged


@pytest.mark.parametrize("header", ["Bearer caf\u00e9-token", "Bearer " + "x" * 10_000, "Basic abc", ""])
def test_an_odd_authorization_header_is_a_401_and_logs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               header: str) -> None:
    with serving_farm(tmp_path) as (_, url, _token):
        capsys.readouterr()
        req = urllib.request.Request(f"{url}/api/status", headers={"Authorization": header.encode().decode("latin-1")})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 401
        assert capsys.readouterr().out == ""


def test_a_request_the_main_thread_is_too_busy_for_is_a_503_then_carried_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_module, "ASK_TIMEOUT_S", 0.5)
    with serving_farm(tmp_path) as (farm, url, token):
        code, b = post_batch(url, token, tmp_path, {**BATCH, "defaults": {"steps": 40}}, "out")
        assert code == 201
        busy = threading.Event()
        farm.ask(lambda: busy.wait(5))  # the main thread holds this request for up to 5 s
        code, body = send(f"{url}/api/batches/{b['id']}/pause", token=token, method="POST", body={})
        assert code == 503 and body["applied"] is False and body["request"], body
        busy.set()
        lookup = f"{url}/api/requests/{body['request']}"
        outcome = until(lambda: (o := send(lookup, token=token)[1])["state"] != "queued" and o,
                        "the request to be carried out")
        assert outcome["applied"] and outcome["answer"]["state"] == "paused"
        assert farm.ask(lambda: farm.queue.get(b["id"]).state.value).result(timeout=30) == "paused"
        assert send(f"{url}/api/status", token=token)[0] == 200  # the farm's loop went on


def test_the_log_route_reads_no_link_and_no_fifo(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the farm user's secret\n")
    with serving_farm(tmp_path) as (farm, url, token):
        code, b = post_batch(url, token, tmp_path, {**BATCH, "defaults": {"steps": 40}}, "out")
        farm.ask(lambda: farm.actions.pause(b["id"], paused=True)).result(timeout=30)
        log = tmp_path / "out" / "run.log"
        until(lambda: log.exists(), "the run log")
        log.unlink()
        log.symlink_to(secret)
        code, body = send(f"{url}/api/batches/{b['id']}/log", token=token)
        assert code == 404 and "secret" not in json.dumps(body)
        log.unlink()
        os.mkfifo(log)
        started = time.monotonic()
        code, body = send(f"{url}/api/batches/{b['id']}/log", token=token)
        assert code == 404 and time.monotonic() - started < 10
        assert send(f"{url}/api/status", token=token)[0] == 200


def test_a_flood_of_requests_and_slow_connections_leave_the_farm_answering(tmp_path: Path) -> None:
    import socket
    from concurrent.futures import ThreadPoolExecutor

    with serving_farm(tmp_path) as (farm, url, token):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        slow = []
        for _ in range(300):  # connections that send half a request and then nothing
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            slow.append(s)
        try:
            def one(i: int) -> int:
                return send(f"{url}/api/status", token=token if i % 2 else "wrong")[0]

            with ThreadPoolExecutor(max_workers=16) as pool:
                codes = list(pool.map(one, range(2000)))
            assert sorted(set(codes)) == [200, 401] and codes.count(200) == 1000
            code, b = post_batch(url, token, tmp_path, BATCH, "out")  # and it still takes work
            assert code == 201
        finally:
            for s in slow:
                s.close()
