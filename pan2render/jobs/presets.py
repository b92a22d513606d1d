"""Presets: the shipped ones (``pan2render/configs/presets/*.yaml``) and a preset file of the
user's own, each read and checked as every preset is: a mapping of the fields a preset may hold,
each valid, the required ones present."""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path
from typing import Any

from pan2render.jobs.coerce import BadValue, as_path, coerce_fields, did_you_mean
from pan2render.jobs.context import LoadContext
from pan2render.jobs.inputs import LIMITS
from pan2render.jobs.spec import PRESET_FIELDS, PRESET_REQUIRED, BatchValidationError, Problem, SourceLocation
from pan2render.jobs.yaml_reader import Node, YamlReader, read_text

PRESET_KEYS = ("description",) + PRESET_FIELDS
# A `preset:` value ending so (or holding a `/`) names a preset file of the user's own.
PRESET_FILE_SUFFIXES = (".yaml", ".yml")


def _preset_dir() -> Any:
    """The packaged presets folder (package data, so an installed wheel finds it)."""
    try:
        return importlib.resources.files("pan2render") / "configs" / "presets"
    except (NotADirectoryError, TypeError):
        # A stale editable install can leave pan2render registered as a namespace package, which
        # importlib.resources (3.11) cannot open; the folder beside this file is the same data.
        return Path(__file__).resolve().parents[1] / "configs" / "presets"


@functools.cache
def _load_presets() -> dict[str, dict[str, Any]]:
    presets: dict[str, dict[str, Any]] = {}
    problems: list[Problem] = []
    for res in sorted(_preset_dir().iterdir(), key=lambda r: r.name):
        if not res.name.endswith(".yaml"):
            continue
        values = _read_preset(res.read_text(encoding="utf-8"), str(res), problems)
        if values is not None:
            presets[res.name[: -len(".yaml")]] = values
    if problems:  # a shipped preset is broken: a bug in this package, reported like a batch problem
        raise BatchValidationError(problems)
    return presets


def _read_preset(text: str, display: str, problems: list[Problem]) -> dict[str, Any] | None:
    """A preset file's fields (coerced, with ``description``), checked as every preset is: a
    mapping of the fields a preset may hold, each valid, the required ones present. None (with
    the problems noted) when it is not a mapping."""
    reader = YamlReader(display, problems)
    root = reader.read(text)
    if root is None or not isinstance(root.value, dict):
        problems.append(Problem(SourceLocation(display, root.line if root else 1), "(preset)",
                                f"a preset must be a mapping of job fields ({', '.join(PRESET_FIELDS)})"))
        return None
    values = coerce_fields(root.value, PRESET_KEYS, "", display, problems)
    for key in PRESET_REQUIRED:
        if key not in values:
            problems.append(Problem(SourceLocation(display, 1), key, f"preset lacks required field {key!r}"))
    return values


def list_presets() -> dict[str, dict[str, Any]]:
    """Every shipped preset: name -> its fields (coerced values, plus ``description``)."""
    return {name: dict(values) for name, values in _load_presets().items()}


def preset_text(name: str) -> str:
    """The shipped preset ``name`` as its file is written, comments included (they say why each
    value); LookupError naming the presets (and the nearest one) if there is none of that name."""
    presets = sorted(_load_presets())
    if name not in presets:
        raise LookupError(f"unknown preset {name!r}{did_you_mean(name, presets)}; "
                          f"allowed: one of {', '.join(presets)}")
    return (_preset_dir() / f"{name}.yaml").read_text(encoding="utf-8")


def parse_preset(node: Node | None, ctx: LoadContext) -> tuple[str, dict[str, Any]]:
    """A shipped preset by name, or a preset file of the user's own by path (one with a ``/`` or a
    ``.yaml`` / ``.yml`` ending, relative to the file that names it), checked as the shipped ones
    are. Returns (the name, or the file's absolute path; its fields)."""
    presets = _load_presets()
    allowed = f"one of {', '.join(sorted(presets))}, or a path to a preset file ({'/'.join(PRESET_FILE_SUFFIXES)})"
    if node is None:
        ctx.problem(1, "preset", f"missing; allowed: {allowed}")
        return "", {}
    if isinstance(node.value, str) and ("/" in node.value or node.value.endswith(PRESET_FILE_SUFFIXES)):
        return _preset_file(node, ctx)
    if not isinstance(node.value, str) or node.value not in presets:
        hint = did_you_mean(node.value, sorted(presets)) if isinstance(node.value, str) else ""
        ctx.problem(node.line, "preset", f"unknown preset {node.value!r}{hint}; allowed: {allowed}")
        return "", {}
    values = {k: v for k, v in presets[node.value].items() if k != "description"}
    return node.value, values


def _preset_file(node: Node, ctx: LoadContext) -> tuple[str, dict[str, Any]]:
    try:
        value = as_path(node.value, "a path to a preset file")
    except BadValue as exc:
        ctx.problem(node.line, "preset", str(exc))
        return "", {}
    path = (ctx.base_dir / Path(value).expanduser()).resolve()
    where = SourceLocation(ctx.display, node.line)
    text = read_text(path, str(path), ctx.problems, what="preset file", limit=LIMITS.batch_bytes,
                     location=where, fld="preset")
    values = None if text is None else _read_preset(text, str(path), ctx.problems)
    if values is None:
        return "", {}
    return str(path), {k: v for k, v in values.items() if k != "description"}
