"""YAML batch files -> validated, fully resolved ``JobSpec``s.

A batch names a ``model``, a ``preset``, optional ``defaults``, a ``jobs`` list and/or a
``prompts_file``, and an optional ``sweep`` (field -> list of values, a cartesian product applied
to every job). Each job field resolves as: built-in default < preset < defaults < job < sweep value.

Everything is checked before anything runs, and every problem is collected with its ``file:line``
before one ``BatchValidationError`` is raised. YAML is read with ``yaml.SafeLoader`` only; we
compose the node tree ourselves so every value keeps the line it was written on.

Choices a user can rely on:
- A job without ``seed`` gets seed 0 (from the built-in defaults), so a batch renders the same
  videos on every run; set ``seed`` in ``defaults`` or sweep it to vary.
- A job without ``name`` is named after the first words of its prompt ("a-red-fox-runs-through"),
  with ``-2``, ``-3`` for repeats in file order: the name stays stable when jobs are re-ordered, so
  job ids (name + sweep values + spec hash) stay stable too.
- Relative paths (model folder, image, prompts_file) resolve against the folder of the file that
  names them. ``check_files=False`` skips the existence checks for the model folder and images
  (resuming on a machine that lacks them); the prompts file is still read, it defines the jobs.
"""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from pan2render.jobs.inputs import (
    LIMITS,
    InputFileError,
    control_chars,
    describe_char,
    dit_tokens,
    image_size,
    join_surrogate_pairs,
    lone_surrogate,
    nesting_depth,
    read_regular_file,
)
from pan2render.jobs.spec import (
    BUILTIN_DEFAULTS,
    DEFAULTS_KEYS,
    JOB_KEYS,
    PRESET_FIELDS,
    PRESET_REQUIRED,
    RULES,
    Batch,
    BatchValidationError,
    JobSpec,
    Kind,
    LoraRef,
    Problem,
    Rule,
    Scope,
    SourceLocation,
)
from pan2render.jobs.weights import folder_fingerprint, sha256_file
from pan2render.lanes import lane_problems
from pan2render.lora_plan import LoraFileError, detect_layout, dit_linears, plan_lora, read_header
from pan2render.sampling import DEFAULT_NUM_TRAIN_TIMESTEPS, DMD, combination_problems, is_int, timesteps_problem
from pan2render.tiny_dit import TINY_DIT_CONFIG, TINY_MODEL

TOP_LEVEL_KEYS = ("model", "preset", "defaults", "jobs", "prompts_file", "sweep")
SWEEP_KEYS = DEFAULTS_KEYS
# A sweep over one adapter's scale: `loras[0].scale: [0.25, 0.5, 1.0]` (the job's own first LoRA).
LORA_SCALE_AXIS = re.compile(r"loras\[(\d+)\]\.scale")
PRESET_KEYS = ("description",) + PRESET_FIELDS


# --------------------------------------------------------------------------------------------------
# YAML with line numbers


@dataclass
class _Node:
    """A YAML value with its 1-based line: a scalar, ``dict[str, _Node]`` or ``list[_Node]``.

    For a mapping value the line is its key's line (where ``frames: 20`` is written); for a list
    item it is the item's first line.
    """

    value: Any
    line: int

    def __repr__(self) -> str:  # messages show what the user wrote, not our wrapper
        return repr(self.value)


# Tags the safe loader resolves by itself; anything else (``!!python/...``, ``!custom``) is refused.
_COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


class _TooDeep(yaml.MarkedYAMLError):
    """Lists and mappings nested past LIMITS.nesting (the composer recurses once per level)."""


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader with a bound on nesting: thousands of ``[`` would otherwise end in a
    RecursionError, with no line to show."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > LIMITS.nesting:
                raise _TooDeep(problem=_too_deep(), problem_mark=self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _scalar(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    """A node's value; one Python cannot hold (an integer of more digits than it converts) is a
    problem at its line, not a crash."""
    try:
        return loader.construct_object(node, deep=True)
    except ValueError as exc:
        if isinstance(exc, yaml.YAMLError):
            raise
        raise yaml.constructor.ConstructorError(None, None, _unreadable_number(exc), node.start_mark) from None


def _unreadable_number(exc: ValueError) -> str:
    return f"this value cannot be read as a number ({str(exc).split(';')[0]})"


class _YamlReader:
    """Composes one YAML document with SafeLoader and converts it to ``_Node``s, noting problems."""

    def __init__(self, display: str, problems: list[Problem]):
        self.display = display
        self.problems = problems

    def read(self, text: str) -> _Node | None:
        if self._control_chars(text):
            return None
        loader = _BoundedLoader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                return None
            if not self._expansion_ok(root):
                return None
            return self._convert(loader, root, root.start_mark.line + 1, {}, set())
        except _TooDeep as exc:
            line = exc.problem_mark.line + 1 if exc.problem_mark is not None else 1
            self._problem(line, "(yaml)", str(exc.problem))
            return None
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else 1
            what = " ".join(str(s) for s in (exc.context, exc.problem) if s)
            if isinstance(exc, yaml.constructor.ConstructorError):  # e.g. a !!python tag
                self._problem(line, "(yaml)", f"{what}; use plain YAML values (strings, numbers, lists, mappings)")
            else:
                self._problem(line, "(yaml)", f"YAML syntax error: {what}; fix the file at this line")
            return None
        except yaml.YAMLError as exc:
            self._problem(1, "(yaml)", f"YAML error: {exc}")
            return None
        finally:
            loader.dispose()

    def _problem(self, line: int, fld: str, message: str) -> None:
        self.problems.append(Problem(SourceLocation(self.display, line), fld, message))

    def _control_chars(self, text: str) -> bool:
        """Note each line holding a NUL or another control character (tab and line ends pass)."""
        found = False
        for lineno, line in enumerate(text.split("\n"), start=1):
            bad = control_chars(line, newlines=True)
            if bad:
                col, char = bad[0]
                self._problem(lineno, "(yaml)", f"control character {describe_char(char)} at column {col + 1}; "
                                                "allowed: printable text (write it as a YAML escape if you must)")
                found = True
        return found

    def _expansion_ok(self, root: yaml.Node) -> bool:
        """Refuse documents whose aliases expand past the limits ("billion laughs"), before anything
        is built from them: expanded sizes are counted once per node, so this is linear in the text."""
        size: dict[int, int] = {}
        aliases = 0
        stack: list[tuple[yaml.Node, bool]] = [(root, False)]
        while stack:
            node, children_done = stack.pop()
            if id(node) in size and not children_done:
                aliases += 1
                if aliases > LIMITS.yaml_aliases:
                    self._problem(node.start_mark.line + 1, "(yaml)",
                                  f"more than {LIMITS.yaml_aliases} alias references (*name); allowed: at most "
                                  f"{LIMITS.yaml_aliases} in one batch")
                    return False
                continue
            if isinstance(node, yaml.ScalarNode):
                size[id(node)] = 1
                continue
            children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                        else list(node.value))
            if not children_done:
                size[id(node)] = 0  # visited: a later reference is an alias (or a recursion)
                stack.append((node, True))
                stack.extend((c, False) for c in reversed(children))
                continue
            size[id(node)] = 1 + sum(size[id(c)] for c in children)
            if size[id(node)] > LIMITS.yaml_values:
                self._problem(node.start_mark.line + 1, "(yaml)",
                              f"the value written here expands through aliases to more than {LIMITS.yaml_values:,} "
                              f"values; allowed: at most {LIMITS.yaml_values:,} after alias expansion")
                return False
        return True

    def _convert(self, loader: yaml.SafeLoader, node: yaml.Node, line: int, memo: dict[int, Any],
                 active: set[int]) -> _Node:
        # Aliases share node objects: memoising keeps "billion laughs" documents linear, and the
        # active set catches an alias that points into its own anchor.
        if id(node) in active:
            raise yaml.constructor.ConstructorError(None, None, "recursive alias", node.start_mark)
        if not isinstance(node, yaml.ScalarNode) and node.tag not in _COLLECTION_TAGS:
            raise yaml.constructor.ConstructorError(
                None, None, f"tag {node.tag!r} is not allowed (plain YAML only)", node.start_mark)
        if isinstance(node, yaml.MappingNode):
            if id(node) not in memo:
                active.add(id(node))
                memo[id(node)] = self._mapping(loader, node, memo, active)
                active.discard(id(node))
            return _Node(memo[id(node)], line)
        if isinstance(node, yaml.SequenceNode):
            if id(node) not in memo:
                active.add(id(node))
                memo[id(node)] = [self._convert(loader, item, item.start_mark.line + 1, memo, active)
                                  for item in node.value]
                active.discard(id(node))
            return _Node(memo[id(node)], line)
        return _Node(_scalar(loader, node), line)

    def _mapping(self, loader: yaml.SafeLoader, node: yaml.MappingNode, memo: dict[int, Any],
                 active: set[int]) -> dict[str, _Node]:
        own: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = _scalar(loader, key_node)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in own:
                self._problem(line, key, f"key {key!r} appears twice (first on line {own[key]}); keep one")
            own.setdefault(key, line)
        loader.flatten_mapping(node)  # resolves `<<: *anchor` merges; own keys come last and win
        out: dict[str, _Node] = {}
        for key_node, value_node in node.value:
            key = _scalar(loader, key_node)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                self._problem(line, str(key), f"keys must be strings, got {key!r} ({type(key).__name__}); quote it")
                continue
            out[key] = self._convert(loader, value_node, line, memo, active)
        return out


# --------------------------------------------------------------------------------------------------
# Field rules


class _Bad(Exception):
    """A value broke its field's rule; the message says what is allowed."""


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool; YAML reads yes/no/on/off/true/false as booleans"
    return "null" if value is None else type(value).__name__


def _as_int(value: Any, allowed: str) -> int:
    if not is_int(value):  # YAML `yes` is a bool, not 1
        raise _Bad(f"got {value!r} ({_type_name(value)}); allowed: {allowed}")
    return value


def _as_float(value: Any, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad(f"got {value!r} ({_type_name(value)}); allowed: {allowed}")
    try:
        number = float(value)  # 5 and 5.0 must hash alike
    except OverflowError:  # an integer past float's range
        raise _Bad(f"got an integer of {len(str(abs(value)))} digits; allowed: {allowed}") from None
    if not math.isfinite(number):
        raise _Bad(f"got {value!r} ({_type_name(value)}); allowed: {allowed}")
    return number


def _as_str(value: Any, allowed: str, *, non_empty: bool, newlines: bool = False,
            max_chars: int | None = None) -> str:
    if not isinstance(value, str):
        raise _Bad(f"got {value!r} ({_type_name(value)}); allowed: {allowed}")
    value = join_surrogate_pairs(value)
    lone = lone_surrogate(value)
    if lone is not None:
        raise _Bad(f"holds a lone surrogate {describe_char(value[lone])} at position {lone} (half of a UTF-16 "
                   f"pair, e.g. an unpaired \\u escape); allowed: {allowed}, in valid Unicode")
    if max_chars is not None and len(value) > max_chars:
        raise _Bad(f"is {len(value):,} characters long; allowed: {allowed}")
    if non_empty and not value.strip():
        raise _Bad(f"is empty; allowed: {allowed}")
    bad = control_chars(value, newlines=newlines)
    if bad:
        where, char = bad[0]
        raise _Bad(f"holds the control character {describe_char(char)} at position {where}; allowed: {allowed} "
                   f"without control characters{' (tabs and line breaks are fine)' if newlines else ''}")
    return value


def _as_path(value: Any, allowed: str) -> str:
    """A path as the batch or a flag names it (model folder, prompts file): one line, bounded."""
    return _as_str(value, allowed, non_empty=True, max_chars=LIMITS.path_chars)


def _nearest(n: float, rule: Rule) -> str:
    """The valid values of a stepped field either side of ``n`` (the smallest one when ``n`` is below it)."""
    assert rule.step is not None
    first = rule.first_valid()
    lo = (n - rule.offset) // rule.step * rule.step + rule.offset
    return f"{first}" if lo < first else f"{lo} or {lo + rule.step}"


def _check_number(rule: Rule, v: Any) -> float:
    allowed = rule.allowed_text()
    x = _as_int(v, allowed) if rule.kind is Kind.INT else _as_float(v, allowed)
    low = rule.min is not None and (x <= rule.min if rule.min_open else x < rule.min)
    if rule.step is not None and (low or (x - rule.offset) % rule.step):
        raise _Bad(f"got {x} (nearest: {_nearest(x, rule)}); allowed: {allowed}")
    if low or (rule.max is not None and x > rule.max):
        raise _Bad(f"got {x}; allowed: {allowed}")
    return x


def _check_choice(rule: Rule, v: Any) -> Any:
    allowed = rule.allowed_text()
    x = _as_int(v, allowed) if is_int(rule.choices[0]) else _as_str(v, allowed, non_empty=True)
    if x not in rule.choices:
        hint = _did_you_mean(str(x), [str(c) for c in rule.choices])
        raise _Bad(f"got {x!r}{hint}; allowed: {allowed}")
    return x


def _check_timesteps(v: Any) -> tuple[int, ...]:
    # Checked against the usual T here; the sampler checks the checkpoint's own T when it loads.
    items = [n.value if isinstance(n, _Node) else n for n in v] if isinstance(v, list) else v
    problem = timesteps_problem(items, num_train_timesteps=DEFAULT_NUM_TRAIN_TIMESTEPS)
    if problem is not None:
        raise _Bad(problem + " (for sampler dmd)")
    return tuple(items)


def _plain(v: Any) -> Any:
    return v.value if isinstance(v, _Node) else v


def _check_lora_scale(v: Any, allowed: str) -> float:
    scale = _as_float(v, allowed)
    if abs(scale) > LIMITS.lora_scale:
        raise _Bad(f"scale {scale:g} is out of range; allowed: {allowed}")
    return scale


def _check_loras(v: Any) -> tuple[LoraRef, ...]:
    """A list of adapters, each a path or ``{path, scale}``; a lone path is one adapter at scale 1
    (what a flag gives: ``--set loras=style.safetensors``). Paths are resolved later, against the
    file that names them."""
    allowed = RULES["loras"].allowed_text()
    v = _plain(v)
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise _Bad(f"got {v!r} ({_type_name(v)}); allowed: {allowed}")
    if len(items) > LIMITS.loras:
        raise _Bad(f"lists {len(items)} adapters; allowed: {allowed}")
    refs: list[LoraRef] = []
    for i, node in enumerate(items):
        item = _plain(node)
        fields = {str(k): _plain(n) for k, n in item.items()} if isinstance(item, dict) else {"path": item}
        unknown = [k for k in fields if k not in ("path", "scale")]
        if unknown:
            raise _Bad(f"[{i}]: unknown key {unknown[0]!r}{_did_you_mean(unknown[0], ('path', 'scale'))}; allowed: "
                       f"{allowed}")
        if "path" not in fields:
            raise _Bad(f"[{i}]: no path; allowed: {allowed}")
        try:
            refs.append(LoraRef(_as_path(fields["path"], allowed),
                                _check_lora_scale(fields.get("scale", 1.0), allowed)))
        except _Bad as exc:
            raise _Bad(f"[{i}]: {exc}") from None
    paths = [r.path for r in refs]
    repeated = sorted({p for p in paths if paths.count(p) > 1})
    if repeated:
        raise _Bad(f"lists {repeated[0]!r} more than once; give it once, with the scale you want")
    return tuple(refs)


def _checker(rule: Rule) -> Callable[[Any], Any]:
    """The check of one field's values, from its rule in the schema (``JobSpec``)."""
    kind = rule.kind
    if kind in (Kind.TEXT, Kind.LINE, Kind.PATH):
        return lambda v: _as_str(v, rule.allowed_text(), non_empty=not rule.empty_ok, newlines=kind is Kind.TEXT,
                                 max_chars=rule.max_chars)
    if kind is Kind.CHOICE:
        return functools.partial(_check_choice, rule)
    if kind is Kind.TIMESTEPS:
        return _check_timesteps
    if kind is Kind.LORAS:
        return _check_loras
    assert kind in (Kind.INT, Kind.FLOAT), kind
    return functools.partial(_check_number, rule)


_CHECKS: dict[str, Callable[[Any], Any]] = {
    **{name: _checker(rule) for name, rule in RULES.items() if rule.scope is not Scope.NOWHERE},
    "description": lambda v: _as_str(v, "a string", non_empty=False, newlines=True,  # a preset's own
                                     max_chars=LIMITS.text_chars),
}


# Names other tools give our fields (diffusers' pipeline arguments, FastVideo's flags, Wan2.2's
# config keys): a batch or flag using one gets our name as its did-you-mean, never a silent rename.
ALIASES: dict[str, str] = {
    "num_inference_steps": "steps", "sample_steps": "steps",
    "guidance_scale": "guidance", "sample_guide_scale": "guidance", "cfg_scale": "guidance",
    "num_frames": "frames", "frame_num": "frames",
    "shift": "flow_shift", "sample_shift": "flow_shift",
    "sample_solver": "sampler", "scheduler": "sampler",
    "base_seed": "seed", "sample_fps": "fps", "frame_rate": "fps", "num_gpus": "gpus",
    "image_path": "image", "negative": "negative_prompt",
    "lora": "loras", "adapters": "loras", "strength": "scale", "weight": "scale", "lora_scale": "scale",
    "model_path": "model", "pretrained_model_name_or_path": "model", "checkpoint": "model",
}


def _did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    if ALIASES.get(word) in choices:
        return f" (did you mean {ALIASES[word]!r}? {word!r} is another tool's name for it)"
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if not close and len(word) >= 3:  # a truncated name: "tiny" for "tiny-preview"
        close = [c for c in choices if c.startswith(word)][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


# --------------------------------------------------------------------------------------------------
# Presets


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
    reader = _YamlReader(display, problems)
    root = reader.read(text)
    if root is None or not isinstance(root.value, dict):
        problems.append(Problem(SourceLocation(display, root.line if root else 1), "(preset)",
                                f"a preset must be a mapping of job fields ({', '.join(PRESET_FIELDS)})"))
        return None
    values = _fields(root.value, PRESET_KEYS, "", display, problems)
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
        raise LookupError(f"unknown preset {name!r}{_did_you_mean(name, presets)}; "
                          f"allowed: one of {', '.join(presets)}")
    return (_preset_dir() / f"{name}.yaml").read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# Command-line overrides


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
    ``euler`` str); raises _Bad for YAML that is not a plain scalar."""
    if not text.strip():
        return text
    # The checks a value written in a batch file gets from the YAML reader (whose own message for
    # these would be "special characters are not allowed"); the field's rule comes after.
    text = _as_str(text, "a number or a word", non_empty=False, newlines=True)
    loader = _BoundedLoader(text)
    try:
        value = loader.get_single_data()
    except _TooDeep:
        raise _Bad(_too_deep()) from None
    except yaml.YAMLError as exc:
        raise _Bad(f"{text!r} is not a plain value ({str(exc).splitlines()[0]})") from None
    except ValueError as exc:
        raise _Bad(_unreadable_number(exc)) from None
    finally:
        loader.dispose()
    if isinstance(value, (dict, list)):
        raise _Bad(f"got {text!r}; a flag value must be a single number or word (no YAML lists or mappings)")
    return value


@dataclass
class _FlagValues:
    """Overrides validated: model, preset and job fields from ``--set``, axes from ``--sweep``."""

    model: str | None = None
    preset: tuple[str, dict[str, Any]] | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    field_flags: dict[str, str] = field(default_factory=dict)  # key -> the --set flag as typed
    axes: dict[str, list[Any]] = field(default_factory=dict)  # key -> values, from --sweep

    @classmethod
    def parse(cls, overrides: Overrides, ctx: _Ctx) -> "_FlagValues":
        out = cls()
        given: dict[str, str] = {}  # key -> the flag that gave it first
        for kind, items, allowed in (("--set", overrides.sets, SET_KEYS), ("--sweep", overrides.sweeps, SWEEP_KEYS)):
            for item in items:
                # As typed, for messages; bytes that were not UTF-8 (lone surrogates) shown escaped.
                flag = f"{kind} {item}".encode("utf-8", "backslashreplace").decode("utf-8")
                key, sep, text = item.partition("=")
                key = key.strip()
                # Flags have no file: their problems are located by the flag as typed (line 0).
                fctx = _Ctx(display=flag, base_dir=Path.cwd(), check_files=ctx.check_files,
                            check_model=ctx.check_model, problems=ctx.problems, lora_sources=ctx.lora_sources)
                if not sep or not key:
                    example = "steps=4" if kind == "--set" else "seed=0,1,2"
                    fctx.problem(0, "(flag)", f"must look like key=value, e.g. {kind} {example}")
                    continue
                if key not in allowed and not (kind == "--sweep" and LORA_SCALE_AXIS.fullmatch(key)):
                    fctx.problem(0, key, f"unknown key {key!r}{_did_you_mean(key, allowed)}; allowed: "
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

    def _set(self, key: str, text: str, fctx: _Ctx) -> None:
        try:
            value = _flag_scalar(text)
        except _Bad as exc:
            fctx.problem(0, key, str(exc))
            return
        node = _Node(value, 0)
        if key == "model":
            self.model = _parse_model(node, fctx)
        elif key == "preset":
            self.preset = _parse_preset(node, fctx)
        else:
            checked = _fields({key: node}, DEFAULTS_KEYS, "", fctx.display, fctx.problems)
            if key in checked:
                try:
                    self.fields[key] = _flag_path(key, checked[key], fctx)
                except _Bad as exc:
                    fctx.problem(0, key, str(exc))
                    return
                self.field_flags[key] = fctx.display

    def _sweep(self, key: str, text: str, fctx: _Ctx) -> None:
        values: list[Any] = []
        for i, part in enumerate(text.split(",")):
            try:
                values.append(_flag_path(key, _sweep_check(key)(_flag_scalar(part.strip())), fctx))
            except _Bad as exc:
                fctx.problem(0, f"{key}[{i}]", str(exc))
        repeated = sorted({repr(v) for v in values if values.count(v) > 1})
        if repeated:
            fctx.problem(0, key, f"values {', '.join(repeated)} appear more than once; each sweep value must "
                                 "be distinct")
        self.axes[key] = values

    def apply_to_sweep(self, sweep: dict[str, list[Any]], node: _Node | None,
                       ctx: _Ctx) -> dict[str, list[Any]]:
        """The file's sweep with --sweep axes added or replacing its own; a --set of a field the
        sweep varies is refused (which value would win is not obvious: --sweep says it)."""
        for key in self.fields:
            if key in sweep and key not in self.axes:
                line = node.value[key].line if node is not None and isinstance(node.value, dict) else 1
                ctx.problem(0, key, f"the batch sweeps {key!r} ({ctx.display}:{line}); to fix it to one "
                                    f"value use --sweep {key}=VALUE, which replaces the axis",
                            self.field_flags[key])
        return {**sweep, **self.axes}


def _flag_path(key: str, value: Any, fctx: _Ctx) -> Any:
    """A path given on the command line is relative to the working folder, not the batch; an image
    gets the checks an image named in the batch gets."""
    if key == "loras":
        return _resolve_loras(value, fctx.base_dir, fctx, SourceLocation(fctx.display, 0), key)
    if key != "image":
        return value
    path = (fctx.base_dir / Path(value).expanduser()).resolve()
    problem = _image_problem(path, relative_to="the folder the command runs in") if fctx.check_files else None
    if problem:
        raise _Bad(problem)
    return str(path)


# --------------------------------------------------------------------------------------------------
# The batch


def _fields(mapping: dict[str, _Node], allowed_keys: tuple[str, ...], prefix: str, display: str,
            problems: list[Problem]) -> dict[str, Any]:
    """Validate every key of one mapping; return the coerced values of the good ones."""
    out: dict[str, Any] = {}
    for key, node in mapping.items():
        where = SourceLocation(display, node.line)
        if key not in allowed_keys:
            hint = _did_you_mean(key, allowed_keys)
            message = f"unknown key {key!r}{hint}; allowed: {', '.join(allowed_keys)}"
            problems.append(Problem(where, prefix + key, message))
            continue
        try:
            out[key] = _CHECKS[key](node.value)
        except _Bad as exc:
            problems.append(Problem(where, prefix + key, str(exc)))
    return out


@dataclass
class _RawJob:
    """One job entry before resolution: its own validated fields and where it was written."""

    fields: dict[str, Any]
    location: SourceLocation
    label: str  # "jobs[2]" or "prompts_file[5]" for messages
    base_dir: Path  # relative image paths resolve against this folder
    lines: dict[str, int]  # field -> line it is written on, for messages


@dataclass
class _Ctx:
    display: str  # the batch path as the user gave it, for messages
    base_dir: Path  # absolute folder of the batch file
    check_files: bool
    check_model: bool = True
    problems: list[Problem] = field(default_factory=list)
    image_hashes: dict[str, str] = field(default_factory=dict)  # per load: an edited image re-hashes
    # Every LoRA file named, with where it was first named and by which field: checked once, after
    # the model is known (`_check_lora_files`), and hashed once.
    lora_sources: dict[str, tuple[SourceLocation, str]] = field(default_factory=dict)
    lora_hashes: dict[str, str] = field(default_factory=dict)

    def problem(self, line: int, fld: str, message: str, display: str | None = None) -> None:
        self.problems.append(Problem(SourceLocation(display or self.display, line), fld, message))


def load_batch(path: str | Path, *, check_files: bool = True, check_model: bool = True,
               overrides: Overrides | None = None, say: Callable[[str], None] | None = None,
               text: str | None = None) -> Batch:
    """Parse, validate and resolve a batch file; raise BatchValidationError listing every problem.

    ``check_model=False`` plans without the checkpoint (dry runs); ``overrides`` are the
    command line's ``--set``/``--sweep``, validated like the file and reported by flag. ``say``
    is told when the checkpoint's weights have to be hashed (a line, before the wait). ``text``:
    the batch's YAML when it is not read from ``path`` (a batch made from a render's own record,
    ``run --from``), which then only names it and anchors relative paths."""
    batch_path = Path(path)
    ctx = _Ctx(display=str(path), base_dir=batch_path.absolute().parent, check_files=check_files,
               check_model=check_model)
    if text is None:
        text = _read_text(batch_path, ctx.display, ctx.problems, what="batch file", limit=LIMITS.batch_bytes)
    root = None if text is None else _YamlReader(ctx.display, ctx.problems).read(text)
    if ctx.problems:
        raise BatchValidationError(ctx.problems)
    if root is None or not isinstance(root.value, dict):
        ctx.problem(root.line if root else 1, "(batch)",
                    "a batch must be a YAML mapping with keys: " + ", ".join(TOP_LEVEL_KEYS))
        raise BatchValidationError(ctx.problems)
    top: dict[str, _Node] = root.value
    for key, node in top.items():
        if key not in TOP_LEVEL_KEYS:
            ctx.problem(node.line, key, f"unknown top-level key {key!r}{_did_you_mean(key, TOP_LEVEL_KEYS)}; "
                                        f"allowed: {', '.join(TOP_LEVEL_KEYS)}")

    flags = _FlagValues.parse(overrides or Overrides(), ctx)
    model = flags.model if flags.model is not None else _parse_model(top.get("model"), ctx)
    preset_name, preset = flags.preset if flags.preset is not None else _parse_preset(top.get("preset"), ctx)
    defaults = _parse_defaults(top.get("defaults"), ctx)
    raw_jobs = _parse_jobs(top.get("jobs"), ctx) + _parse_prompts_file(top.get("prompts_file"), ctx)
    sweep = _parse_sweep(top.get("sweep"), ctx)
    sweep = flags.apply_to_sweep(sweep, top.get("sweep"), ctx)
    defaults_lines = {k: n.line for k, n in top["defaults"].value.items()} if defaults else {}
    for raw in [*raw_jobs, _RawJob(defaults, SourceLocation(ctx.display, 1), "defaults", ctx.base_dir,
                                   defaults_lines)]:
        _resolve_image(raw, ctx)
        if "loras" in raw.fields:
            where = SourceLocation(raw.location.file, raw.lines.get("loras", raw.location.line))
            raw.fields["loras"] = _resolve_loras(raw.fields["loras"], raw.base_dir, ctx, where, raw.label + ".loras")
    _check_lora_files(model, ctx)
    if not raw_jobs and not any(p.field.startswith(("jobs", "prompts_file")) for p in ctx.problems):
        # (a `jobs:` that is not a list, or an unreadable prompts file, is reported already)
        line = (top.get("jobs") or top.get("prompts_file") or root).line
        ctx.problem(line, "jobs", "the batch has no jobs: add a `jobs:` list (each with a `prompt`) "
                                  "or a `prompts_file`")
    _name_jobs(raw_jobs, ctx)
    n_jobs = len(raw_jobs) * math.prod(len(values) for values in sweep.values())
    if n_jobs > LIMITS.jobs:
        where = top.get("sweep") or top.get("jobs") or top.get("prompts_file") or root
        ctx.problem(where.line, "sweep" if sweep else "jobs",
                    f"the batch expands to {n_jobs:,} jobs ({len(raw_jobs)} job(s) x "
                    f"{n_jobs // max(1, len(raw_jobs)):,} sweep combination(s)); allowed: at most {LIMITS.jobs:,} "
                    "jobs in one batch: split it into several batches")
    if ctx.problems:
        raise BatchValidationError(_sorted(ctx))

    weights, weights_files = None, {}
    if model != TINY_MODEL and Path(model).is_dir():
        weights, files = folder_fingerprint(Path(model), say=say)
        weights_files = {rel: {"size": fp.size, "sha256": fp.sha256} for rel, fp in files.items()}
    jobs = _expand(raw_jobs, model=model, weights=weights, preset_name=preset_name, preset=preset,
                   defaults=defaults, sets=flags.fields, sweep=sweep, ctx=ctx)
    _check_cost(jobs, ctx)
    _check_unique(jobs, ctx)
    if ctx.problems:
        raise BatchValidationError(_sorted(ctx))
    return Batch(path=str(batch_path.absolute()), model=model, preset=preset_name, jobs=jobs,
                 weights_files=weights_files, text=text)


def _sorted(ctx: _Ctx) -> list[Problem]:
    # Batch file first, in line order; then other files (prompts file, presets) in line order.
    return sorted(ctx.problems, key=lambda p: (p.location.file != ctx.display, p.location.file, p.location.line))


def _read_text(path: Path, display: str, problems: list[Problem], *, what: str, limit: int,
               location: SourceLocation | None = None, fld: str = "(file)") -> str | None:
    where = location or SourceLocation(display, 1)
    try:
        return read_regular_file(path, limit=limit).decode("utf-8")
    except InputFileError as exc:
        problems.append(Problem(where, fld, f"{what} {str(path)!r} {exc}"))
    except FileNotFoundError:
        problems.append(Problem(where, fld, f"{what} {str(path)!r} does not exist"))
    except IsADirectoryError:
        problems.append(Problem(where, fld, f"{what} {str(path)!r} is a folder, not a file"))
    except UnicodeDecodeError as exc:
        problems.append(Problem(where, fld, f"{what} {str(path)!r} is not UTF-8 text "
                                            f"({exc.reason} at byte {exc.start})"))
    except OSError as exc:
        problems.append(Problem(where, fld, f"cannot read {what} {str(path)!r}: {exc.strerror}"))
    return None


def _parse_model(node: _Node | None, ctx: _Ctx) -> str:
    allowed = ("'tiny' (the embedded toy model) or a checkpoint folder in the diffusers layout (a path of at "
               f"most {LIMITS.path_chars:,} characters)")
    if node is None:
        ctx.problem(1, "model", f"missing; allowed: {allowed}")
        return TINY_MODEL
    if not isinstance(node.value, str) or not node.value.strip():
        ctx.problem(node.line, "model", f"got {node.value!r} ({_type_name(node.value)}); allowed: {allowed}")
        return TINY_MODEL
    if node.value == TINY_MODEL:
        return TINY_MODEL
    try:
        value = _as_path(node.value, allowed)
    except _Bad as exc:
        ctx.problem(node.line, "model", str(exc))
        return TINY_MODEL
    folder = (ctx.base_dir / Path(value).expanduser()).resolve()
    if ctx.check_files and ctx.check_model:
        if not folder.is_dir():
            ctx.problem(node.line, "model", f"checkpoint folder {str(folder)!r} does not exist; allowed: {allowed}")
        elif not (folder / "model_index.json").is_file():
            ctx.problem(node.line, "model", f"{str(folder)!r} has no model_index.json, so it is not a "
                                            f"diffusers checkpoint folder; allowed: {allowed}")
    return str(folder)


PRESET_FILE_SUFFIXES = (".yaml", ".yml")


def _parse_preset(node: _Node | None, ctx: _Ctx) -> tuple[str, dict[str, Any]]:
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
        hint = _did_you_mean(node.value, sorted(presets)) if isinstance(node.value, str) else ""
        ctx.problem(node.line, "preset", f"unknown preset {node.value!r}{hint}; allowed: {allowed}")
        return "", {}
    values = {k: v for k, v in presets[node.value].items() if k != "description"}
    return node.value, values


def _preset_file(node: _Node, ctx: _Ctx) -> tuple[str, dict[str, Any]]:
    try:
        value = _as_path(node.value, "a path to a preset file")
    except _Bad as exc:
        ctx.problem(node.line, "preset", str(exc))
        return "", {}
    path = (ctx.base_dir / Path(value).expanduser()).resolve()
    where = SourceLocation(ctx.display, node.line)
    text = _read_text(path, str(path), ctx.problems, what="preset file", limit=LIMITS.batch_bytes,
                      location=where, fld="preset")
    values = None if text is None else _read_preset(text, str(path), ctx.problems)
    if values is None:
        return "", {}
    return str(path), {k: v for k, v in values.items() if k != "description"}


def _parse_defaults(node: _Node | None, ctx: _Ctx) -> dict[str, Any]:
    if node is None:
        return {}
    if not isinstance(node.value, dict):
        ctx.problem(node.line, "defaults", f"must be a mapping of job fields ({', '.join(DEFAULTS_KEYS)})")
        return {}
    return _fields(node.value, DEFAULTS_KEYS, "defaults.", ctx.display, ctx.problems)


def _parse_jobs(node: _Node | None, ctx: _Ctx) -> list[_RawJob]:
    if node is None:
        return []
    if not isinstance(node.value, list):
        ctx.problem(node.line, "jobs", "must be a list of jobs, each a mapping with at least `prompt`")
        return []
    raw: list[_RawJob] = []
    for i, item in enumerate(node.value):
        label = f"jobs[{i}]"
        where = SourceLocation(ctx.display, item.line)
        if isinstance(item.value, str):  # shorthand: `- a prompt`
            item = _Node({"prompt": _Node(item.value, item.line)}, item.line)
        if not isinstance(item.value, dict):
            ctx.problem(item.line, label, f"got {item.value!r} ({_type_name(item.value)}); allowed: a mapping "
                                          "with `prompt` and optional " + ", ".join(JOB_KEYS[1:]))
            continue
        fields = _fields(item.value, JOB_KEYS, label + ".", ctx.display, ctx.problems)
        if "prompt" not in item.value:
            ctx.problem(item.line, label + ".prompt", "missing; every job needs a non-empty `prompt`")
        # Kept even when broken, so that its name still takes part in the duplicate check.
        raw.append(_RawJob(fields, where, label, ctx.base_dir, {k: n.line for k, n in item.value.items()}))
    return raw


def _parse_prompts_file(node: _Node | None, ctx: _Ctx) -> list[_RawJob]:
    """One prompt a line (blank and ``#`` lines skipped), or ``.jsonl`` rows of job fields."""
    if node is None:
        return []
    allowed = ("a path to a .txt (one prompt a line) or .jsonl (one job object a line) file, relative to "
               f"this batch, of at most {LIMITS.path_chars:,} characters")
    try:
        name = _as_path(node.value, allowed)
    except _Bad as exc:
        ctx.problem(node.line, "prompts_file", str(exc))
        return []
    path = (ctx.base_dir / Path(name).expanduser()).resolve()
    text = _read_text(path, ctx.display, ctx.problems, what="prompts file", limit=LIMITS.prompts_file_bytes,
                      location=SourceLocation(ctx.display, node.line), fld="prompts_file")
    if text is None:
        return []
    # Rows are located in the prompts file as written relative to the batch: "jobs/prompts.txt:3".
    display = str(Path(ctx.display).parent / name)
    raw: list[_RawJob] = []
    is_jsonl = path.suffix.lower() == ".jsonl"
    rows = 0
    # Split on line feeds only, as the YAML reader counts lines: str.splitlines would also break at
    # form feeds and other controls, hiding them from the checks and shifting every later line.
    for lineno, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        label = f"prompts_file[{rows}]"  # the n-th row (0-based) after skipping blanks and comments
        rows += 1
        where = SourceLocation(display, lineno)
        if not is_jsonl:
            # The line is the job's prompt: checked like a prompt written in YAML.
            fields = _fields({"prompt": _Node(stripped, lineno)}, JOB_KEYS, label + ".", display, ctx.problems)
            raw.append(_RawJob(fields, where, label, path.parent, {"prompt": lineno}))
            continue
        row = _json_row(stripped, lineno, label, display, ctx)
        if row is None:
            continue
        if not isinstance(row, dict):
            ctx.problem(lineno, label, f"got {_type_name(row)}; allowed: a JSON object with `prompt` and "
                                       "optional " + ", ".join(JOB_KEYS[1:]), display)
            continue
        fields = _fields({str(k): _Node(v, lineno) for k, v in row.items()}, JOB_KEYS, label + ".", display,
                         ctx.problems)
        if "prompt" not in row:
            ctx.problem(lineno, label + ".prompt", "missing; every row needs a non-empty `prompt`", display)
        raw.append(_RawJob(fields, where, label, path.parent, {k: lineno for k in row}))
    return raw


def _json_row(text: str, lineno: int, label: str, display: str, ctx: _Ctx) -> Any:
    """One line of a .jsonl prompts file parsed, or None with the problem noted (a row that is
    JSON ``null`` is refused as not an object by the caller either way)."""
    example = 'each line of a .jsonl prompts file is one object like {"prompt": "...", "seed": 1}'
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        ctx.problem(lineno, label, f"not valid JSON ({exc.msg} at column {exc.colno}); {example}", display)
        return None
    except RecursionError:  # json's reader recurses once per level
        ctx.problem(lineno, label, _too_deep(), display)
        return None
    except ValueError as exc:  # an integer of more digits than Python converts
        ctx.problem(lineno, label, _unreadable_number(exc), display)
        return None
    if nesting_depth(row) > LIMITS.nesting:
        ctx.problem(lineno, label, _too_deep(), display)
        return None
    return row


def _too_deep() -> str:
    return (f"values nested more than {LIMITS.nesting} levels deep; allowed: at most {LIMITS.nesting} levels of "
            "lists and mappings inside one another")


def _parse_sweep(node: _Node | None, ctx: _Ctx) -> dict[str, list[Any]]:
    if node is None:
        return {}
    if not isinstance(node.value, dict):
        ctx.problem(node.line, "sweep", "must be a mapping field -> list of values, e.g. {seed: [0, 1]}")
        return {}
    sweep: dict[str, list[Any]] = {}
    for key, values in node.value.items():
        fld = f"sweep.{key}"
        if key not in SWEEP_KEYS and not LORA_SCALE_AXIS.fullmatch(key):
            ctx.problem(values.line, fld, f"cannot sweep unknown field {key!r}{_did_you_mean(key, SWEEP_KEYS)}; "
                                          f"allowed: {', '.join(SWEEP_KEYS)}")
            continue
        if not isinstance(values.value, list) or not values.value:
            ctx.problem(values.line, fld, f"got {values.value!r}; allowed: a non-empty list of values, "
                                          f"e.g. {key}: [a, b]")
            continue
        good: list[Any] = []
        for i, item in enumerate(values.value):
            try:
                good.append(_sweep_check(key)(item.value))
            except _Bad as exc:
                ctx.problem(item.line, f"{fld}[{i}]", str(exc))
                continue
            if key == "loras":
                good[-1] = _resolve_loras(good[-1], ctx.base_dir, ctx, SourceLocation(ctx.display, item.line),
                                          f"{fld}[{i}]")
            image = (ctx.base_dir / Path(good[-1]).expanduser()).resolve() if key == "image" else None
            problem = _image_problem(image) if image is not None and ctx.check_files else None
            if problem:
                ctx.problem(item.line, f"{fld}[{i}]", problem)
        repeated = sorted({repr(v) for v in good if good.count(v) > 1})
        if repeated:
            ctx.problem(values.line, fld, f"values {', '.join(repeated)} appear more than once; each sweep value "
                                          "must be distinct")
        sweep[key] = good
    return sweep


def _sweep_check(key: str) -> Callable[[Any], Any]:
    """The check of one sweep value of ``key`` (a job field, or a `LORA_SCALE_AXIS`)."""
    if LORA_SCALE_AXIS.fullmatch(key):
        return lambda v: _check_lora_scale(v, "a number in -{0:g}..{0:g}".format(LIMITS.lora_scale))
    return _CHECKS[key]


def _sweep_label(key: str, value: Any) -> Any:
    """What a job's id, status and report show for one sweep value: adapters by file stem and scale
    (``style@0.5+detail@1``, ``none``), other values as they are."""
    if key == "loras":
        return "+".join(r.label for r in value) or "none"
    return value


def _resolve_loras(refs: tuple[LoraRef, ...], base_dir: Path, ctx: _Ctx, where: SourceLocation,
                   fld: str) -> tuple[LoraRef, ...]:
    """The adapters with absolute paths (against the file that named them), each noted for
    `_check_lora_files` where it was first named."""
    out = []
    for ref in refs:
        path = str((base_dir / Path(ref.path).expanduser()).resolve())
        ctx.lora_sources.setdefault(path, (where, fld))
        out.append(LoraRef(path, ref.scale))
    return tuple(out)


def _model_linears(model: str, ctx: _Ctx) -> dict[str, tuple[int, int]] | None:
    """The DiT's linear layers (name -> (out, in)) from its config.json, to check LoRAs against;
    None when the checkpoint is not to be read (a dry run) or has no readable config."""
    if model == TINY_MODEL:
        return dit_linears(TINY_DIT_CONFIG)
    if not (ctx.check_files and ctx.check_model):
        return None
    folder = Path(model) / "transformer"
    config = folder / "config.json" if folder.is_dir() else Path(model) / "config.json"
    try:
        return dit_linears(json.loads(config.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None  # the model's own load reports it, with the file


def _check_lora_files(model: str, ctx: _Ctx) -> None:
    """Every LoRA named anywhere: a safetensors file within the limits, in a layout we read, whose
    keys and shapes fit the batch's DiT; each problem at the place that first named the file."""
    if not ctx.check_files:
        return
    linears = _model_linears(model, ctx)
    for path, (where, fld) in ctx.lora_sources.items():
        try:
            header = read_header(path, limit=LIMITS.lora_bytes)
            if linears is None:
                detect_layout(list(header.tensors), path)
            else:
                plan_lora(header, linears, name=path)
        except LoraFileError as exc:
            ctx.problems.append(Problem(where, fld, str(exc)))


def _lora_hash(path: str, ctx: _Ctx) -> str | None:
    if path not in ctx.lora_hashes and Path(path).is_file():
        ctx.lora_hashes[path] = sha256_file(path)
    return ctx.lora_hashes.get(path)


def _apply_lora_scales(merged: dict[str, Any], combo: dict[str, Any], raw: _RawJob, ctx: _Ctx) -> bool:
    """Put each swept adapter scale (``loras[i].scale``) into the job's adapters; False (a problem
    noted once per job) when the job has no adapter ``i``."""
    for key, scale in combo.items():
        match = LORA_SCALE_AXIS.fullmatch(key)
        if match is None:
            continue
        i, loras = int(match[1]), merged["loras"]
        if i >= len(loras):
            problem = Problem(SourceLocation(raw.location.file, raw.lines.get("loras", raw.location.line)),
                              f"{raw.label}.loras", f"the sweep varies {key} but this job has {len(loras)} "
                              f"adapter(s); give it loras[{i}] (in the job or the defaults) or drop the axis")
            if problem not in ctx.problems:
                ctx.problems.append(problem)
            return False
        merged["loras"] = (*loras[:i], LoraRef(loras[i].path, scale), *loras[i + 1:])
    return True


def _resolve_image(raw: _RawJob, ctx: _Ctx) -> None:
    """Make ``image`` absolute (against the file that named it) and check it exists."""
    image = raw.fields.get("image")
    if image is None:
        return
    path = (raw.base_dir / Path(image).expanduser()).resolve()
    raw.fields["image"] = str(path)
    problem = _image_problem(path) if ctx.check_files else None
    if problem:
        ctx.problem(raw.lines.get("image", raw.location.line), raw.label + ".image", problem, raw.location.file)


def _image_problem(path: Path, *, relative_to: str = "the file that names it") -> str | None:
    """None if ``path`` is a PNG/JPEG/WebP file within the size and pixel limits, else why not."""
    allowed = (f"a PNG, JPEG or WebP file of at most {LIMITS.image_bytes >> 20} MiB and "
               f"{LIMITS.image_pixels:,} pixels, relative to {relative_to}")
    try:
        data = read_regular_file(path, limit=LIMITS.image_bytes)
        width, height = image_size(data)
    except FileNotFoundError:
        return f"image {str(path)!r} does not exist; allowed: {allowed}"
    except InputFileError as exc:
        return f"image {str(path)!r} {exc}; allowed: {allowed}"
    except OSError as exc:
        return f"cannot read image {str(path)!r}: {exc.strerror}; allowed: {allowed}"
    if width * height > LIMITS.image_pixels:
        return (f"image {str(path)!r} is {width}x{height} = {width * height:,} pixels (decoding it needs "
                f"{width * height * 3 / 2**30:.1f} GiB); allowed: {allowed}")
    return None


def _derived_name(prompt: str) -> str:
    words = re.findall(r"[a-z0-9]+", prompt.lower())[:6]
    return "-".join(words)[:48].strip("-") or "job"


def _name_jobs(raw_jobs: list[_RawJob], ctx: _Ctx) -> None:
    """Check given names are unique; name the rest after their prompt, unique in file order."""
    seen: dict[str, SourceLocation] = {}
    for raw in raw_jobs:
        name = raw.fields.get("name")
        if name is None:
            continue
        line = raw.lines.get("name", raw.location.line)
        if name in seen:
            ctx.problem(line, raw.label + ".name",
                        f"duplicate job name {name!r} (first used at {seen[name]}); job names must be unique",
                        raw.location.file)
        else:
            seen[name] = SourceLocation(raw.location.file, line)
    taken = set(seen)
    for raw in raw_jobs:
        if "name" in raw.fields or "prompt" not in raw.fields:
            continue
        base = _derived_name(raw.fields["prompt"])
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name)
        raw.fields["name"] = name


def _expand(raw_jobs: list[_RawJob], *, model: str, weights: str | None, preset_name: str, preset: dict[str, Any],
            defaults: dict[str, Any], sets: dict[str, Any], sweep: dict[str, list[Any]],
            ctx: _Ctx) -> list[JobSpec]:
    """Resolve every job under every sweep combination:
    built-in < preset < defaults < job < --set < sweep (from the file or --sweep)."""
    keys = list(sweep)
    combos = [dict(zip(keys, values)) for values in itertools.product(*(sweep[k] for k in keys))]
    jobs: list[JobSpec] = []
    for raw in raw_jobs:
        for combo in combos:  # [{}] when there is no sweep
            merged = {**BUILTIN_DEFAULTS, **preset, **defaults, **raw.fields, **sets, **combo}
            if not _apply_lora_scales(merged, combo, raw, ctx):
                continue
            if "image" in combo and combo["image"] is not None:
                merged["image"] = str((ctx.base_dir / Path(combo["image"]).expanduser()).resolve())
            image = merged["image"]
            if image is not None and image not in ctx.image_hashes and Path(image).is_file():
                ctx.image_hashes[image] = sha256_file(image)
            image_sha = None if image is None else ctx.image_hashes.get(image)
            if not _check_sampling(merged, raw, {**defaults, **raw.fields, **combo}, ctx):
                continue
            jobs.append(JobSpec(
                **{k: merged[k] for k in JOB_KEYS if k != "image"}, image=image, image_sha256=image_sha,
                lora_digests=tuple((_lora_hash(r.path, ctx), r.scale) for r in merged["loras"]),
                model=model, preset=preset_name, weights=weights,
                sweep={k: _sweep_label(k, v) for k, v in combo.items()}, source=raw.location,
            ))
    return jobs


def _check_cost(jobs: list[JobSpec], ctx: _Ctx) -> None:
    """One job's video must fit what the DiT and the VAE can hold (see InputLimits.dit_tokens)."""
    seen: set[tuple[str, int, int, int]] = set()
    for job in jobs:
        assert job.source is not None
        key = (str(job.source), job.frames, job.height, job.width)
        tokens = dit_tokens(frames=job.frames, height=job.height, width=job.width)
        if tokens <= LIMITS.dit_tokens or key in seen:
            continue
        seen.add(key)
        ctx.problem(job.source.line, "frames x height x width",
                    f"job {_describe(job)} asks for {job.frames} frames of {job.width}x{job.height} = "
                    f"{tokens:,} DiT tokens; allowed: at most {LIMITS.dit_tokens:,} tokens (e.g. 241 frames at "
                    "1088x1920): the DiT attends over all of them at once and the VAE decodes every pixel, so "
                    "more runs a GPU out of memory; lower frames, width or height", job.source.file)


def _check_sampling(merged: dict[str, Any], raw: _RawJob, explicit: dict[str, Any], ctx: _Ctx) -> bool:
    """The sampler/timesteps/guidance rules of one resolved job; with dmd timesteps, ``steps`` becomes
    their number (an explicit, different ``steps`` is a problem). False if the job is invalid."""
    problems = combination_problems(sampler=merged["sampler"], timesteps=merged["timesteps"],
                                    guidance=merged["guidance"])
    problems += lane_problems(sampler=merged["sampler"], cache=merged["cache"])
    if merged["sampler"] == DMD and merged["timesteps"] is not None:
        count = len(merged["timesteps"])
        if "steps" in explicit and explicit["steps"] != count:
            problems.append(("steps", f"got {explicit['steps']} but the job lists {count} timesteps; with "
                                      "sampler dmd the step count is the number of timesteps: drop steps"))
        merged["steps"] = count
    for fld, message in problems:
        problem = Problem(SourceLocation(raw.location.file, raw.lines.get(fld, raw.location.line)),
                          f"{raw.label}.{fld}", message)
        if problem not in ctx.problems:  # once per job, not once per sweep combination
            ctx.problems.append(problem)
    return not problems


def _describe(job: JobSpec) -> str:
    sweep = "".join(f" {k}={v}" for k, v in job.sweep.items())
    return f"{job.name!r}{' with' + sweep if sweep else ''}"


def _check_unique(jobs: list[JobSpec], ctx: _Ctx) -> None:
    """Two resolved jobs that would render the same video (or share an id) are a mistake."""
    by_render: dict[tuple[str, int], JobSpec] = {}
    by_id: dict[str, JobSpec] = {}
    for job in jobs:
        assert job.source is not None
        key = (job.spec_hash, job.gpus)
        if key in by_render:
            first = by_render[key]
            ctx.problem(job.source.line, "jobs",
                        f"job {_describe(job)} resolves to exactly the same render as job {_describe(first)} "
                        f"({first.source}); remove one or change its prompt, seed or settings",
                        job.source.file)
            continue
        by_render[key] = job
        if job.job_id in by_id:
            other = by_id[job.job_id].source
            ctx.problem(job.source.line, "jobs", f"job id {job.job_id!r} is used twice (also {other}); "
                                                 "rename one of the jobs", job.source.file)
        by_id[job.job_id] = job
