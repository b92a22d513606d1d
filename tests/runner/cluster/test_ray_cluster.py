"""A run that joins a cluster says whose it is: the node `node start` keeps up, or a `ray start` by
this user or another one (the owner of the socket its GCS listens on), or one started elsewhere;
Ray's token-authentication banner goes to the run log; the token file a local cluster uses is its
owner's alone, and a local cluster on an address other machines reach is refused."""

from __future__ import annotations

import getpass
import os
import socket
from pathlib import Path

import pytest

from pan2render.runner.cluster.ray_cluster import listening_user, whose


def test_the_owner_of_a_local_gcs_port_is_named() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        assert listening_user(port) == getpass.getuser()
        assert whose(f"127.0.0.1:{port}", kept_up_here=None).startswith("a Ray cluster you started")
        kept = whose(f"127.0.0.1:{port}", kept_up_here=f"127.0.0.1:{port}")
        assert kept == "the Ray node `pan2-render node start` keeps up on this machine"
    finally:
        server.close()
    assert listening_user(port) is None  # nothing listens there now
    assert "started elsewhere" in whose(f"127.0.0.1:{port}", kept_up_here=None)


def test_another_users_cluster_is_named_as_theirs(tmp_path: Path) -> None:
    """A kernel socket table row of a GCS listening on port 6379 (0x18EB) owned by uid 0 (root)."""
    (tmp_path / "tcp").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:18EB 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0\n"  # noqa: E501 - the kernel's table as it is
        "   1: 0100007F:18EC 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 2 1 0 100 0 0 10 0\n")  # noqa: E501
    assert listening_user(6379, proc_net=tmp_path) == "root"
    assert listening_user(6380, proc_net=tmp_path) is None  # an established connection, not a listener


def test_rays_token_authentication_banner_goes_to_the_run_log_not_the_terminal(
        capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from pan2render.runner.cluster.ray_cluster import RAY_TOKEN_AUTH_LOGGER, ray_banner_to

    noted: list[str] = []
    ray_banner_to(noted.append)
    logger = logging.getLogger(RAY_TOKEN_AUTH_LOGGER)
    logger.addHandler(handler := logging.StreamHandler())  # as Ray's own handler prints it
    try:
        logger.warning("Token authentication is enabled for this Ray cluster.")
        logging.getLogger("ray.other").warning("another warning stays where it was")
    finally:
        logger.removeHandler(handler)
    assert noted == ["Ray: Token authentication is enabled for this Ray cluster."]
    assert "Token authentication" not in capsys.readouterr().err


# ------------------------------------------------------------------------ a local cluster's token
@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME of the test's own, where Ray keeps its token (.ray/auth_token), token mode as Ray's default."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_a_missing_token_is_written_readable_by_its_owner_alone(home: Path) -> None:
    from pan2render.runner.cluster.ray_cluster import write_ray_token_if_missing

    write_ray_token_if_missing()
    token = home / ".ray" / "auth_token"
    assert oct(token.stat().st_mode & 0o777) == "0o600"
    assert len(token.read_text()) == 64 and int(token.read_text(), 16) > 0  # 256 bits, as Ray draws them
    before = token.read_text()
    write_ray_token_if_missing()
    assert token.read_text() == before  # one there is Ray's: never replaced


def test_a_token_others_can_read_is_made_private_and_said(home: Path) -> None:
    from pan2render.runner.cluster.ray_cluster import keep_ray_token_private

    token = home / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("t" * 64)
    token.chmod(0o644)  # as Ray writes it
    note = keep_ray_token_private()
    assert oct(token.stat().st_mode & 0o777) == "0o600"
    assert note is not None and "mode 644" in note and str(token) in note
    assert keep_ray_token_private() is None  # nothing more to say


@pytest.mark.parametrize("env", [{"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_TOKEN_PATH": "/elsewhere"},
                                 {"RAY_AUTH_TOKEN": "t" * 64}], ids=["auth off", "token path", "token in env"])
def test_the_token_file_is_left_alone_where_ray_does_not_use_it(
        home: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    from pan2render.runner.cluster.ray_cluster import keep_ray_token_private, write_ray_token_if_missing

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    token = home / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("t" * 64)
    token.chmod(0o644)
    write_ray_token_if_missing()
    assert keep_ray_token_private() is None and oct(token.stat().st_mode & 0o777) == "0o644"


def test_a_local_cluster_on_an_address_other_machines_reach_is_refused() -> None:
    from pan2render.runner.cluster.ray_cluster import RAY_SINGLE_MACHINE_ENV, ExposedClusterError, check_loopback

    check_loopback("127.0.0.1")
    check_loopback("::1")
    with pytest.raises(ExposedClusterError, match=f"came up on 192.0.2.2.*{RAY_SINGLE_MACHINE_ENV}=0"):
        check_loopback("192.0.2.2")


def test_the_loopback_switch_is_set_for_rays_import_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Left in the environment, every `ray start` the process ran later (a head node, `node start`)
    would come up for this machine alone and print no address to join."""
    from pan2render.runner.cluster.ray_cluster import RAY_SINGLE_MACHINE_ENV, loopback_only

    monkeypatch.delenv(RAY_SINGLE_MACHINE_ENV, raising=False)
    with loopback_only():
        assert os.environ[RAY_SINGLE_MACHINE_ENV] == "0"
    assert RAY_SINGLE_MACHINE_ENV not in os.environ
    monkeypatch.setenv(RAY_SINGLE_MACHINE_ENV, "1")
    with loopback_only():
        pass
    assert os.environ[RAY_SINGLE_MACHINE_ENV] == "1"
