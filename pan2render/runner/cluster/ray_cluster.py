"""Ray clusters from the outside: which address a run may join, the node kept up on this
machine, and a watch on a cluster's GCS. Used by the CLI before any executor exists, and by the Ray
executor."""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import pwd
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pan2render.runner.protocol.failures import ClusterLostError


class GcsLost(ClusterLostError):
    """The cluster's GCS (on its head node) stopped accepting connections for longer than
    :func:`gcs_lost_after_s`: the head node or its GCS process died."""


class ClusterConnectError(RuntimeError):
    """``--address`` names no reachable Ray cluster (or one we may not join)."""


RAY_CLIENT_SCHEME = "ray://"  # a Ray client connection: needs the `ray[client]` extra (grpcio)


def ray_client_missing(address: str | None) -> str | None:
    """Why ``address`` cannot be joined from this install, checked before anything is written:
    a ``ray://`` address needs Ray's client extra. None when nothing is missing."""
    if address is None or not address.startswith(RAY_CLIENT_SCHEME):
        return None
    try:
        import grpc  # noqa: F401 - what ray[client] adds
    except ImportError:
        return (f"--address {address}: a ray:// address needs Ray's client extra, which is not installed; "
                f"install it with `pip install 'pan2-render[client]'` (or `pip install 'ray[client]'`), or "
                f"run on a node of the cluster with --address auto")
    return None


# ---------------------------------------------------------------------- a render node kept up
def node_start_command(*, gpus: int, port: int) -> list[str]:
    """``ray start`` for a head node on this machine that runs join (`running_local_node`): ``gpus``
    GPUs (logical on a CPU-only machine), no dashboard (slow to start, not needed). Its CPU count is
    its GPU count: the runner's actors take no CPU, and Ray keeps one idle worker process per CPU
    it counts."""
    import sys

    return [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
            f"--num-gpus={gpus}", f"--num-cpus={gpus}", "--include-dashboard=false", "--disable-usage-stats"]


def running_local_node() -> tuple[str | None, str | None]:
    """(GCS address of the Ray node that `ray start` left running on this machine, or None; a note
    when one is recorded but does not answer). ``ray.init()`` without an address joins that node
    itself, and then refuses the resources a new local cluster is started with: so a run looks
    first. Ray records the node for that purpose (`ray start` writes it, Ray's stop command removes it) but
    offers no public call that reads it, hence the one private import, guarded."""
    try:
        from ray._private.services import find_bootstrap_address
    except ImportError:
        return None, None
    address = find_bootstrap_address(None)
    if not address:
        return None, None
    target = parse_gcs_address(address)
    if target is None:
        return None, None
    try:
        socket.create_connection(target, timeout=2).close()
    except OSError as e:
        return None, (f"the Ray node recorded on this machine ({address}) does not answer ({e}): it was "
                      f"stopped without Ray's stop command; starting a local cluster instead")
    return address, None



