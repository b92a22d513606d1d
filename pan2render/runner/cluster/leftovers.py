"""What a killed run or farm leaves of its local Ray cluster, and its end at the next start.

A driver killed with SIGKILL (or by the OOM killer) runs none of its clean-up. Its GCS, raylet and
workers notice and end within seconds, but the raylet's dashboard and runtime-env agents live on
for minutes, deaf to SIGTERM, the runtime-env agent listening on a port. So a driver that starts a
local cluster records, once ``ray.init`` has returned (the raylet registers only once both agents
are up), the processes it started: each one's pid with its start time (``/proc/<pid>/stat``,
clock ticks after boot: with the pid, one process for the life of the boot), the boot's id and the
Ray session folder. The next start (``end_leftovers``) reads the records whose driver is gone and
ends what still runs of them, SIGTERM then SIGKILL: only a process whose pid AND start time match,
owned by this user, and the processes those started since. Never by name, never another user's,
never a cluster whose driver still runs.

Where the record lives: the farm's in its folder (``ROOT/ray-cluster.json``: one farm per folder,
so the next farm there is the one to clean up), a run's in a folder of the pan2-render cache
(``ray-clusters-<uid>/``, one file per driver), which every later run or farm of the user looks
through. A record is read only from a folder of this user's that others may not write, and only if
it is a regular file of this user's: whoever could plant one could have us end our own processes.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pan2render.cache import cache_root
from pan2render.runner.cluster.node import NodeError, end_processes, process_tree
from pan2render.runner.protocol.artifacts import write_atomic

RECORD_NAME = "ray-cluster.json"  # in the farm's folder
RUN_RECORDS = "ray-clusters-{uid}"  # in the pan2-render cache: a run's, one file per driver
LEFTOVERS_GRACE_S = 3.0  # SIGTERM to SIGKILL: the agents ignore SIGTERM, the rest end at once
MAX_RECORD_BYTES = 1 << 20  # a record lists tens of processes: far smaller
_PROC = Path("/proc")


@dataclass(frozen=True, order=True)
class ProcessId:
    """One process for the life of a boot: a pid is reused, a pid with its start time is not."""

    pid: int
    started: int  # clock ticks after boot (/proc/<pid>/stat, field 22)


@dataclass(frozen=True)
class ClusterRecord:
    boot_id: str  # /proc/sys/kernel/random/boot_id: start times count from this boot
    uid: int  # the user who started it: nobody else's processes are ended
    driver: ProcessId  # the run or farm that started the cluster: while it runs, the cluster is its
    session_dir: str  # Ray's folder of the cluster's session, to say which cluster it was
    processes: tuple[ProcessId, ...]  # what ray.init started (GCS, raylet, agents, ...), at the time


# ------------------------------------------------------------------------------------ processes
def identify(pid: int) -> ProcessId | None:
    """``pid``'s identity now; None when no such process runs (a zombie has ended)."""
    try:
        fields = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):  # field 3, the state
        return None
    return ProcessId(pid=pid, started=int(fields[19]))


def _owner(pid: int) -> int | None:
    try:
        return os.stat(_PROC / str(pid)).st_uid
    except OSError:
        return None


def boot_id() -> str:
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: no process is ever recognised
        return ""


def running(process: ProcessId) -> bool:
    """Is this very process (pid and start time) still running?"""
    return identify(process.pid) == process


# -------------------------------------------------------------------------------------- records
def run_records() -> Path:
    """The folder of the runs' records, this user's alone."""
    return cache_root() / RUN_RECORDS.format(uid=os.getuid())


def run_record_path() -> Path:
    """This driver's record among the runs' (named by its pid and start time: never a dead one's)."""
    me = identify(os.getpid())
    return run_records() / f"{os.getpid()}-{me.started if me else 0}.json"


