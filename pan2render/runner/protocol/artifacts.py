"""Stage artifacts: where they live, how they are serialised, written and checked.

Artifacts travel between the worker and the driver as ``bytes`` (embeddings ~4 MB at text dim 4096,
latents ~10 MB, an mp4 a few MB) and only the DRIVER writes them, so workers on other nodes need no
shared filesystem. Layout under the output folder ``DIR``::

    DIR/_cache/embeddings/<sha256(text_encoder_id, prompt)>.safetensors   conditioning
    DIR/<job-id>/latents.safetensors                                       sampling
    DIR/<job-id>/video.mp4                                                 decode + encode
    DIR/<job-id>/preview.webp        the newest live preview of its sampling, until the job is done
    DIR/<job-id>/segments/<k>/       a chained job's segment k (from 1): latents.safetensors, last.png
                                     (its last frame, colour-matched), segment.json (serve/segments.py)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from pan2render.durable import fsync_dir
from pan2render.jobs import outdir
from pan2render.jobs.disk import ensure_free
from pan2render.jobs.ledger import StageRecord
from pan2render.jobs.spec import JobSpec
from pan2render.jobs.weights import sha256_file
from pan2render.preview_file import PREVIEW_NAME
from pan2render.runner.protocol.failures import JobInputError
from pan2render.sampling import WAN22

EMBED_CACHE = Path("_cache") / "embeddings"
LATENTS_NAME = "latents.safetensors"
VIDEO_NAME = "video.mp4"
# The ledger document recording a job's newest step checkpoint (its file, digest, size, step).
STEP_CHECKPOINT_DOC = "step-checkpoint"
# The ledger document with a running sampling's latest step, as the scheduler last recorded it
# ({"step", "steps", "rate", "at"}), so that `status` (another process) can show it.
SAMPLING_STEP_DOC = "sampling-step"
# The ledger document of a running job a client cancelled (the reason), written before the cancel
# is answered: a driver killed before the job stops cancels it when it starts again.
CANCEL_DOC = "cancel-requested"
STEP_CHECKPOINT_NAME = "sampling.ckpt.safetensors"  # a sampling's newest step checkpoint, until it ends
SEGMENTS_FOLDER = "segments"
LAST_FRAME_NAME = "last.png"
SEGMENT_RECORD_NAME = "segment.json"
# The ledger document listing a chained job's segments done (their records, for `status`).
SEGMENTS_DOC = "segments"
# A segment's latents say which segment they are (index, seed, the conditioning frame's sha256),
# so that latents sampled just before a crash, before their segment was recorded, are used again.
SEGMENT_KEY = "segment"

class NonFiniteError(JobInputError, FloatingPointError):
    """Latents or frames contain NaN/Inf. Deterministic for a given spec, so never retried."""


class UnsafePathError(JobInputError):
    """A folder on an artifact's path inside DIR is a symlink or not a folder (``outdir.real_dir``
    refused it): writing through it could put files outside DIR. Deterministic for the job's
    folder, so never retried."""


# ------------------------------------------------------------------ paths
def embedding_key(*, prompt: str, text_encoder_id: str) -> str:
    return hashlib.sha256(f"{text_encoder_id}\x00{prompt}".encode()).hexdigest()


def embedding_relpath(key: str) -> str:
    return str(EMBED_CACHE / f"{key}.safetensors")


def latents_relpath(job_id: str) -> str:
    return f"{job_id}/{LATENTS_NAME}"


def video_relpath(job_id: str) -> str:
    return f"{job_id}/{VIDEO_NAME}"


def segment_relpath(job_id: str, k: int, name: str) -> str:
    return f"{job_id}/{SEGMENTS_FOLDER}/{k}/{name}"


def step_checkpoint_relpath(job_id: str) -> str:
    return f"{job_id}/{STEP_CHECKPOINT_NAME}"


def preview_relpath(job_id: str) -> str:
    return f"{job_id}/{PREVIEW_NAME}"


# ------------------------------------------------------------------ what the files hold
def array_digest(a: np.ndarray) -> str:
    """sha256 of an array's bytes in C order (a float32 tensor's bytes, as torch lays them out)."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


FAST_LANES_KEY = "fast_lanes"


def latents_fast_lanes(out_dir: Path, relpath: str) -> dict[str, Any] | None:
    """The sampling plan a latents file records (`pack_latents`), None when it records none."""
    return _latents_json(out_dir, relpath, FAST_LANES_KEY)


def latents_segment(out_dir: Path, relpath: str) -> dict[str, Any] | None:
    """Which segment of a chained job a latents file holds (`pack_latents`), None for a job of one clip."""
    return _latents_json(out_dir, relpath, SEGMENT_KEY)


