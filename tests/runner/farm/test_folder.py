"""The farm's folder is its owner's alone: `farm start` refuses a root others may write, a planted
or readable token, and a link at its log; clients read farm.json and the token only from a root
that passes the same check, so a swapped farm.json cannot send the token elsewhere. Users' tokens
are kept hashed, readable by the owner only. Addresses: an IPv6 literal is bracketed in URLs, and a
non-loopback farm says clients should use TLS."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner_helpers import stop_farm

from pan2render.client import find_farm
from pan2render.runner.farm.folder import (
    INFO_NAME,
    TOKEN_NAME,
    UnsafeRoot,
    check_root,
    ensure_token,
    read_info,
    read_token,
    url_host,
)
from pan2render.runner.farm.users import ADMIN, UserError, Users

CLI = [sys.executable, "-m", "pan2render.runner.cli"]
OTHER_UID = 65534  # nobody: the tests run as root here, or the chown below is skipped


def _start(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PAN2_RENDER_EXECUTOR": "local", "PAN2_RENDER_FARM": str(root)}
    return subprocess.run([*CLI, "farm", "start", "--root", str(root), "--cpu-gpus", "1", *extra], env=env,
                          capture_output=True, text=True, timeout=120)


def test_farm_start_refuses_a_root_others_may_write(tmp_path: Path) -> None:
    root = tmp_path / "farm"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    done = _start(root)
    assert done.returncode == 2 and "chmod go-w" in done.stderr and str(root) in done.stderr
    assert sorted(os.listdir(root)) == []  # nothing written, no token made
    with pytest.raises(UnsafeRoot, match="group and others"):
        check_root(root)


@pytest.mark.skipif(os.getuid() != 0, reason="planting a file of another user needs root")
def test_a_planted_token_and_a_swapped_farm_json_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "farm"
    root.mkdir(mode=0o700)
    token = root / TOKEN_NAME
    token.write_text("planted\n")
    os.chown(token, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeRoot, match="belongs to uid 65534"):
        ensure_token(root)
    done = _start(root)
    assert done.returncode != 0 and "belongs to uid" in done.stdout + done.stderr
    token.unlink()
    assert len(ensure_token(root)) == 64 and stat.S_IMODE(token.stat().st_mode) == 0o600

    info = root / INFO_NAME
    info.write_text(json.dumps({"url": "http://attacker.example:1", "pid": 1}))
    os.chown(info, OTHER_UID, OTHER_UID)
    assert read_info(root) is None and find_farm(root) is None  # the token never goes there
    os.chown(info, os.getuid(), os.getgid())
    os.chmod(root, 0o770)  # a root the group may write: nothing in it is trusted
    assert read_info(root) is None and read_token(root) is None


def test_a_readable_token_and_a_link_at_the_log_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "farm"
    root.mkdir(mode=0o700)
    (root / TOKEN_NAME).write_text("x" * 64 + "\n")
    os.chmod(root / TOKEN_NAME, 0o644)
    with pytest.raises(UnsafeRoot, match="chmod 600"):
        ensure_token(root)
    os.chmod(root / TOKEN_NAME, 0o600)
    elsewhere = tmp_path / "elsewhere.log"
    elsewhere.write_text("someone's file\n")
    (root / "farm.log").symlink_to(elsewhere)
    done = _start(root)
    assert done.returncode == 2 and "farm.log" in done.stderr and "remove it" in done.stderr
    assert elsewhere.read_text() == "someone's file\n"  # never appended through the link


def test_users_tokens_are_kept_hashed_and_named_safely(tmp_path: Path) -> None:
    root = tmp_path / "farm"
    root.mkdir(mode=0o700)
    users = Users(root, admin_token="a" * 64)
    ann = users.add("ann")
    text = (root / "users.json").read_text()
    assert ann not in text and ann.startswith("p2r_") and stat.S_IMODE((root / "users.json").stat().st_mode) == 0o600
    assert users.who(ann).name == "ann" and users.who("a" * 64).name == ADMIN and users.who("nope") is None
    for bad in ("Ann", "a b", "ann\x1b[31m", "\u202eann", "admin", "", "x" * 40):
        with pytest.raises(UserError):
            users.add(bad)
    with pytest.raises(UserError, match="exists already"):
        users.add("ann")
    Users(root).remove("ann")  # another process's change is read again
    assert users.who(ann) is None


def test_the_user_commands(tmp_path: Path) -> None:
    root = tmp_path / "farm"
    env = {**os.environ, "PAN2_RENDER_FARM": str(root)}
    added = subprocess.run([*CLI, "farm", "user", "add", "ann"], env=env, capture_output=True, text=True, timeout=60)
    assert added.returncode == 0 and added.stdout.strip().startswith("p2r_") and "shown only now" in added.stderr
    listed = subprocess.run([*CLI, "farm", "user", "list"], env=env, capture_output=True, text=True, timeout=60)
    assert listed.stdout.startswith("ann ")
    bad = subprocess.run([*CLI, "farm", "user", "add", "Bad Name"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "lowercase" in bad.stderr
    gone = subprocess.run([*CLI, "farm", "user", "remove", "ann"], env=env, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 0 and Users(root).all() == []


def test_urls_bracket_an_ipv6_literal() -> None:
    assert url_host("::1") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1" and url_host("[::1]") == "[::1]"


def test_a_farm_on_ipv6_loopback_is_reached_by_its_own_clients(tmp_path: Path) -> None:
    import socket

    from runner_helpers import serving_farm

    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    from pan2render.client import FarmClient

    with serving_farm(tmp_path, host="::1") as (farm, url, token):
        assert url.startswith("http://[::1]:")
        client = FarmClient(url, token)
        deadline = time.monotonic() + 30
        while "root" not in (status := client.status()):  # (until the farm's first pass published)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert status["root"] == str(farm.root)
        with pytest.raises(Exception) as refused:
            client.act("b1", "pause")
        assert getattr(refused.value, "status", None) == 404  # reached the farm: no such batch, not a 403 Host


def test_two_starts_at_once_make_one_farm_and_both_say_so(tmp_path: Path) -> None:
    root = tmp_path / "farm"
    env = {**os.environ, "PAN2_RENDER_EXECUTOR": "local", "PAN2_RENDER_FARM": str(root)}
    cmd = [*CLI, "farm", "start", "--cpu-gpus", "1"]
    starts = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in starts]
        print(outs)
        assert [p.returncode for p in starts] == [0, 0]
        said = sorted("already runs" in out for out, _ in outs)
        assert said == [False, True] and not any("Traceback" in err for _, err in outs)
    finally:
        stop_farm(env, root)


def test_farm_stop_of_a_farm_that_does_not_end_says_so(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from pan2render.runner.cli import farm as farm_cli
    from pan2render.runner.cli import main as cli

    class Stubborn:  # answers, takes the stop, and goes on running
        def stop(self) -> dict[str, bool]:
            return {"stopping": True}

    monkeypatch.setattr(farm_cli, "find_farm", lambda root: Stubborn())
    monkeypatch.setattr(farm_cli, "read_info", lambda root: {"pid": os.getpid()})
    monkeypatch.setattr(farm_cli, "STOP_TIMEOUT_S", 0.3)
    assert cli.main(["farm", "stop", "--root", str(tmp_path)]) == 3
    assert "has not ended" in capsys.readouterr().err


def test_a_farm_on_every_interface_says_how_clients_reach_it_and_that_it_is_plain_http(tmp_path: Path) -> None:
    from pan2render.runner.farm.api import start_api
    from pan2render.runner.farm.config import FarmConfig
    from pan2render.runner.farm.intake import Roots

    said: list[str] = []
    config = FarmConfig(root=tmp_path, host="0.0.0.0")
    farm = type("F", (), {"root": tmp_path, "log": print, "config": config})()  # what the API needs to start
    api = start_api(farm, users=Users(tmp_path, admin_token="t" * 64), roots=Roots.of([tmp_path], [tmp_path]),
                    host="0.0.0.0", port=0, say=said.append)
    try:
        assert api.url.startswith("http://127.0.0.1:")  # what a client on this machine uses
        assert len(said) == 1 and "plain HTTP" in said[0] and "TLS" in said[0]
    finally:
        api.stop()


def test_following_a_batch_shows_its_last_lines_when_the_farm_is_lost(tmp_path: Path) -> None:
    from pan2render.client import FarmClient, FarmError

    out = tmp_path / "out"
    out.mkdir()
    (out / "run.log").write_text("2026-01-01T00:00:00Z first\n2026-01-01T00:00:01Z second\n2026-01-01T00:00:02Z last\n")
    answers = [{"text": "2026-01-01T00:00:00Z first\n", "offset": 27, "batch": {"exit_code": None}}]

    class Lost(FarmClient):
        def get(self, path: str, *, timeout_s: float = 30.0) -> object:
            if answers:
                return answers.pop(0)
            raise FarmError(0, "the farm at http://x does not answer")

    seen: list[str] = []
    with pytest.raises(FarmError):
        Lost("http://x", "t").follow("b1", on_line=seen.append, out_dir=out)
    assert [line.split(" ", 1)[1] for line in seen] == ["first", "second", "last"]