def record_cluster(path: Path, *, session_dir: str, pids: Iterable[int]) -> ClusterRecord | None:
    """Record the cluster this process started (``pids``: its processes now) at ``path``; None where
    there is no /proc to identify them (nothing to recognise them by later)."""
    driver = identify(os.getpid())
    processes = tuple(sorted(p for p in map(identify, pids) if p is not None and p.pid != os.getpid()))
    if driver is None or not boot_id():
        return None
    record = ClusterRecord(boot_id=boot_id(), uid=os.getuid(), driver=driver, session_dir=session_dir,
                           processes=processes)
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    body = {"boot_id": record.boot_id, "uid": record.uid, "driver": [driver.pid, driver.started],
            "session_dir": session_dir, "processes": [[p.pid, p.started] for p in processes],
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_atomic(path, (json.dumps(body, indent=1) + "\n").encode())
    return record


class UnsafeRecord(RuntimeError):
    """A record that is not certainly this user's own: it is not acted on."""


def _check_folder(folder: Path) -> None:
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise UnsafeRecord(f"{folder} is not a folder of this user's alone (a link, another user's, or writable by "
                           f"others: mode {stat.S_IMODE(st.st_mode):o})")


def read_record(path: Path) -> ClusterRecord:
    """The record at ``path``: FileNotFoundError when there is none, UnsafeRecord when it or its
    folder is not this user's alone, ValueError when it does not parse."""
    _check_folder(path.parent)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise UnsafeRecord(f"{path} is not a regular file of this user's")
        data = os.read(fd, MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)
    try:
        body = json.loads(data)
        return ClusterRecord(boot_id=str(body["boot_id"]), uid=int(body["uid"]),
                             driver=ProcessId(*map(int, body["driver"])), session_dir=str(body["session_dir"]),
                             processes=tuple(ProcessId(*map(int, p)) for p in body["processes"]))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a cluster record ({type(e).__name__}: {e})") from None


def forget(path: Path | None) -> None:
    """Drop a record once its cluster has ended."""
    if path is not None:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ leftovers
def _this_users_this_boot(record: ClusterRecord) -> bool:
    return record.uid == os.getuid() and record.boot_id == boot_id()


def leftovers(record: ClusterRecord) -> set[int]:
    """What still runs of a recorded cluster whose driver is gone: its recorded processes that are
    the same processes (pid and start time, this boot) and this user's, and every process they
    started since. Empty while its driver runs, after a reboot, or for another user's record."""
    if not _this_users_this_boot(record) or running(record.driver):
        return set()
    # A process ray.init started is younger than its driver: a recorded one that is not is no child of it.
    alive = {p.pid for p in record.processes if p.started >= record.driver.started and running(p)}
    try:
        tree = process_tree(alive)
    except NodeError:
        return set()
    return {pid for pid in tree if _owner(pid) == os.getuid()}


def end_leftovers(paths: Iterable[Path], *, grace_s: float = LEFTOVERS_GRACE_S) -> list[str]:
    """End what killed drivers left of the clusters recorded at ``paths`` (records of drivers still
    running are kept), and drop their records: one line per cluster ended or record refused."""
    notes = []
    for path in paths:
        try:
            record = read_record(path)
        except FileNotFoundError:
            continue
        except (OSError, UnsafeRecord, ValueError) as e:
            notes.append(f"the record of a local Ray cluster at {path} was not acted on: {e}")
            continue
        if _this_users_this_boot(record) and running(record.driver):
            continue  # its driver still runs: the cluster is its own
        doomed = leftovers(record)
        left: set[int] = set()
        if doomed:
            end_processes(doomed, grace_s=grace_s)
            left = {pid for pid in doomed if identify(pid) is not None}
            notes.append(f"ended {len(doomed) - len(left)} process(es) left running by the local Ray cluster of a "
                         f"killed run or farm (pid {record.driver.pid}, Ray session {record.session_dir})"
                         + (f"; still running after SIGKILL: pids {', '.join(map(str, sorted(left)))} (the record "
                            f"stays for the next start)" if left else ""))
        if not left:
            forget(path)
    return notes


def records_to_check(explicit: Path | None) -> list[Path]:
    """``explicit`` (the farm's record) and every run's record of this user."""
    folder = run_records()
    try:
        found = sorted(folder.glob("*.json"))
    except OSError:
        found = []
    return ([explicit] if explicit is not None else []) + [p for p in found if p != explicit]