# ------------------------------------------------------------- a local cluster: this machine's alone
# Ray's switch between a cluster of one machine and one that other machines may join, read once
# when `ray` is imported (ray._private.ray_constants). At 0 (Ray's default on macOS and Windows) a
# new node takes the loopback address as its IP, and every process of the node listens there alone:
# GCS, raylet, agents, workers, the driver's own core worker. At 1 (the default on Linux) they listen
# on the host's address or every interface. A run joining a cluster is not affected: it takes the
# address of the node it joins.
RAY_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Around the first ``import ray`` of a process that may start a local cluster: the cluster
    listens on the loopback address alone (Ray reads the switch when ``ray._private.ray_constants``
    is imported, and only then; :func:`check_loopback` checks the node once it is up). The switch
    is set for the import only: left in this process's environment, every ``ray start`` this
    process ran afterwards would inherit it (a test's head node, a `node start`)."""
    before = os.environ.get(RAY_SINGLE_MACHINE_ENV)
    os.environ[RAY_SINGLE_MACHINE_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RAY_SINGLE_MACHINE_ENV, None)
        else:
            os.environ[RAY_SINGLE_MACHINE_ENV] = before


class ExposedClusterError(RuntimeError):
    """A local cluster came up on an address other machines can reach."""


def check_loopback(node_ip: str) -> None:
    """ExposedClusterError unless ``node_ip``, the address of the local node just started, is a
    loopback one."""
    import ipaddress

    try:
        loopback = ipaddress.ip_address(node_ip).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ExposedClusterError(
            f"the local Ray cluster came up on {node_ip}, an address other machines can reach, not on "
            f"127.0.0.1: Ray was imported in this process before pan2-render could ask for a cluster of this "
            f"machine alone. Set {RAY_SINGLE_MACHINE_ENV}=0 in the environment before Ray is imported, or "
            f"join a cluster with --address")


# Where Ray keeps the token of its token authentication (on by default for a cluster ray.init or
# `ray start --head` starts, as in Ray 2.60), unless RAY_AUTH_TOKEN holds the token or
# RAY_AUTH_TOKEN_PATH names another file. Ray writes it with the process's umask (0644: any user of
# the machine can read it when the home folder can be read), and whoever holds the token may join
# the cluster and run code as its user.
RAY_TOKEN_PATH = Path(".ray") / "auth_token"
RAY_TOKEN_HEX_BYTES = 32  # 256 random bits, as Ray's own generator draws


def ray_token_file() -> Path | None:
    """The token file a Ray started here reads (and writes when it is missing); None where Ray does
    not use ours: token authentication turned off (RAY_AUTH_MODE other than `token`), or the token
    given through RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH (the user's own choice of file)."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        return None
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return None
    return Path.home() / RAY_TOKEN_PATH


def write_ray_token_if_missing() -> None:
    """Before a local cluster starts (Ray would write the token file with the umask's mode): the
    file written here first, readable by its owner from the start, with a new token."""
    import secrets

    path = ray_token_file()
    if path is None or path.exists():
        return
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # written meanwhile (another run starting): Ray reads that one
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(RAY_TOKEN_HEX_BYTES))


def keep_ray_token_private() -> str | None:
    """Ray's token file, readable by its owner alone: made so (chmod 600) where group or others
    could read it. A line for the user when it changed the file (or could not), else None."""
    import stat

    path = ray_token_file()
    try:
        st = path.stat() if path is not None else None
    except FileNotFoundError:
        st = None
    if st is None or not st.st_mode & 0o077:
        return None
    mode = f"{stat.S_IMODE(st.st_mode):o}"
    if st.st_uid != os.getuid():
        return (f"Ray's token file {path} belongs to uid {st.st_uid}, not to you, and may be read by others "
                f"(mode {mode}): whoever reads it may join your Ray clusters")
    os.chmod(path, 0o600)
    return (f"Ray's token file {path} could be read by others (mode {mode}); it is now readable by you "
            f"alone (600): whoever holds it may join your Ray clusters and run code as you")


# Where Ray logs which token authentication a cluster got, as a WARNING at every ray.init: a
# logger name (logging is how a library's messages are routed), not an import of Ray's module.
RAY_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class _ToRunLog(logging.Filter):
    def __init__(self, note: Callable[[str], None]):
        super().__init__()
        self.note = note

    def filter(self, record: logging.LogRecord) -> bool:
        self.note(f"Ray: {record.getMessage()}")
        return False  # not on the terminal


def ray_banner_to(note: Callable[[str], None]) -> None:
    """Send Ray's token-authentication banner (a WARNING opening every run, whichever way it went)
    to ``note`` (the run log) instead of the terminal. Once per process: a later call replaces the
    destination."""
    logger = logging.getLogger(RAY_TOKEN_AUTH_LOGGER)
    for old in [f for f in logger.filters if isinstance(f, _ToRunLog)]:
        logger.removeFilter(old)
    logger.addFilter(_ToRunLog(note))


_LISTEN = "0A"  # the TCP state of a listening socket in /proc/net/tcp


def listening_user(port: int, *, proc_net: Path = Path("/proc/net")) -> str | None:
    """The user whose process listens on TCP ``port`` of this machine (read from the kernel's
    socket table, /proc/net/tcp and tcp6, whose rows carry the owner's uid); None when no local
    socket listens there or the table cannot be read (not Linux)."""
    for table in ("tcp", "tcp6"):
        try:
            rows = (proc_net / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 7 and fields[3] == _LISTEN and int(fields[1].rpartition(":")[2], 16) == port:
                uid = int(fields[7])
                try:
                    return pwd.getpwuid(uid).pw_name
                except KeyError:
                    return f"uid {uid}"
    return None


def whose(gcs_address: str, *, kept_up_here: str | None) -> str:
    """Who a cluster is, for the line a run says when it joins one: the node `node start` keeps up
    here (``kept_up_here``: its GCS address), or a cluster started otherwise, and by which user
    when its GCS listens on this machine."""
    if kept_up_here is not None and gcs_address == kept_up_here:
        return "the Ray node `pan2-render node start` keeps up on this machine"
    target = parse_gcs_address(gcs_address)
    user = listening_user(target[1]) if target is not None and _is_this_machine(target[0]) else None
    me = getpass.getuser()
    if user is None:
        return "a Ray cluster started elsewhere (its owner is not known here)"
    who = "you" if user == me else f"user {user} (not you, {me})"
    return f"a Ray cluster {who} started (with `ray start` or ray.init), not pan2-render's `node start`"


def _is_this_machine(host: str) -> bool:
    """Is ``host`` an address of this machine? Only a local address can be bound to."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, _proto, _name, addr in infos:
        try:
            with socket.socket(family, kind) as probe:
                probe.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def probe_address(address: str) -> None:
    """Fail in seconds, not minutes (ray.init retries a dead GCS address for a long time), when a
    ``host:port`` or ``ray://host:port`` does not accept connections. ``auto`` is left to Ray."""
    import socket

    host, sep, port = address.removeprefix(RAY_CLIENT_SCHEME).rpartition(":")
    if not sep or "://" in host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ClusterConnectError(
            f"could not join the Ray cluster at {address!r}: nothing answers there ({e}); give the "
            f"head's GCS address (`ray status` on the head node prints it), or omit --address to "
            f"start a local cluster"
        ) from None


# Ray's default for RAY_gcs_rpc_server_reconnect_timeout_s: how long a driver keeps trying to
# reach a GCS that stopped answering before Ray ends the process.
RAY_GCS_RECONNECT_DEFAULT_S = 60.0
# Longest a GCS query (cluster resources, the node table) may take before the GCS counts as
# unreachable; a live GCS answers them in well under a second.
GCS_QUERY_TIMEOUT_S = 10.0


def gcs_lost_after_s() -> float:
    """How long the GCS may refuse connections before the run ends, cluster lost: half of Ray's
    own reconnect timeout, which leaves the other half to put the running jobs back to pending and
    say so. (A GCS with fault tolerance restarts within seconds, and is waited for.)"""
    try:
        ray_s = float(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", RAY_GCS_RECONNECT_DEFAULT_S))
    except ValueError:
        ray_s = RAY_GCS_RECONNECT_DEFAULT_S
    return ray_s / 2


def parse_gcs_address(address: str) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT`` or ``[IPv6]:PORT``; None when it is neither."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.removeprefix("[").removesuffix("]"), int(port)


class GcsWatch:
    """Probes, once a second on a daemon thread, that the GCS at ``address`` (host:port) accepts
    a TCP connection. A probe needs nothing from Ray, so it works when every Ray call that needs
    the GCS would block."""

    def __init__(self, address: str, *, period_s: float = 1.0):
        target = parse_gcs_address(address)
        if target is None:
            raise ValueError(f"GCS address {address!r} is not HOST:PORT")
        self.address = address
        self._target = target
        self._period_s = period_s
        self._down_since: float | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="gcs-watch", daemon=True).start()

    def probe(self) -> bool:
        """Probe now; True when the GCS accepted the connection."""
        try:
            socket.create_connection(self._target, timeout=self._period_s).close()
            up = True
        except OSError:
            up = False
        with self._lock:
            if up:
                self._down_since = None
            elif self._down_since is None:
                self._down_since = time.monotonic()
        return up

    def down_for(self) -> float:
        """Seconds since the GCS first refused a connection in the current outage (0: it is up)."""
        with self._lock:
            return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._period_s):
            self.probe()

