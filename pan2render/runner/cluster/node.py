"""``pan2-render node start|stop``: one Ray node kept up on this machine, stopped alone.

``ray stop`` ends every Ray process of the user on the machine: other people's batches on a render
box with one account, a colleague's cluster, a test's. So ``node start`` records the node it
started (``$PAN2_RENDER_CACHE/ray-node.json``): its GCS address and its Ray session folder, which
every process of the node names on its command line or descends from (the agents and workers are
children of its raylet and rename themselves). ``node stop`` ends those processes and no others:
SIGTERM, then SIGKILL for what is left after a grace period. Processes are read from ``/proc``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pan2render.cache import cache_root
from pan2render.runner.cluster.ray_cluster import (
    RAY_SINGLE_MACHINE_ENV,
    keep_ray_token_private,
    node_start_command,
    running_local_node,
    write_ray_token_if_missing,
)

RECORD_NAME = "ray-node.json"
GRACE_S = 15.0  # Ray's GCS and raylet drain for several seconds after a SIGTERM
_PROC = Path("/proc")


@dataclass(frozen=True)
class NodeRecord:
    gcs_address: str  # host:port
    session_dir: str  # Ray's folder of this node's session (<temp>/ray/session_<time>_<pid>)
    started: str
    gpus: int


class NodeError(RuntimeError):
    """The node could not be started or stopped; the message is one paragraph for the terminal."""


def record_path() -> Path:
    return cache_root() / RECORD_NAME


def read_record() -> NodeRecord | None:
    try:
        return NodeRecord(**json.loads(record_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except (OSError, ValueError):
        return False


def running() -> NodeRecord | None:
    """The node ``node start`` started here, if it still runs (its GCS answers and its processes
    are there); a record of one that is gone is dropped."""
    record = read_record()
    if record is None:
        return None
    if _answers(record.gcs_address) and node_processes(record.session_dir):
        return record
    record_path().unlink(missing_ok=True)
    return None


# ---------------------------------------------------------------------------------------- start
def start(*, gpus: int, port: int, env: dict[str, str], say: Callable[[str], None] | None = None) -> NodeRecord:
    """Start the node (`ray start --head`, ray_cluster.node_start_command) and record it. NodeError
    when one of ours or another Ray node already runs here, or Ray fails to start. ``say``: where a
    line goes when Ray's token file had to be made readable by its owner alone.

    Unlike a run's local cluster, this node is one other machines may join (`ray start --address`
    on them, with its token): it listens on this machine's address, as `ray start` does."""
    if (ours := running()) is not None:
        raise NodeAlreadyUp(ours)
    other, _ = running_local_node()
    if other is not None:
        raise NodeError(f"a Ray node is already running on this machine (GCS at {other}), one that "
                        f"`pan2-render node start` did not start: runs here join it already. To have one of "
                        f"pan2-render's own instead, stop that one first (with `ray stop` if it is yours)")
    write_ray_token_if_missing()  # which `ray start --head` would write with the umask's mode
    notes = [keep_ray_token_private()]
    env = {k: v for k, v in env.items() if k != RAY_SINGLE_MACHINE_ENV}  # a run's switch, not the node's
    done = subprocess.run(node_start_command(gpus=gpus, port=port), env=env, capture_output=True, text=True,
                          check=False)
    notes.append(keep_ray_token_private())
    for line in filter(None, notes):
        if say is not None:
            say(line)
    if done.returncode != 0:
        raise NodeError(f"`ray start` failed (exit {done.returncode}): {_last_error(done.stdout + done.stderr)} "
                        f"(a port in use: --port)")
    session = _session_of(port)
    if session is None:
        raise NodeError(f"`ray start` reported success but no GCS server of port {port} runs; its output ends: "
                        f"{_last_error(done.stdout + done.stderr)}")
    record = NodeRecord(gcs_address=_recorded_address(session) or f"127.0.0.1:{port}", session_dir=session,
                        gpus=gpus, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RECORD_NAME}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, path)
    return record


