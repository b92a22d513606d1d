"""Commands printed as hints, written so that they can be pasted into a shell as they are."""

from __future__ import annotations

import shlex
from pathlib import Path

PROGRAM = "pan2-render"


def command(*words: str | Path, program: str = PROGRAM) -> str:
    """``pan2-render WORDS...`` quoted for a POSIX shell (a folder named ``Dan's renders`` stays one
    argument). ``program``: how to call pan2-render, when not by that name on PATH."""
    return shlex.join([program, *(str(w) for w in words)])