def _latents_json(out_dir: Path, relpath: str, key: str) -> dict[str, Any] | None:
    try:
        with safe_open(str(out_dir / relpath), framework="numpy") as f:
            text = (f.metadata() or {}).get(key)
    except (SafetensorError, OSError, ValueError, RuntimeError):
        return None
    return None if text is None else json.loads(text)


def estimated_bytes(spec: JobSpec) -> int:
    """What a job will write, roughly: float32 latents [48, T, h/16, w/16] plus an mp4 budgeted at
    a generous 2 bits a pixel (crf 18 on detailed content stays well under it)."""
    latent_frames = (spec.frames - 1) // 4 + 1
    latents = 48 * latent_frames * (spec.height // 16) * (spec.width // 16) * 4
    return latents + spec.frames * spec.height * spec.width // 4


# ------------------------------------------------------------------ durable writes
def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_artifact(out_dir: Path, relpath: str, data: bytes) -> None:
    """Write one artifact under DIR: free space checked first (DiskFullError, nothing written),
    folders created without following symlinks (UnsafePathError), then :func:`write_atomic`."""
    path = safe_path(out_dir, relpath)
    ensure_free(path.parent, len(data), what=relpath)
    write_atomic(path, data)


def write_preview(out_dir: Path, relpath: str, data: bytes) -> None:
    """Replace a live preview: temp name, rename, no fsync and no free-space check. A preview is
    replaced every few seconds and worth nothing after a crash (the next sampling makes another);
    the rename still means a reader sees the old picture or the new one, never half of one."""
    path = safe_path(out_dir, relpath)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with os.fdopen(outdir.create_new(tmp), "wb") as f:  # a predictable name: never through a link
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def safe_path(out_dir: Path, relpath: str) -> Path:
    """``DIR/relpath`` with each folder between created if absent and refused if it is a symlink
    or not a folder, so a link planted at ``DIR/<job-id>`` cannot send files outside DIR."""
    folder = Path(out_dir)
    parts = Path(relpath).parts
    assert parts and not Path(relpath).is_absolute() and ".." not in parts, relpath
    for name in parts[:-1]:
        try:
            folder = outdir.real_dir(folder / name)
        except outdir.UnsafePathError as e:  # the job's own folder: the job fails, the batch goes on
            raise UnsafePathError(str(e)) from None
    return folder / parts[-1]


def write_atomic(path: Path, data: bytes) -> None:
    """Temp name in the same folder + fsync + rename + fsync of the folder: after a crash the path
    holds either nothing/the old file or the complete new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with os.fdopen(outdir.create_new(tmp), "wb") as f:  # a predictable name: never through a link
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. disk full: leave no temp file behind
        raise
    fsync_dir(path.parent)


# ------------------------------------------------------------------ checks (None = valid)
class Proven:
    """Artifacts this process has read and checked, each with what was proven of it (the check and
    its inputs) and what its stat said then. A later check of the same claim on a file whose stat
    is unchanged (inode, size, mtime, ctime: a write, a rename over it or a truncation changes one)
    takes the proof instead of reading the file again. The scheduler's loop checked a job's
    embeddings at each of its calls: at full size, MBs read and hashed on the loop for every job,
    where one check per file written proves as much. A change within the filesystem's timestamp
    tick that keeps the size and the inode is not seen (as for every stat-keyed cache)."""

    def __init__(self) -> None:
        self._proofs: dict[str, tuple[str, tuple[int, ...]]] = {}

    def holds(self, path: Path, claim: str) -> bool:
        found = self._proofs.get(str(path))
        if found is None or found[0] != claim:
            return False
        try:
            return _signature(os.stat(path)) == found[1]
        except OSError:
            return False

    def note(self, path: Path, claim: str) -> None:
        try:
            self._proofs[str(path)] = (claim, _signature(os.stat(path)))
        except OSError:
            self._proofs.pop(str(path), None)

    def forget(self, path: Path) -> None:
        self._proofs.pop(str(path), None)

    def __len__(self) -> int:
        return len(self._proofs)


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _proven_check(proven: Proven | None, path: Path, claim: str, check: Any) -> str | None:
    """``check()`` unless ``proven`` holds ``claim`` for the file; a passed check is noted."""
    if proven is not None and proven.holds(path, claim):
        return None
    problem = check()
    if problem is None and proven is not None:
        proven.note(path, claim)
    return problem


@dataclass(frozen=True)
class Recorded:
    """What the ledger recorded for an artifact."""

    relpath: str | None
    sha256: str | None
    size: int | None


def recorded(rec: StageRecord) -> Recorded:
    """The artifact a stage row records."""
    return Recorded(rec.artifact, rec.sha256, rec.size)


def check_present(out_dir: Path, rec: Recorded) -> str | None:
    """The cheap part of :func:`check_recorded`: the file is there with the recorded size."""
    if rec.relpath is None:
        return "no artifact recorded"
    path = out_dir / rec.relpath
    if not path.is_file():
        return f"{rec.relpath} is missing"
    size = path.stat().st_size
    if rec.size is not None and size != rec.size:
        return f"{rec.relpath} is {size} bytes, the ledger recorded {rec.size} (truncated or replaced)"
    return None


def check_recorded(out_dir: Path, rec: Recorded) -> str | None:
    problem = check_present(out_dir, rec)
    if problem:
        return problem
    path = out_dir / str(rec.relpath)
    if rec.sha256 is not None and sha256_file(path) != rec.sha256:
        return f"{rec.relpath} sha256 differs from the ledger's (corrupt or replaced)"
    return None


def check_embedding(out_dir: Path, relpath: str, *, key: str, proven: Proven | None = None) -> str | None:
    path = out_dir / relpath
    return _proven_check(proven, path, f"embedding {key}", lambda: _check_embedding(path, relpath, key))


def _check_embedding(path: Path, relpath: str, key: str) -> str | None:
    if not path.is_file():
        return f"{relpath} is missing"
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            emb = f.get_tensor("prompt_embeds")
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        return f"{relpath} is unreadable ({e})"
    if meta.get("key") != key:
        return f"{relpath} belongs to another prompt/encoder (key {meta.get('key')!r})"
    if meta.get("sha256") != array_digest(emb):
        return f"{relpath} does not match its recorded sha256 (corrupt, or written without one)"
    if not np.isfinite(emb).all():
        return f"{relpath} holds non-finite embeddings"
    return None


def check_latents(out_dir: Path, rec: Recorded, *, spec: JobSpec, require_digest: bool = False,
                  proven: Proven | None = None) -> str | None:
    """None if the latents are the job's, whole and usable: readable, rendered for its spec hash,
    their data matching the digest in their metadata (``require_digest``: a file without one,
    written before they carried it, does not count; where the ledger recorded the file's sha256,
    that proves the bytes instead), of the grid the job's size gives, finite."""
    if rec.relpath is None:
        return check_present(out_dir, rec)
    claim = f"latents {rec.sha256} {rec.size} {spec.spec_hash} {require_digest}"
    return _proven_check(proven, out_dir / rec.relpath, claim,
                         lambda: _check_latents(out_dir, rec, spec=spec, require_digest=require_digest))


def _check_latents(out_dir: Path, rec: Recorded, *, spec: JobSpec, require_digest: bool) -> str | None:
    problem = check_recorded(out_dir, rec)
    if problem:
        return problem
    path = out_dir / str(rec.relpath)
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            lat = f.get_tensor("latents")
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as e:
        return f"{rec.relpath} is unreadable ({e})"
    if meta.get("spec_hash") != spec.spec_hash:
        return f"{rec.relpath} was rendered for spec {meta.get('spec_hash', '?')[:12]}, not {spec.spec_hash[:12]}"
    digest = meta.get("sha256")
    if digest is None and require_digest:
        return f"{rec.relpath} carries no data digest (written by an older version), so its data cannot be proven"
    if digest is not None and digest != array_digest(lat):
        return f"{rec.relpath} does not match its data digest (corrupt)"
    want = latent_grid(spec)
    if lat.ndim != 4 or tuple(lat.shape[1:]) != want:
        return (f"{rec.relpath} holds latents of shape {list(lat.shape)}; the job's size gives "
                f"[channels, {', '.join(map(str, want))}]")
    if not np.isfinite(lat).all():
        return f"{rec.relpath} holds non-finite latents"
    return None


def latent_grid(spec: JobSpec) -> tuple[int, int, int]:
    """(T, h, w) of a job's latents: its frames and pixels through the VAE's compression."""
    return (WAN22.latent_frames(spec.frames), spec.height // WAN22.vae_spatial, spec.width // WAN22.vae_spatial)


def check_video(out_dir: Path, rec: Recorded, *, frames: int, width: int, height: int) -> str | None:
    problem = check_recorded(out_dir, rec)
    if problem:
        return problem
    from pan2render.media.video import MediaError, probe_mp4  # PyAV is heavy

    try:
        info = probe_mp4(out_dir / str(rec.relpath))
    except MediaError as e:
        return f"{rec.relpath} does not decode ({e})"
    if (info.frames, info.width, info.height) != (frames, width, height):
        return (f"{rec.relpath} has {info.frames} frames of {info.width}x{info.height}, the spec asks "
                f"for {frames} of {width}x{height}")
    return None
