"""The worker's scratch space (encodes, a group's rendezvous file), which a killed worker cannot
leave behind for good.

An encode writes its mp4 to a temp file, decodes it back to check it, and hands the bytes to the
driver. A worker killed meanwhile (out of memory, a node drained, SIGKILL) runs no clean-up, so
its folder and its partial mp4 would stay in the temp folder. Every encode folder therefore lives
under one folder per worker process, ``$TMPDIR/pan2-render-<uid>/<pid>-<start time>/``, and each
worker, when it starts, removes those of processes that no longer run (:func:`sweep_dead`).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _root() -> Path | None:
    """This user's folder of worker folders, or None when the name is taken by something that is not
    a folder of ours (another user's, or a link): encodes then use the plain temp folder."""
    root = Path(tempfile.gettempdir()) / f"pan2-render-{os.getuid()}"
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return None
    return root


def _start_time(pid: int) -> str | None:
    """When the process started (clock ticks since boot, /proc/PID/stat field 22): with the pid,
    names one process even after the pid is reused. None when it does not run (or no /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _own_name() -> str:
    return f"{os.getpid()}-{_start_time(os.getpid()) or 'x'}"


@contextmanager
def encode_folder() -> Iterator[Path]:
    """A fresh folder of its own for one encode (two run at once on a worker), removed after."""
    root = _root()
    parent = None
    if root is not None:
        parent = root / _own_name()
        parent.mkdir(mode=0o700, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="encode-", dir=parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def group_store() -> Path:
    """A fresh file name for a process group's rendezvous (torch.distributed's FileStore), in a
    folder of this worker process's that only its user may enter: the group's ranks are on one node
    and run as one user, so they meet there, with no port opened for anyone else to reach."""
    root = _root()
    parent = None
    if root is not None:
        parent = root / _own_name()
        parent.mkdir(mode=0o700, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="group-", dir=parent)) / "store"


def sweep_dead() -> list[Path]:
    """Remove the worker folders of processes that no longer run; returns what was removed."""
    root = _root()
    if root is None or not Path("/proc").is_dir():  # without /proc a live worker cannot be told apart
        return []
    removed = []
    for entry in root.iterdir():
        pid, _, started = entry.name.partition("-")
        if not pid.isdigit() or _start_time(int(pid)) == started:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed
