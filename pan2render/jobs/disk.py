"""Free space, and the one error every "the disk is full" becomes.

A render folder fills up overnight: the check before each artifact write turns "the write would not
fit" into :class:`DiskFullError` before a byte is written, and :func:`is_disk_full` recognises the
same condition when it comes from the kernel (``ENOSPC``, ``EDQUOT``) or from SQLite ("database or
disk is full"), so the driver and the CLI handle one kind of failure.
"""

from __future__ import annotations

import errno
import shutil
import sqlite3
from pathlib import Path

# Room kept free beyond an artifact's own size: the ledger's rollback journal and the folder's
# metadata need a little space to record what was written.
HEADROOM_BYTES = 16 << 20


class DiskFullError(OSError):
    """Not enough free space under a folder for what is about to be written."""

    def __init__(self, folder: Path, *, needed: int, free: int, what: str):
        self.folder = folder
        self.needed = needed
        self.free = free
        super().__init__(errno.ENOSPC, f"not enough space in {folder} for {what}: {_mib(needed)} needed "
                                       f"(with {_mib(HEADROOM_BYTES)} headroom), {_mib(free)} free")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def ensure_free(folder: Path, size: int, *, what: str) -> None:
    """Raise DiskFullError unless ``size`` bytes plus the headroom fit under ``folder``."""
    free = free_bytes(folder)
    if free < size + HEADROOM_BYTES:
        raise DiskFullError(folder, needed=size + HEADROOM_BYTES, free=free, what=what)


def is_disk_full(exc: BaseException) -> bool:
    """Does this error (or one it was raised from) mean the filesystem is out of space or quota?"""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, sqlite3.Error) and sqlite_error_name(e) == "SQLITE_FULL":
            return True
        e = e.__cause__ or e.__context__
    return False


def sqlite_error_name(e: sqlite3.Error) -> str | None:
    """The primary SQLite result code's name of ``e`` (``SQLITE_FULL``, ``SQLITE_BUSY``, ...), from
    the extended one SQLite reported (``SQLITE_IOERR_SHORT_READ`` -> ``SQLITE_IOERR``); None for an
    error the sqlite3 module raised itself (a misuse, not SQLite)."""
    name = getattr(e, "sqlite_errorname", None)
    if not name:
        return None
    return "_".join(name.split("_")[:2])
