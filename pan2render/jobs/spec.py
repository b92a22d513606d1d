"""Typed records shared by the batch parser, the ledger and the runner.

The parser (``pan2render.jobs.batch``) turns a YAML batch into these dataclasses once; nothing
downstream reads raw YAML dicts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from pan2render.media.x264 import DEFAULT_X264_PRESET
from pan2render.sampling import SAMPLERS

ALLOWED_GPUS = (1, 2, 4, 8)

# Fields of a resolved job that change the rendered video. The spec hash covers exactly these, so
# a cosmetic change (a comment, the order of keys) never re-renders a finished job, and any change
# that would alter the pixels always does.
RENDER_FIELDS = (
    "model", "weights", "prompt", "negative_prompt", "image_sha256", "seed", "steps", "guidance", "height",
    "width", "frames", "fps", "flow_shift", "sampler", "crf", "timesteps", "encode_preset",
)
# Render fields added after job ids were first handed out, with their defaults: one counts in the
# hash only when set away from its default, so the jobs of an existing output folder keep their ids.
LATER_RENDER_FIELDS: dict[str, Any] = {"weights": None, "timesteps": None, "encode_preset": DEFAULT_X264_PRESET}


@dataclass(frozen=True)
class SourceLocation:
    """Where a value came from, for error messages: ``file:line``, or a command-line flag as typed
    (``--set steps=x``), which has no line: ``line`` 0."""

    file: str
    line: int

    def __str__(self) -> str:
        return self.file if self.line == 0 else f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a batch file."""

    location: SourceLocation
    field: str  # dotted path, e.g. "jobs[2].frames"
    message: str  # what is wrong and what is allowed

    def __str__(self) -> str:
        return f"{self.location}: {self.field}: {self.message}"


class BatchValidationError(Exception):
    """A batch has one or more problems; all of them are listed, none of the batch ran."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) in the batch:\n{lines}")


@dataclass(frozen=True)
class JobSpec:
    """One fully resolved job: preset < defaults < job < sweep value already applied."""

    name: str  # readable name given or derived ("job-3"); unique within the batch
    model: str  # "tiny" or an absolute checkpoint folder
    prompt: str
    negative_prompt: str
    image: str | None  # absolute path of the first-frame image (TI2V), or None
    image_sha256: str | None  # content hash of the image, so the spec hash follows the pixels
    seed: int
    steps: int
    guidance: float
    height: int
    width: int
    frames: int
    fps: float
    flow_shift: float
    sampler: str  # one of SAMPLERS
    gpus: int  # one of ALLOWED_GPUS
    crf: int
    preset: str
    encode_preset: str = DEFAULT_X264_PRESET  # libx264 preset (media/x264.py), not the job preset
    # Fingerprint of the checkpoint folder's weights (jobs.weights), None for the embedded tiny
    # model: a checkpoint replaced under the same path makes new jobs.
    weights: str | None = None
    # Sampler dmd: the listed timesteps (ints in [1, T], strictly decreasing); None: the
    # checkpoint's own (dmd) or not applicable (unipc, euler).
    timesteps: tuple[int, ...] | None = None
    sweep: dict[str, Any] = field(default_factory=dict)  # the sweep values applied to this job
    source: SourceLocation | None = None

    @property
    def spec_hash(self) -> str:
        """sha256 over the render-affecting fields, as canonical JSON."""
        payload = {k: getattr(self, k) for k in RENDER_FIELDS
                   if k not in LATER_RENDER_FIELDS or getattr(self, k) != LATER_RENDER_FIELDS[k]}
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def job_id(self) -> str:
        """Readable, filesystem-safe and deterministic: ``<name>[-<field><value>...]-<hash8>``.

        Only ``[a-z0-9._-]`` survive, the id never starts with a dot, and it is capped in length,
        so a job's folder can never escape the output folder whatever the job is named.
        """
        parts = [self.name] + [f"{k}{v}" for k, v in sorted(self.sweep.items())]
        readable = _slug("-".join(parts))[:80].strip("-.") or "job"
        return f"{readable}-{self.spec_hash[:8]}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["source"] = None if self.source is None else {"file": self.source.file, "line": self.source.line}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JobSpec":
        d = dict(d)
        src = d.pop("source", None)
        if d.get("timesteps") is not None:  # JSON gives a list
            d["timesteps"] = tuple(d["timesteps"])
        return cls(**d, source=None if src is None else SourceLocation(src["file"], int(src["line"])))


@dataclass(frozen=True)
class Batch:
    """A parsed, validated batch file."""

    path: str
    model: str
    preset: str
    jobs: list[JobSpec]
    # The model folder's per-file fingerprints ({relpath: {"size", "sampled_sha256"}}), recorded in
    # the ledger so a later change can be explained file by file; empty for the tiny model.
    weights_files: dict[str, Any] = field(default_factory=dict)


def _slug(text: str) -> str:
    text = text.lower()
    text = re.sub(r"[^a-z0-9._-]+", "-", text)
    text = re.sub(r"-{2,}", "-", text)
    return text.lstrip(".")
