"""Field rules: a value as written (in YAML, a JSON row or a flag) -> its field's typed value.

Each field's check comes from its rule in the schema (``jobs/spec.py``: kind, bounds, step,
choices). A value that breaks it raises :class:`BadValue` saying what is allowed (and the nearest
valid value); an unknown key gets a did-you-mean, from the close spellings or from :data:`ALIASES`
(other tools' names for our fields). :func:`coerce_fields` checks every key of one mapping.
"""

from __future__ import annotations

import collections
import difflib
import functools
import math
import re
from typing import Any, Callable

from pan2render.jobs.inputs import (
    BIDI_CONTROLS,
    LIMITS,
    bidi_controls,
    control_chars,
    describe_char,
    join_surrogate_pairs,
    lone_surrogate,
)
from pan2render.jobs.spec import DEFAULTS_KEYS, RULES, Kind, LoraRef, Problem, Rule, Scope, SourceLocation
from pan2render.jobs.yaml_reader import Node
from pan2render.sampling import DEFAULT_NUM_TRAIN_TIMESTEPS, is_int, timesteps_problem

# What a sweep may vary (in the batch or by --sweep): any field `defaults` may set, or an adapter's scale.
SWEEP_KEYS = DEFAULTS_KEYS
# A sweep over one adapter's scale: `loras[0].scale: [0.25, 0.5, 1.0]` (the job's own first LoRA).
LORA_SCALE_AXIS = re.compile(r"loras\[(\d+)\]\.scale")


class BadValue(Exception):
    """A value broke its field's rule; the message says what is allowed."""


def type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool; YAML reads yes/no/on/off/true/false as booleans"
    return "null" if value is None else type(value).__name__


def _as_int(value: Any, allowed: str) -> int:
    if not is_int(value):  # YAML `yes` is a bool, not 1
        raise BadValue(f"got {value!r} ({type_name(value)}); allowed: {allowed}")
    return value


def _as_float(value: Any, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadValue(f"got {value!r} ({type_name(value)}); allowed: {allowed}")
    try:
        number = float(value)  # 5 and 5.0 must hash alike
    except OverflowError:  # an integer past float's range
        raise BadValue(f"got an integer of {len(str(abs(value)))} digits; allowed: {allowed}") from None
    if not math.isfinite(number):
        raise BadValue(f"got {value!r} ({type_name(value)}); allowed: {allowed}")
    return number


def as_str(value: Any, allowed: str, *, non_empty: bool, newlines: bool = False,
           max_chars: int | None = None) -> str:
    if not isinstance(value, str):
        raise BadValue(f"got {value!r} ({type_name(value)}); allowed: {allowed}")
    value = join_surrogate_pairs(value)
    lone = lone_surrogate(value)
    if lone is not None:
        raise BadValue(f"holds a lone surrogate {describe_char(value[lone])} at position {lone} (half of a UTF-16 "
                       f"pair, e.g. an unpaired \\u escape); allowed: {allowed}, in valid Unicode")
    if max_chars is not None and len(value) > max_chars:
        raise BadValue(f"is {len(value):,} characters long; allowed: {allowed}")
    if non_empty and not value.strip():
        raise BadValue(f"is empty; allowed: {allowed}")
    bad = control_chars(value, newlines=newlines)
    if bad:
        where, char = bad[0]
        raise BadValue(f"holds the control character {describe_char(char)} at position {where}; allowed: {allowed} "
                       f"without control characters{' (tabs and line breaks are fine)' if newlines else ''}")
    bidi = bidi_controls(value)
    if bidi:
        where, char = bidi[0]
        raise BadValue(f"holds the bidirectional control {describe_char(char)} at position {where}, which changes "
                       f"how the text around it is shown (a name can show as another); allowed: {allowed} without "
                       f"bidirectional controls ({BIDI_CONTROLS})")
    return value


def as_path(value: Any, allowed: str) -> str:
    """A path as the batch or a flag names it (model folder, prompts file): one line, bounded."""
    return as_str(value, allowed, non_empty=True, max_chars=LIMITS.path_chars)


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
        raise BadValue(f"got {x} (nearest: {_nearest(x, rule)}); allowed: {allowed}")
    if low or (rule.max is not None and x > rule.max):
        raise BadValue(f"got {x}; allowed: {allowed}")
    return x


def _check_choice(rule: Rule, v: Any) -> Any:
    allowed = rule.allowed_text()
    x = _as_int(v, allowed) if is_int(rule.choices[0]) else as_str(v, allowed, non_empty=True)
    if x not in rule.choices:
        hint = did_you_mean(str(x), [str(c) for c in rule.choices])
        raise BadValue(f"got {x!r}{hint}; allowed: {allowed}")
    return x


def _check_timesteps(v: Any) -> tuple[int, ...]:
    # Checked against the usual T here; the sampler checks the checkpoint's own T when it loads.
    items = [n.value if isinstance(n, Node) else n for n in v] if isinstance(v, list) else v
    problem = timesteps_problem(items, num_train_timesteps=DEFAULT_NUM_TRAIN_TIMESTEPS)
    if problem is not None:
        raise BadValue(problem + " (for sampler dmd)")
    return tuple(items)


def _plain(v: Any) -> Any:
    return v.value if isinstance(v, Node) else v


def _check_lora_scale(v: Any, allowed: str) -> float:
    scale = _as_float(v, allowed)
    if abs(scale) > LIMITS.lora_scale:
        raise BadValue(f"scale {scale:g} is out of range; allowed: {allowed}")
    return scale


def _check_loras(v: Any) -> tuple[LoraRef, ...]:
    """A list of adapters, each a path or ``{path, scale}``; a lone path is one adapter at scale 1
    (what a flag gives: ``--set loras=style.safetensors``). Paths are resolved later, against the
    file that names them."""
    allowed = RULES["loras"].allowed_text()
    v = _plain(v)
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise BadValue(f"got {v!r} ({type_name(v)}); allowed: {allowed}")
    if len(items) > LIMITS.loras:
        raise BadValue(f"lists {len(items)} adapters; allowed: {allowed}")
    refs: list[LoraRef] = []
    for i, node in enumerate(items):
        item = _plain(node)
        fields = {str(k): _plain(n) for k, n in item.items()} if isinstance(item, dict) else {"path": item}
        unknown = [k for k in fields if k not in ("path", "scale")]
        if unknown:
            raise BadValue(f"[{i}]: unknown key {unknown[0]!r}{did_you_mean(unknown[0], ('path', 'scale'))}; allowed: "
                           f"{allowed}")
        if "path" not in fields:
            raise BadValue(f"[{i}]: no path; allowed: {allowed}")
        try:
            refs.append(LoraRef(as_path(fields["path"], allowed),
                                _check_lora_scale(fields.get("scale", 1.0), allowed)))
        except BadValue as exc:
            raise BadValue(f"[{i}]: {exc}") from None
    paths = [r.path for r in refs]
    repeated = sorted({p for p in paths if paths.count(p) > 1})
    if repeated:
        raise BadValue(f"lists {repeated[0]!r} more than once; give it once, with the scale you want")
    return tuple(refs)


def _check_prompts(rule: Rule, v: Any) -> tuple[str, ...]:
    """A story's prompts: a list of texts, each checked as a prompt is."""
    allowed = rule.allowed_text()
    items = [_plain(n) for n in v] if isinstance(v, list) else None
    if items is None or not rule.min <= len(items) <= rule.max:  # type: ignore[operator]
        what = f"{len(items)} prompt(s)" if items is not None else f"{v!r} ({type_name(_plain(v))})"
        raise BadValue(f"got {what}; allowed: {allowed}")
    out = []
    for i, text in enumerate(items):
        try:
            out.append(as_str(text, allowed, non_empty=True, newlines=True, max_chars=rule.max_chars))
        except BadValue as exc:
            raise BadValue(f"[{i}] {exc}") from None
    return tuple(out)


def _check_names(rule: Rule, v: Any) -> tuple[str, ...]:
    """Job names (``after``): one name, or a list of distinct names, each checked as a job's
    ``name`` is; which jobs they name is the batch's to check (``jobs/after.py``)."""
    allowed = rule.allowed_text()
    v = _plain(v)
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise BadValue(f"got {v!r} ({type_name(v)}); allowed: {allowed}")
    names = []
    for i, node in enumerate(items):
        try:
            names.append(as_str(_plain(node), allowed, non_empty=True, max_chars=rule.max_chars))
        except BadValue as exc:
            raise BadValue(f"[{i}]: {exc}") from None
    if twice := repeated(names):
        raise BadValue(f"names {', '.join(twice)} more than once; allowed: {allowed}")
    return tuple(names)


def _checker(rule: Rule) -> Callable[[Any], Any]:
    """The check of one field's values, from its rule in the schema (``JobSpec``)."""
    kind = rule.kind
    if kind in (Kind.TEXT, Kind.LINE, Kind.PATH):
        return lambda v: as_str(v, rule.allowed_text(), non_empty=not rule.empty_ok, newlines=kind is Kind.TEXT,
                                max_chars=rule.max_chars)
    if kind is Kind.CHOICE:
        return functools.partial(_check_choice, rule)
    if kind is Kind.TIMESTEPS:
        return _check_timesteps
    if kind is Kind.LORAS:
        return _check_loras
    if kind is Kind.PROMPTS:
        return functools.partial(_check_prompts, rule)
    if kind is Kind.NAMES:
        return functools.partial(_check_names, rule)
    assert kind in (Kind.INT, Kind.FLOAT), kind
    return functools.partial(_check_number, rule)


_CHECKS: dict[str, Callable[[Any], Any]] = {
    **{name: _checker(rule) for name, rule in RULES.items() if rule.scope is not Scope.NOWHERE},
    "description": lambda v: as_str(v, "a string", non_empty=False, newlines=True,  # a preset's own
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


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    if ALIASES.get(word) in choices:
        return f" (did you mean {ALIASES[word]!r}? {word!r} is another tool's name for it)"
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if not close and len(word) >= 3:  # a truncated name: "tiny" for "tiny-preview"
        close = [c for c in choices if c.startswith(word)][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


def coerce_fields(mapping: dict[str, Node], allowed_keys: tuple[str, ...], prefix: str, display: str,
                  problems: list[Problem]) -> dict[str, Any]:
    """Validate every key of one mapping; return the coerced values of the good ones."""
    out: dict[str, Any] = {}
    for key, node in mapping.items():
        where = SourceLocation(display, node.line)
        if key not in allowed_keys:
            hint = did_you_mean(key, allowed_keys)
            message = f"unknown key {key!r}{hint}; allowed: {', '.join(allowed_keys)}"
            problems.append(Problem(where, prefix + key, message))
            continue
        try:
            out[key] = _CHECKS[key](node.value)
        except BadValue as exc:
            problems.append(Problem(where, prefix + key, str(exc)))
    return out


def repeated(values: list[Any]) -> list[str]:
    """The values given more than once in one sweep axis, as written in its message (sorted reprs).
    Counted once (every checked sweep value is hashable): a count per value was quadratic in a
    long axis."""
    counts = collections.Counter(values)
    return sorted({repr(v) for v in values if counts[v] > 1})


def sweep_check(key: str) -> Callable[[Any], Any]:
    """The check of one sweep value of ``key`` (a job field, or a `LORA_SCALE_AXIS`)."""
    if LORA_SCALE_AXIS.fullmatch(key):
        return lambda v: _check_lora_scale(v, "a number in -{0:g}..{0:g}".format(LIMITS.lora_scale))
    return _CHECKS[key]
