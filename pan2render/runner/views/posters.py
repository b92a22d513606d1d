"""The report's pictures, kept in ``DIR/_report/``: each video's poster (its middle frame) and a
thumbnail of each job's input image, made once per content (the name holds its digest) and remade
when lost."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

from pan2render.jobs import outdir
from pan2render.jobs.inputs import LIMITS, InputFileError, read_regular_file
from pan2render.jobs.ledger import JobRecord

POSTER_DIR = "_report"
POSTER_MAX_SIDE = 480  # px; a poster is shown at most ~320 px wide, and 500 of them stay small


def poster(out_dir: Path, job_id: str, video: Path, sha256: str | None, say: Callable[[str], None], *,
            make: bool = True) -> str | None:
    """The poster (middle frame) of a video, made once per video content and kept in DIR/_report/
    (``make`` False: only a poster already made, else None)."""
    from pan2render.media.video import MediaError, middle_frame_png  # PyAV

    rel = f"{POSTER_DIR}/{job_id}.{(sha256 or 'unrecorded')[:12]}.png"
    path = out_dir / rel
    if path.is_file():
        return rel
    if not make:
        return None
    try:
        data = middle_frame_png(video, max_side=POSTER_MAX_SIDE)
    except MediaError as e:  # shown without a poster; `resume` re-encodes a broken video
        say(f"report: {job_id}: no poster: {e}")
        return None
    _write_cached(path, data)
    return rel


INPUT_MAX_SIDE = 160  # px: the first frame is shown small beside the video it started


def input_thumbnail(out_dir: Path, job: JobRecord, say: Callable[[str], None], *, make: bool = True) -> str | None:
    """A small PNG of the job's input image, made once per image content into DIR/_report/ (the
    image itself may sit anywhere; the page only links inside DIR). ``make`` False: only one made."""
    from pan2render.media.video import MediaError, image_png  # PyAV

    spec = job.spec
    if spec.image is None or spec.image_sha256 is None:
        return None
    rel = f"{POSTER_DIR}/{job.id}.input.{spec.image_sha256[:12]}.png"
    if (out_dir / rel).is_file():
        return rel
    if not make:
        return None
    try:
        # Read as validation reads it: by now the path may name a FIFO, a device or a stalled mount.
        image = read_regular_file(spec.image, limit=LIMITS.image_bytes)
    except (OSError, InputFileError):
        return None  # moved, deleted or no longer a file we read since: the tile names its path
    if hashlib.sha256(image).hexdigest() != spec.image_sha256:
        return None  # changed since: not the image the job started from
    try:
        data = image_png(image, max_side=INPUT_MAX_SIDE, name=spec.image)
    except MediaError as e:
        say(f"report: {job.id}: no thumbnail of its image: {e}")
        return None
    _write_cached(out_dir / rel, data)
    return rel


def _write_cached(path: Path, data: bytes) -> None:
    """A file of the report's cache, remade from its source when lost: renamed into place (never
    half a PNG under its name) but not fsynced, which would cost more than making it."""
    outdir.real_dir(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with os.fdopen(outdir.create_new(tmp), "wb") as f:
        f.write(data)
    os.replace(tmp, path)
