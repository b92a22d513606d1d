"""What one batch load carries from step to step, and a job entry before it is resolved."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pan2render.jobs.spec import Problem, SourceLocation


@dataclass
class RawJob:
    """One job entry before resolution: its own validated fields and where it was written."""

    fields: dict[str, Any]
    location: SourceLocation
    label: str  # "jobs[2]" or "prompts_file[5]" for messages
    base_dir: Path  # relative image paths resolve against this folder
    lines: dict[str, int]  # field -> line it is written on, for messages


@dataclass
class LoadContext:
    """One load of a batch: where its messages point, which files it checks, every problem found so
    far (all are reported at once), and the files it names, each checked and hashed once."""

    display: str  # the batch path as the user gave it, for messages
    base_dir: Path  # absolute folder of the batch file
    check_files: bool
    check_model: bool = True
    problems: list[Problem] = field(default_factory=list)
    # Per load (an edited image re-hashes): each image's problem (None: none) and sha256 (None: unreadable).
    image_problems: dict[str, str | None] = field(default_factory=dict)
    image_hashes: dict[str, str | None] = field(default_factory=dict)
    # Every LoRA file named, with where it was first named and by which field: checked once, after
    # the model is known (`check_lora_files`), and hashed once.
    lora_sources: dict[str, tuple[SourceLocation, str]] = field(default_factory=dict)
    lora_hashes: dict[str, str | None] = field(default_factory=dict)
    # The same for every interpolation weights file named (`check_interpolation_files`).
    interpolation_sources: dict[str, tuple[SourceLocation, str]] = field(default_factory=dict)
    interpolation_hashes: dict[str, str | None] = field(default_factory=dict)
    # The folders a load may read from (None: any). A farm loading a batch a client sent reads only
    # inside the roots it allows: every file the batch names is checked before it is read.
    roots: tuple[Path, ...] | None = None
    flags_dir: Path = field(default_factory=Path.cwd)  # what --set/--sweep paths are relative to
    # The problems noted through `note_once`: a set, so that a batch of many jobs, each with its
    # own problem, is not checked against every problem noted before (quadratic in the jobs).
    _noted_once: set[Problem] = field(default_factory=set, init=False, repr=False)

    def outside_roots(self, path: Path) -> str | None:
        """Why ``path`` may not be read by this load (None: it may), links followed."""
        if self.roots is None:
            return None
        real = Path(os.path.realpath(path))
        if any(real.is_relative_to(root) for root in self.roots):
            return None
        return (f"{str(path)!r} lies outside the folders this farm reads from ({', '.join(map(str, self.roots))}); "
                f"allowed: a path inside one of them (the farm's --inputs-root)")

    def problem(self, line: int, fld: str, message: str, display: str | None = None) -> None:
        self.problems.append(Problem(SourceLocation(display or self.display, line), fld, message))

    def note_once(self, problem: Problem) -> None:
        """Note ``problem`` unless it was noted through here already (a job's problem found again
        under each of its sweep combinations is listed once)."""
        if problem not in self._noted_once:
            self._noted_once.add(problem)
            self.problems.append(problem)
