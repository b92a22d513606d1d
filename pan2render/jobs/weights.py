"""The identity of a checkpoint's weights: what a job id must cover beyond the path.

A checkpoint replaced or edited in place (a fine-tune or merge copied over the old folder, a few
tensors of a 5 GB shard changed) keeps its path; if job ids covered only the path, or a sample of
each file, a re-run would keep the old weights' videos and report them done. So every byte of every
file is hashed (sha256, in large reads, several files at once: hashlib releases the GIL), and the
folder's digest is the digest of those. File mtimes are not part of the identity (a copied
checkpoint keeps its jobs).

Hashing a 20 GB checkpoint takes as long as reading it, so each file's digest is cached by the
file's identity, (device, inode, size, mtime_ns, ctime_ns), in memory and in ``$PAN2_RENDER_CACHE``:
a re-run of an unchanged folder costs one stat per file. A file rewritten gets a new mtime, a file
replaced a new inode; a file edited in place whose old mtime is then put back (``os.utime``,
``touch -d``, ``rsync -t``) keeps both, but not its ctime, which no call can set (a chmod or a
rename changes it too: the file is hashed once more). A digest taken within :data:`RACY_S` of the
file's last change (mtime or ctime) is not kept: a write in the same timestamp tick as the hash
would leave the identity unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pan2render.cache import cache_root

DIGEST_CHARS = 16  # of the folder digest kept in job specs
CACHE_NAME = "weights-digests.json"
CACHE_ENTRIES = 20_000  # files remembered (a few checkpoints' worth of shards and configs)
RACY_S = 2.0  # filesystem timestamps tick coarsely (jiffies, or 2 s on FAT)
_READ = 8 << 20  # bytes per read: large reads keep sha256 at the disk's speed
_THREADS = 8


@dataclass(frozen=True)
class FileFingerprint:
    size: int
    sha256: str


# "dev:inode:size:mtime_ns:ctime_ns". A cache written before ctime was part of it holds keys of four
# parts, which match no file now: each is a miss, hashed again, and ages out past CACHE_ENTRIES.
_Key = str
_memo: dict[_Key, str] = {}
_loaded: set[Path] = set()  # cache files read into _memo by this process


def _identity(st: os.stat_result) -> _Key:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def sha256_file(path: str | Path) -> str:
    """A file's sha256 (hex), in large reads: the one content hash of a file, for the weights here
    and for the images, LoRAs and artifacts a batch names or writes."""
    h = hashlib.sha256()
    buf = bytearray(_READ)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def folder_fingerprint(folder: Path, *, say: Callable[[str], None] | None = None
                       ) -> tuple[str, dict[str, FileFingerprint]]:
    """(digest, per-file fingerprints) over every regular file under ``folder`` (symlinked files
    followed, as in a Hugging Face cache; hidden files and folders skipped). ``say`` is told, in
    one line, when files have to be hashed (their count and size), before the wait."""
    found = _files(folder)
    _load_cache()
    todo = [(path, st) for path, st in found.values() if _identity(st) not in _memo]
    if todo and say is not None:
        size = sum(st.st_size for _, st in todo)
        say(f"computing the weights digest of {folder}: {len(todo)} file(s), {_human(size)} not hashed "
            f"before (kept in {cache_root()} for the next runs)")
    digests = {**_memo, **_hash_all(todo)} if todo else _memo
    files = {rel: FileFingerprint(st.st_size, digests[_identity(st)]) for rel, (path, st) in found.items()}
    h = hashlib.sha256()
    for rel, fp in sorted(files.items()):
        h.update(f"{rel}\0{fp.size}\0{fp.sha256}\n".encode())
    return h.hexdigest()[:DIGEST_CHARS], files


def _files(folder: Path) -> dict[str, tuple[Path, os.stat_result]]:
    found: dict[str, tuple[Path, os.stat_result]] = {}
    for root, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = Path(root) / name
            if name.startswith(".") or not path.is_file():
                continue
            found[str(path.relative_to(folder))] = (path, path.stat())
    return found


def _hash_all(todo: list[tuple[Path, os.stat_result]]) -> dict[_Key, str]:
    """The files' digests (hashed largest first, in parallel), remembered in the memo and the
    cache file, except those of files changed within RACY_S of the hash's start or while it ran:
    those count for this call only."""
    started = time.time()
    todo = sorted(todo, key=lambda item: -item[1].st_size)
    with ThreadPoolExecutor(max_workers=min(_THREADS, len(todo))) as pool:
        digests = dict(zip((_identity(st) for _, st in todo), pool.map(lambda item: sha256_file(item[0]), todo)))
    fresh = {_identity(st): digests[_identity(st)] for path, st in todo
             if started - max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 > RACY_S
             and _identity(path.stat()) == _identity(st)}
    _memo.update(fresh)
    if fresh:
        _save_cache(fresh)
    return digests


def _cache_path() -> Path:
    return cache_root() / CACHE_NAME


def _load_cache() -> None:
    path = _cache_path()
    if path in _loaded:
        return
    _loaded.add(path)
    _memo.update(_read_cache(path))


def _read_cache(path: Path) -> dict[_Key, str]:
    try:
        data = json.loads(path.read_text())
        entries = data["files"]
        return {str(k): str(v) for k, v in entries.items()} if isinstance(entries, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # absent or damaged: the digests are computed again


def _save_cache(fresh: dict[_Key, str]) -> None:
    """Merge ``fresh`` into the cache file (re-read first: another process may have added some),
    oldest entries dropped past CACHE_ENTRIES; written to a temp name and renamed. A cache that
    cannot be written only costs the next run its hashing."""
    path = _cache_path()
    entries = {**_read_cache(path), **fresh}
    entries = dict(list(entries.items())[-CACHE_ENTRIES:])
    tmp = path.with_name(f".{CACHE_NAME}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": 1, "files": entries}))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _human(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
