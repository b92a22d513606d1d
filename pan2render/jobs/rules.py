"""The schema's vocabulary: what a ``JobSpec`` field's :class:`Rule` says about it (where a batch
may set it, its kind and bounds, whether it changes the video), and the helpers that attach a rule
to a dataclass field. ``jobs/spec.py`` declares the fields with them; ``jobs/coerce.py`` checks
values by them.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class Scope(enum.Enum):
    """Where a batch may set a field (each wider scope includes the narrower ones)."""

    NOWHERE = "resolved by the batch"  # model, preset, image hash, weights, bookkeeping
    JOB = "a job only"  # identifies one job: prompt, name
    DEFAULTS = "anywhere but a preset"  # a job, defaults, --set, sweep: paths have no folder in a preset, seeds vary
    PRESET = "anywhere"  # a preset too


class Kind(enum.Enum):
    """The kind of value a batch gives a field; ``jobs.coerce`` checks each kind one way."""

    TEXT = "text"  # a string; line breaks allowed
    LINE = "line"  # a one-line string
    PATH = "path"  # a file path, relative to the file that names it
    INT = "int"
    FLOAT = "float"  # ints are read as floats (5 and 5.0 hash alike)
    CHOICE = "choice"  # one of ``choices``
    TIMESTEPS = "timesteps"  # a DMD timestep list (pan2render.sampling.timesteps_problem)
    LORAS = "loras"  # a list of LoRA adapters, each a path (relative to the file) and a scale
    PROMPTS = "prompts"  # a list of texts, one per chained segment
    NAMES = "names"  # job names of the same batch: one, or a list of them


FIELD_DEFAULT: Any = type("FieldDefault", (), {"__repr__": lambda self: "FIELD_DEFAULT"})()


@dataclass(frozen=True)
class Rule:
    """What the schema says about one ``JobSpec`` field (its ``dataclasses.field`` metadata).

    The field's default, if it has one, is the dataclass default: a batch that sets the field
    nowhere gets it. A settable field without one must come from the preset (or the job).
    """

    help: str  # what the field does, one line (the README's field table)
    pixels: bool  # changes the rendered video: hashed into the job id
    scope: Scope = Scope.NOWHERE
    kind: Kind | None = None
    # The phrase after "allowed:" in messages and in the README, formatted with this rule's min,
    # max, step and choices (so each bound is written once).
    allowed: str = ""
    min: float | None = None
    max: float | None = None
    min_open: bool = False  # min itself is not allowed (> rather than >=)
    step: int | None = None  # the value must be offset + k * step ...
    offset: int = 0  # ... and the nearest such values are suggested
    choices: tuple[Any, ...] = ()
    empty_ok: bool = False  # TEXT: the empty string is allowed
    max_chars: int | None = None  # TEXT, LINE, PATH: the longest string allowed
    to_sampler: bool = False  # handed to PAN2Pipeline.sample under its own name
    to_encoder: str | None = None  # handed to media.video.encode_mp4 as this keyword
    # Hashed in every job id since ids were first handed out. A pixel field added since (this is
    # False) counts in the hash only when set away from ``before_field``, so existing jobs keep
    # their ids.
    in_first_ids: bool = False
    # The value every job had before the field existed (FIELD_DEFAULT: the field's default). It
    # differs from the default once the default changes: jobs left at the new default then render
    # another bitstream than before, so they get new ids, and jobs set to the old value keep theirs.
    before_field: Any = FIELD_DEFAULT
    # (field, value): while that other field has that value this one changes nothing (a cache's
    # threshold without a cache), so it is left out of the job id: jobs differing only in it are
    # one render.
    inert_when: tuple[str, Any] | None = None

    def allowed_text(self) -> str:
        return self.allowed.format(min=self.min, max=self.max, step=self.step, max_chars=self.max_chars,
                                   choices=", ".join(str(c) for c in self.choices))

    def first_valid(self) -> float:
        """The smallest value of a stepped integer field (``min`` and ``step`` both given)."""
        assert self.step is not None and self.min is not None
        lo = self.min + 1 if self.min_open else self.min
        return lo + (self.offset - lo) % self.step


def with_rule(rule: Rule, default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING) -> Any:
    if rule.kind is Kind.CHOICE and not rule.allowed:
        rule = dataclasses.replace(rule, allowed="one of {choices}")
    return field(default=default, default_factory=factory, metadata={"rule": rule})


def rule_of(f: dataclasses.Field[Any]) -> Rule:
    return f.metadata["rule"]


def before_field(f: dataclasses.Field[Any]) -> Any:
    """The value a pixel field added after the first ids leaves out of the job id."""
    before = rule_of(f).before_field
    return f.default if before is FIELD_DEFAULT else before
