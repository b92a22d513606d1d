"""How the scheduler serves batches: :class:`ServingConfig`, one config for `run`, `resume` and the
farm, each setting's default, bound and command-line flag declared once, where the field is.

The commands build their flags from the fields (:func:`add_setting_args`) and the config from the
parsed flags (:func:`settings_from_args`), so `run --help`, `farm start --help` and the scheduler
can never disagree on a default, and a bad value is refused with its flag's name before anything
is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pan2render.runner.protocol.messages import JOB_CALLS, default_call_timeouts


@dataclass(frozen=True)
class Setting:
    """A setting's command-line face: its flag, the help line (the default is added to it), what
    is allowed, and the check of a value."""

    flag: str
    metavar: str
    help: str
    allowed: str  # said when a value is refused, after "must be"
    check: Callable[[Any], bool]


def setting(default: Any, *, flag: str, metavar: str, help: str, allowed: str,
            check: Callable[[Any], bool]) -> Any:
    """A config field with a command-line flag."""
    return field(default=default, metadata={"setting": Setting(flag, metavar, help, allowed, check)})


class SettingError(ValueError):
    """A setting refused: names the flag (or field), the value and what is allowed."""


def _non_negative(v: float) -> bool:
    return v >= 0


def _positive(v: float) -> bool:
    return v > 0 and not math.isnan(v)


@dataclass(frozen=True)
class ServingConfig:
    """What every batch served by the scheduler shares, whichever command serves it."""

    retries: int = setting(2, flag="--retries", metavar="N", help="retries per job after its first attempt "
                           "(resume grants a fresh budget)", allowed=">= 0", check=_non_negative)
    group_start_timeout_s: float = setting(
        300.0, flag="--group-start-timeout", metavar="S",
        help="seconds a GPU group may take to start (its placement group to be granted, its actors to join) "
             "before the job it was for is charged an attempt (raise it on a shared cluster whose GPUs are often "
             "held by others)", allowed="> 0 seconds", check=_positive)
    cluster_wait_s: float = setting(
        300.0, flag="--cluster-wait", metavar="S",
        help="seconds to wait for GPUs to come back after the cluster lost them (a node died) before the batch "
             "stops, its jobs pending and uncharged", allowed=">= 0 seconds", check=_non_negative)
    # A step of a 720p sampling takes ~1.6 s on an H200 (docs/performance.md, "DiT fused kernels").
    stall_timeout_s: float = setting(
        600.0, flag="--stall-timeout", metavar="S",
        help="seconds a sampling may go without finishing a step before its workers count as hung: they are "
             "restarted and the job retried (0: never)", allowed=">= 0 seconds (0: no watchdog)",
        check=_non_negative)
    # The longest a pass of the loop waits for a reply before it looks at deadlines and progress
    # (the farm's loop waits less: it also answers its API between passes).
    poll_s: float = 0.5
    # Per-call deadlines, by each call type's timeout_key (defaults: protocol/messages.py); a call
    # past its deadline is treated as a dead group.
    call_timeouts_s: dict[str, float] = field(default_factory=default_call_timeouts)
    progress: bool = True  # a live block on stderr when it is a terminal (else plain lines)
    # Times a job's artifact may be redone in one run because it failed its check (corrupt on
    # disk, or freshly written and rejected) before the job fails with the check's reason.
    max_redos: int = 2

    def __post_init__(self) -> None:
        check_settings(self)
        if self.max_redos < 0:
            raise SettingError(f"max_redos={self.max_redos}: must be >= 0")
        if not self.poll_s > 0:
            raise SettingError(f"poll_s={self.poll_s}: must be > 0")
        missing = {c.timeout_key for c in JOB_CALLS} - set(self.call_timeouts_s)
        if missing:
            raise SettingError(f"call_timeouts_s lacks {sorted(missing)}")


# The settings `run` and `resume` take as flags (the farm's: farm/service.py, FARM_SETTINGS).
RUN_SETTINGS = ("retries", "group_start_timeout_s", "cluster_wait_s", "stall_timeout_s")


# ---------------------------------------------------------------------- the command-line face
C = TypeVar("C")


def settings_of(cls: type) -> dict[str, Setting]:
    """Field name -> its Setting, for the fields of ``cls`` that have a flag."""
    return {f.name: f.metadata["setting"] for f in dataclasses.fields(cls) if "setting" in f.metadata}


def check_settings(config: Any) -> None:
    """Raise SettingError naming the flag of the first setting of ``config`` its check refuses."""
    for name, s in settings_of(type(config)).items():
        value = getattr(config, name)
        if not s.check(value):
            raise SettingError(f"{s.flag} {value}: must be {s.allowed}")


def default_of(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def add_setting_args(parser: argparse.ArgumentParser, cls: type, names: Iterable[str]) -> None:
    """One flag per named field of ``cls``, its default the field's, said in its help line."""
    declared = settings_of(cls)
    for name in names:
        s = declared[name]
        default = default_of(cls, name)
        parser.add_argument(s.flag, dest=name, type=type(default), default=default, metavar=s.metavar,
                            help=f"{s.help} (default {_shown(default)})")


def settings_from_args(cls: type[C], args: argparse.Namespace, **fixed: Any) -> C:
    """``cls`` built from the flags :func:`add_setting_args` added to ``args`` (those it has),
    plus ``fixed``. Raises SettingError naming the flag of a refused value."""
    given = {name: getattr(args, name) for name in settings_of(cls) if hasattr(args, name)}
    return cls(**given, **fixed)


def setting_flags(config: Any, names: Iterable[str]) -> list[str]:
    """The flags that give another process the same settings (the farm's process is started so)."""
    declared = settings_of(type(config))
    return [x for name in names for x in (declared[name].flag, str(getattr(config, name)))]


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