class NodeAlreadyUp(NodeError):
    def __init__(self, record: NodeRecord):
        self.record = record
        super().__init__(f"the Ray node `pan2-render node start` started is already up here (GCS at "
                         f"{record.gcs_address}, {record.gpus} GPU(s), since {record.started}); "
                         f"`pan2-render node stop` ends it, to start it again with other settings")


def _address_file(session_dir: str) -> Path:
    """Where `ray start` records the node's address for ray.init() to join: beside its sessions."""
    return Path(session_dir).parent / "ray_current_cluster"


def _recorded_address(session_dir: str) -> str | None:
    try:
        return _address_file(session_dir).read_text().strip() or None
    except OSError:
        return None


def _last_error(output: str) -> str:
    """The line of Ray's output that says what went wrong (its last error line, else its last)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["(no output)"])[-1][:400]


def _session_of(port: int) -> str | None:
    """The session folder of the GCS server serving ``port``, from its command line
    (``--gcs_server_port=PORT ... --log_dir=<session>/logs``)."""
    flag = f"--gcs_server_port={port}".encode()
    for _pid, (_parent, argv) in _processes().items():
        if flag in argv:
            for arg in argv:
                if arg.startswith(b"--log_dir="):
                    return str(Path(arg.removeprefix(b"--log_dir=").decode()).parent)
    return None


# ---------------------------------------------------------------------------------------- stop
def stop() -> tuple[NodeRecord, int] | None:
    """End the recorded node's processes: (its record, how many processes ended), None when no node
    is recorded."""
    record = read_record()
    if record is None:
        return None
    doomed = node_processes(record.session_dir)
    end_processes(doomed)
    left = node_processes(record.session_dir)
    if left:
        raise NodeError(f"{len(left)} process(es) of the node (session {record.session_dir}) did not end "
                        f"after SIGKILL: pids {', '.join(map(str, sorted(left)))}")
    # What `ray stop` also does: the address Ray records for ray.init() to join no longer answers.
    if _recorded_address(record.session_dir) == record.gcs_address:
        _address_file(record.session_dir).unlink(missing_ok=True)
    record_path().unlink(missing_ok=True)
    return record, len(doomed)


def node_processes(session_dir: str) -> set[int]:
    """The processes of the node whose Ray session folder is ``session_dir``: those naming it on
    their command line, and every descendant of those."""
    procs = _processes()
    mark = session_dir.encode()
    return _with_descendants({pid for pid, (_parent, argv) in procs.items() if any(mark in arg for arg in argv)},
                             procs)


def process_tree(roots: set[int]) -> set[int]:
    """``roots`` and every descendant of them (NodeError where there is no /proc)."""
    return _with_descendants(set(roots), _processes())


def started_by(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (NodeError where there is no /proc)."""
    return {child for child, (parent, _) in _processes().items() if parent == pid}


def _with_descendants(found: set[int], procs: dict[int, tuple[int, list[bytes]]]) -> set[int]:
    while grown := {pid for pid, (parent, _) in procs.items() if parent in found} - found:
        found |= grown
    return found


def _processes() -> dict[int, tuple[int, list[bytes]]]:
    """pid -> (parent pid, argv), from /proc (NodeError where there is none)."""
    if not _PROC.is_dir():
        raise NodeError("this machine has no /proc, where the node's processes are found; stop it with `ray stop` "
                        "(which ends every Ray process of this user here)")
    out: dict[int, tuple[int, list[bytes]]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile, or not ours to read
            continue
        out[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), argv)
    return out


def end_processes(pids: set[int], *, grace_s: float = GRACE_S) -> None:
    """SIGTERM to those still running, up to ``grace_s`` for them to end, then SIGKILL for the rest."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = {pid for pid in pids if _alive(pid)}
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            pids = {pid for pid in pids if _alive(pid)}
            if not pids:
                return
            time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it has ended)."""
    try:
        state = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
