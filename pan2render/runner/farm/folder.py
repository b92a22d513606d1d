"""The farm's folder (its root): what lies in it, and the checks that make it the farm owner's alone.

    ROOT/farm.sqlite   the durable queue (farm/queue.py)
    ROOT/token         the farm's admin token, readable by its owner only
    ROOT/users.json    the users' tokens, hashed (farm/users.py)
    ROOT/farm.json     the running farm's address and pid, written once it listens
    ROOT/farm.log      the farm's log
    ROOT/videos/       the folders of videos created through /v1/videos, one per user

Whoever can write the root can plant a token the farm would adopt, or a farm.json that sends the
real token to another listener: `farm start` refuses a root that is not owned by its user or that
group or others may write, and clients read farm.json and the token only from a root that passes
the same check. Files are opened without following a link, and only if they are regular files.
Standard library only: the client (``pan2render.client``) reads it too.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

QUEUE_NAME = "farm.sqlite"
TOKEN_NAME = "token"
USERS_NAME = "users.json"
INFO_NAME = "farm.json"
LOG_NAME = "farm.log"
VIDEOS_DIR = "videos"
MAX_SMALL_FILE = 1 << 20  # farm.json, the token, users.json: far smaller


class UnsafeRoot(RuntimeError):
    """The farm's folder (or a file in it) is not the farm owner's alone; the message says how to fix it."""


def check_root(root: Path) -> None:
    """Raise UnsafeRoot unless ``root`` is a folder (not a link) owned by this user that neither
    group nor others may write."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise UnsafeRoot(f"{root} does not exist") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeRoot(f"{root} is {'a link' if stat.S_ISLNK(st.st_mode) else 'not a folder'}: a farm's root "
                         f"must be a folder of its own (name another with --root)")
    if st.st_uid != os.getuid():
        raise UnsafeRoot(f"{root} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): whoever owns it could "
                         f"read the farm's token; use a folder of your own (--root)")
    if st.st_mode & 0o022:
        raise UnsafeRoot(f"{root} may be written by {'group and others' if st.st_mode & 0o002 else 'its group'} "
                         f"(mode {stat.S_IMODE(st.st_mode):o}): anyone who can write it could plant a token or a "
                         f"farm.json; `chmod go-w {root}` (or 700) makes it yours alone")


def make_root(root: Path) -> None:
    """Create the farm's folder (owner only) if it does not exist, then check it."""
    if not os.path.lexists(root):
        root.mkdir(parents=True, mode=0o700)
    check_root(root)


def read_small_file(path: Path) -> bytes:
    """A regular file of the farm's folder, owned by this user and not readable by others when it
    is the token or the users' file; never through a link, never a FIFO (opened non-blocking)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeRoot(f"{path} is not a regular file")
        if st.st_uid != os.getuid():
            raise UnsafeRoot(f"{path} belongs to uid {st.st_uid}, not to you: remove it; the farm writes its own")
        if path.name in (TOKEN_NAME, USERS_NAME) and st.st_mode & 0o077:
            raise UnsafeRoot(f"{path} may be read by others (mode {stat.S_IMODE(st.st_mode):o}): "
                             f"`chmod 600 {path}`, or remove it and start the farm again for a new one")
        data = os.read(fd, MAX_SMALL_FILE + 1)
        if len(data) > MAX_SMALL_FILE:
            raise UnsafeRoot(f"{path} is larger than {MAX_SMALL_FILE} bytes: not the farm's")
        return data
    finally:
        os.close(fd)


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` atomically (temp name, fsync, rename), readable by its owner only."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def ensure_token(root: Path) -> str:
    """The farm's admin token (``ROOT/token``): created exclusively when missing; an existing one
    is used only if it is this user's, a regular file, readable by no one else."""
    path = root / TOKEN_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        token = read_small_file(path).decode(errors="replace").strip()
        if not token:
            raise UnsafeRoot(f"{path} is empty: remove it and start the farm again for a new token") from None
        return token
    token = secrets.token_hex(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def read_token(root: Path) -> str | None:
    """The admin token, from a root that passes :func:`check_root` (None: none readable)."""
    try:
        check_root(root)
        return read_small_file(root / TOKEN_NAME).decode(errors="replace").strip() or None
    except (OSError, UnsafeRoot):
        return None


def read_info(root: Path) -> dict[str, Any] | None:
    """The running farm's farm.json, from a root that passes :func:`check_root` (None: none)."""
    try:
        check_root(root)
        info = json.loads(read_small_file(root / INFO_NAME))
    except (OSError, ValueError, UnsafeRoot):
        return None
    return info if isinstance(info, dict) else None


def url_host(host: str) -> str:
    """``host`` as it goes in a URL: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
