"""Files and folders at pan2-render's own names inside an output folder, never through a symlink.

Every name pan2-render writes inside ``DIR`` is fixed or predictable (``.lock``, ``run.log``,
``ledger.sqlite`` and its journal and backup, ``_logs/``, ``_report/``, ``index.html``, the temp
names beside each of them). A symlink planted at one of them would make a write land outside DIR:
opening ``DIR/.lock`` through a link truncated its target. So each is opened here, with
``O_NOFOLLOW`` where a file is opened and an ``lstat`` where a folder is entered or a library opens
the file itself (SQLite), and a link is refused with :class:`UnsafePathError`, naming it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class UnsafePathError(OSError):
    """A name pan2-render writes inside an output folder is a symlink (or a folder it needs is not
    a folder): nothing is written through it."""

    def __init__(self, path: Path, what: str = "a symbolic link"):
        super().__init__(errno.ELOOP, f"{path} is {what}; pan2-render writes only real files and folders at "
                                      f"its own names (a write through it could land outside the folder): "
                                      f"remove it or move it away, then run the command again", str(path))

    def __str__(self) -> str:
        return str(self.strerror)


def refuse_link(path: Path) -> None:
    """Raise UnsafePathError if ``path`` is a symlink (absent is fine): for a file a library opens
    by name, so that no flag of ours can stop it following the link."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise UnsafePathError(path)


def open_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses a symlink at ``path`` itself (UnsafePathError)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(path) from None
        raise


def create_new(path: Path, mode: int = 0o644) -> int:
    """A new, empty file at ``path`` for writing (a temp name): anything already there, a link
    planted at the predictable name or a file left by a dead process of the same pid, is removed
    first (``unlink`` removes a link, never its target), then the file is created exclusively."""
    try:
        return open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except (FileExistsError, UnsafePathError):
        os.unlink(path)
        return open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)


def real_dir(path: Path) -> Path:
    """``path`` as a folder, created if absent; UnsafePathError if it is a symlink or not a folder."""
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise UnsafePathError(path)
    if not stat.S_ISDIR(mode):
        raise UnsafePathError(path, "not a folder")
    return path
