"""Command-line overrides: ``--set key=value`` and ``--sweep key=a,b,c``.

:class:`Overrides` keeps the flags as typed (the ledger records them, and a later load validates
them the same way); :class:`FlagValues` is their validation: each value read as a YAML scalar and
checked as the same field written in the batch, a path relative to the working folder, every
problem located by the flag as typed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pan2render.jobs.coerce import (
    LORA_SCALE_AXIS,
    SWEEP_KEYS,
    BadValue,
    as_str,
    coerce_fields,
    did_you_mean,
    repeated,
    sweep_check,
)
from pan2render.jobs.context import LoadContext
from pan2render.jobs.inputs import escape_bidi
from pan2render.jobs.presets import parse_preset
from pan2render.jobs.references import image_problem, parse_model, resolve_interpolation_weights, resolve_loras
from pan2render.jobs.spec import DEFAULTS_KEYS, SourceLocation
from pan2render.jobs.yaml_reader import BoundedLoader, Node, TooDeep, too_deep, unreadable_number

# What ``--set`` may change: the batch's model and preset, and any field ``defaults`` may set.
SET_KEYS = ("model", "preset") + DEFAULTS_KEYS


@dataclass(frozen=True)
class Overrides:
    """``--set key=value`` and ``--sweep key=a,b,c`` as typed, in order. Kept as text so the ledger
    records exactly what was asked and a later load validates it the same way."""

    sets: tuple[str, ...] = ()
    sweeps: tuple[str, ...] = ()

    def to_json(self) -> dict[str, list[str]]:
        return {"set": list(self.sets), "sweep": list(self.sweeps)}

    @classmethod
    def from_json(cls, d: dict[str, list[str]] | None) -> "Overrides":
        d = d or {}
        return cls(sets=tuple(d.get("set", ())), sweeps=tuple(d.get("sweep", ())))

    def flags(self) -> list[str]:
        """The command-line flags that give these overrides (for messages and hints)."""
        return [f for s in self.sets for f in ("--set", s)] + [f for s in self.sweeps for f in ("--sweep", s)]


def _flag_scalar(text: str) -> Any:
    """A flag's value read as a YAML scalar, as if written in the batch (``4`` int, ``2.5`` float,
    ``euler`` str); raises BadValue for YAML that is not a plain scalar."""
    if not text.strip():
        return text
    # The checks a value written in a batch file gets from the YAML reader (whose own message for
    # these would be "special characters are not allowed"); the field's rule comes after.
    text = as_str(text, "a number or a word", non_empty=False, newlines=True)
    loader = BoundedLoader(text)
    try:
        value = loader.get_single_data()
    except TooDeep:
        raise BadValue(too_deep()) from None
    except yaml.YAMLError as exc:
        raise BadValue(f"{text!r} is not a plain value ({str(exc).splitlines()[0]})") from None
    except ValueError as exc:
        raise BadValue(unreadable_number(exc)) from None
    finally:
        loader.dispose()
    if isinstance(value, (dict, list)):
        raise BadValue(f"got {text!r}; a flag value must be a single number or word (no YAML lists or mappings)")
    return value


@dataclass
class FlagValues:
    """Overrides validated: model, preset and job fields from ``--set``, axes from ``--sweep``."""

    model: str | None = None
    preset: tuple[str, dict[str, Any]] | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    field_flags: dict[str, str] = field(default_factory=dict)  # key -> the --set flag as typed
    axes: dict[str, list[Any]] = field(default_factory=dict)  # key -> values, from --sweep

    @classmethod
    def parse(cls, overrides: Overrides, ctx: LoadContext) -> "FlagValues":
        out = cls()
        given: dict[str, str] = {}  # key -> the flag that gave it first
        for kind, items, allowed in (("--set", overrides.sets, SET_KEYS), ("--sweep", overrides.sweeps, SWEEP_KEYS)):
            for item in items:
                # As typed, for messages; bytes that were not UTF-8 (lone surrogates) and
                # bidirectional controls (which would reorder the message) shown escaped.
                flag = escape_bidi(f"{kind} {item}".encode("utf-8", "backslashreplace").decode("utf-8"))
                key, sep, text = item.partition("=")
                key = key.strip()
                # Flags have no file: their problems are located by the flag as typed (line 0).
                fctx = LoadContext(display=flag, base_dir=ctx.flags_dir, check_files=ctx.check_files,
                                   check_model=ctx.check_model, problems=ctx.problems, lora_sources=ctx.lora_sources,
                                   interpolation_sources=ctx.interpolation_sources, roots=ctx.roots)
                if not sep or not key:
                    example = "steps=4" if kind == "--set" else "seed=0,1,2"
                    fctx.problem(0, "(flag)", f"must look like key=value, e.g. {kind} {example}")
                    continue
                if key not in allowed and not (kind == "--sweep" and LORA_SCALE_AXIS.fullmatch(key)):
                    fctx.problem(0, key, f"unknown key {key!r}{did_you_mean(key, allowed)}; allowed: "
                                         f"{', '.join(allowed)}")
                    continue
                if key in given:  # also a field both set and swept
                    fctx.problem(0, key, f"{key!r} is given again (first by `{given[key]}`); give it once")
                    continue
                given[key] = flag
                if kind == "--set":
                    out._set(key, text, fctx)
                else:
                    out._sweep(key, text, fctx)
        return out

    def _set(self, key: str, text: str, fctx: LoadContext) -> None:
        try:
            value = _flag_scalar(text)
        except BadValue as exc:
            fctx.problem(0, key, str(exc))
            return
        node = Node(value, 0)
        if key == "model":
            self.model = parse_model(node, fctx)
        elif key == "preset":
            self.preset = parse_preset(node, fctx)
        else:
            checked = coerce_fields({key: node}, DEFAULTS_KEYS, "", fctx.display, fctx.problems)
            if key in checked:
                try:
                    self.fields[key] = _flag_path(key, checked[key], fctx)
                except BadValue as exc:
                    fctx.problem(0, key, str(exc))
                    return
                self.field_flags[key] = fctx.display

    def _sweep(self, key: str, text: str, fctx: LoadContext) -> None:
        values: list[Any] = []
        for i, part in enumerate(text.split(",")):
            try:
                values.append(_flag_path(key, sweep_check(key)(_flag_scalar(part.strip())), fctx))
            except BadValue as exc:
                fctx.problem(0, f"{key}[{i}]", str(exc))
        if twice := repeated(values):
            fctx.problem(0, key, f"values {', '.join(twice)} appear more than once; each sweep value must "
                                 "be distinct")
        self.axes[key] = values

    def apply_to_sweep(self, sweep: dict[str, list[Any]], node: Node | None,
                       ctx: LoadContext) -> dict[str, list[Any]]:
        """The file's sweep with --sweep axes added or replacing its own; a --set of a field the
        sweep varies is refused (which value would win is not obvious: --sweep says it)."""
        for key in self.fields:
            if key in sweep and key not in self.axes:
                line = node.value[key].line if node is not None and isinstance(node.value, dict) else 1
                ctx.problem(0, key, f"the batch sweeps {key!r} ({ctx.display}:{line}); to fix it to one "
                                    f"value use --sweep {key}=VALUE, which replaces the axis",
                            self.field_flags[key])
        return {**sweep, **self.axes}


def _flag_path(key: str, value: Any, fctx: LoadContext) -> Any:
    """A path given on the command line is relative to the working folder, not the batch; an image
    gets the checks an image named in the batch gets."""
    if key == "loras":
        return resolve_loras(value, fctx.base_dir, fctx, SourceLocation(fctx.display, 0), key)
    if key == "interpolation_weights":
        return resolve_interpolation_weights(value, fctx.base_dir, fctx, SourceLocation(fctx.display, 0), key)
    if key != "image":
        return value
    path = (fctx.base_dir / Path(value).expanduser()).resolve()
    problem = fctx.outside_roots(path) or (image_problem(path, relative_to="the folder the command runs in")
                                           if fctx.check_files else None)
    if problem:
        raise BadValue(problem)
    return str(path)
