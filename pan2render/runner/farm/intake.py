"""What the farm makes of what a client sends: a batch file's text (``POST /api/batches``) or a
video request (``POST /v1/videos``), validated by the farm itself, with the checks ``run`` and
``validate`` make, into the :class:`BatchRequest` it records. The farm never records a batch it did
not resolve and check itself.

The files a batch names (its model folder, images, LoRA files, prompts file) must lie inside the
folders the farm reads from (``--inputs-root``), checked before any is read, and its output folder
inside those it writes to (``--outputs-root``), links followed: a client cannot make the farm read
or write elsewhere. Both default to the folder ``farm start`` ran in. Runs on the API's threads,
never on the farm's main thread: a batch of 20,000 jobs takes seconds to validate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pan2render.jobs.batch import load_batch
from pan2render.jobs.inputs import LIMITS
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import BatchValidationError
from pan2render.runner.farm.http import ApiError, field
from pan2render.runner.serve.config import ServingConfig, SettingError
from pan2render.runner.serve.out_check import refusal
from pan2render.runner.serve.session import BatchRequest

NAME_CHARS = 255  # a batch file's name, as the client calls it (it names the batch in messages)


@dataclass(frozen=True)
class Roots:
    """The folders a farm reads client files from and writes client batches into (real paths)."""

    inputs: tuple[Path, ...]
    outputs: tuple[Path, ...]

    @classmethod
    def of(cls, inputs: list[Path], outputs: list[Path]) -> Roots:
        return cls(tuple(_real(p) for p in inputs), tuple(_real(p) for p in outputs))

    def describe(self) -> dict[str, list[str]]:
        return {"inputs": [str(p) for p in self.inputs], "outputs": [str(p) for p in self.outputs]}

    def output_folder(self, text: str, *, param: str = "out") -> Path:
        """The output folder a client names (relative: to the first outputs root), if it lies inside
        an outputs root once links are followed; 400 naming the roots otherwise."""
        path = _absolute(text, self.outputs[0], param)
        if not _inside(path, self.outputs):
            raise ApiError(400, f"{param} {text!r} lies outside the folders this farm writes to "
                                f"({', '.join(map(str, self.outputs))}); name a folder inside one of them "
                                f"(the farm's --outputs-root)", param=param)
        return path

    def input_folder(self, text: str, *, param: str = "base") -> Path:
        path = _absolute(text, self.inputs[0], param)
        if not _inside(path, self.inputs):
            raise ApiError(400, f"{param} {text!r} lies outside the folders this farm reads from "
                                f"({', '.join(map(str, self.inputs))}); name a folder inside one of them "
                                f"(the farm's --inputs-root)", param=param)
        return path


def batch_from_post(data: dict[str, Any], roots: Roots, default_retries: int) -> BatchRequest:
    """``POST /api/batches``: {text, name?, base?, out, set?, sweep?, retries?, add?, force?, prune?}
    -> a validated BatchRequest; 400 for a malformed field, 422 listing every problem of the batch
    (file:line, field, what is allowed), 409 for an output folder it may not be recorded into."""
    text = field(data, "text", str, required=True)
    if len(text.encode()) > LIMITS.batch_bytes:
        raise ApiError(413, f"the batch is {len(text.encode())} bytes; at most {LIMITS.batch_bytes} are read")
    name = field(data, "name", str, default="batch.yaml")
    if not name or len(name) > NAME_CHARS or "/" in name or "\0" in name or name in (".", ".."):
        raise ApiError(400, f"name {name[:60]!r}: the batch file's name, without a folder (at most {NAME_CHARS} "
                            f"characters)", param="name")
    base = roots.input_folder(field(data, "base", str, default=str(roots.inputs[0])))
    out = roots.output_folder(field(data, "out", str, required=True))
    overrides = Overrides(sets=tuple(_strings(data, "set")), sweeps=tuple(_strings(data, "sweep")))
    retries = field(data, "retries", int, default=default_retries)
    try:
        ServingConfig(retries=retries)
    except SettingError as e:
        raise ApiError(400, str(e), param="retries") from None
    try:
        batch = load_batch(base / name, text=text, overrides=overrides, roots=roots.inputs, flags_dir=base)
    except BatchValidationError as e:
        problems = [str(p) for p in e.problems]
        raise ApiError(422, f"{name}: {len(problems)} problem(s); nothing was queued", code="invalid_batch",
                       extra={"problems": problems}) from None
    if (why := refusal(out, batch.path, {j.job_id for j in batch.jobs}, add=field(data, "add", bool, default=False),
                       force=field(data, "force", bool, default=False))) is not None:
        raise ApiError(409, f"{why}; nothing was queued", param="out")
    return BatchRequest(out_dir=out, batch=batch, overrides=overrides, retries=retries,
                        prune=field(data, "prune", bool, default=False))


def _strings(data: dict[str, Any], name: str) -> list[str]:
    values = field(data, name, list, default=[])
    if not all(isinstance(v, str) for v in values) or len(values) > 64:
        raise ApiError(400, f"{name!r} must be a list of at most 64 strings like KEY=VALUE", param=name)
    return values


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _absolute(text: str, relative_to: Path, param: str) -> Path:
    if not text or "\0" in text or len(text) > LIMITS.path_chars:
        raise ApiError(400, f"{param}: a folder's path of at most {LIMITS.path_chars} characters", param=param)
    return Path(os.path.realpath(relative_to / Path(text).expanduser()))


def _inside(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(root) for root in roots)
