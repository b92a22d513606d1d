"""The identity of a checkpoint's weights, cheaply: what a job id must cover beyond the path.

A checkpoint replaced in place (a new fine-tune copied over the old folder) keeps its path; if job
ids covered only the path, a re-run would keep the old weights' videos and report them done. Every
file of the folder is fingerprinted by its size and a sampled sha256 (the first and last MiB and
evenly spaced blocks between: a few MB read per file, whatever its size), and the folder by the
digest of those. File mtimes are not part of the identity (a copied checkpoint keeps its jobs);
they only key an in-process cache, so re-verifying an unchanged folder costs one stat per file.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

_EDGE = 1 << 20  # bytes hashed at each end of a file (safetensors headers sit at the start)
_BLOCK = 64 << 10
_BLOCKS = 32  # evenly spaced blocks between the edges
DIGEST_CHARS = 16  # of the folder digest kept in job specs


@dataclass(frozen=True)
class FileFingerprint:
    size: int
    sampled_sha256: str


_cache: dict[tuple[str, int, int], FileFingerprint] = {}


def file_fingerprint(path: Path) -> FileFingerprint:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _cache:
        _cache[key] = FileFingerprint(st.st_size, _sampled_sha256(path, st.st_size))
    return _cache[key]


def _sampled_sha256(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 2 * _EDGE + _BLOCKS * _BLOCK:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return h.hexdigest()
        offsets = [0] + [_EDGE + i * (size - 2 * _EDGE) // _BLOCKS for i in range(_BLOCKS)] + [size - _EDGE]
        for off in offsets:
            f.seek(off)
            h.update(f.read(_EDGE if off in (0, size - _EDGE) else _BLOCK))
    return h.hexdigest()


def folder_fingerprint(folder: Path) -> tuple[str, dict[str, FileFingerprint]]:
    """(digest, per-file fingerprints) over every regular file under ``folder`` (symlinked files
    followed, as in a Hugging Face cache; hidden files and folders skipped)."""
    files: dict[str, FileFingerprint] = {}
    for root, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = Path(root) / name
            if name.startswith(".") or not path.is_file():
                continue
            files[str(path.relative_to(folder))] = file_fingerprint(path)
    h = hashlib.sha256()
    for rel, fp in sorted(files.items()):
        h.update(f"{rel}\0{fp.size}\0{fp.sampled_sha256}\n".encode())
    return h.hexdigest()[:DIGEST_CHARS], files
