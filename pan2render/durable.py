"""Making a renamed write durable: fsync of a file, and of the folder that holds its new name.

A video (``media/video.py``), every other artifact (``runner/protocol/artifacts.py``'s
``write_atomic``) and a ledger rebuilt by ``repair`` are written under a temp name in their final
folder, fsynced, renamed, and then the folder is fsynced: after a crash the final name holds either
the old file or the whole new one. A module of its own, with nothing but ``os``, so that an artifact
write does not import the video module (PyAV) and the video module imports nothing of ``jobs/``.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; some filesystems refuse fsync on a directory, harmlessly.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
