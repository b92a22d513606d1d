"""One serving config: every default `run`, `resume`, `farm start` and `submit` show in their --help
is the config's own, and a bad value is refused naming its flag, before anything is written."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pan2render.runner.farm.config import FARM_SERVING_SETTINGS, FARM_SETTINGS, FarmConfig
from pan2render.runner.serve.config import (
    RUN_SETTINGS,
    ServingConfig,
    SettingError,
    default_of,
    settings_of,
)


def _help(*command: str) -> str:
    env = {**os.environ, "COLUMNS": "400"}  # one line per option: nothing wrapped
    done = subprocess.run([sys.executable, "-m", "pan2render.runner.cli", *command, "--help"], capture_output=True,
                          text=True, env=env, timeout=60, check=True)
    return done.stdout


def _options(help_text: str) -> list[str]:
    """The help's option entries, each one line (argparse puts a long flag's help on the next line)."""
    entries: list[str] = []
    for line in help_text.splitlines():
        if re.match(r"  -", line) or not entries:
            entries.append(line)
        elif line.startswith("    "):
            entries[-1] += " " + line.strip()
    return entries


def _shown_default(help_text: str, flag: str) -> str:
    line = next((e for e in _options(help_text) if re.match(rf"\s*{re.escape(flag)}\b", e)), None)
    assert line is not None, f"{flag} is not in the help:\n{help_text}"
    found = re.search(r"\(default ([^)]+)\)\s*$", line)
    assert found, f"{flag}'s help says no default: {line!r}"
    return found.group(1)


@pytest.mark.parametrize(("command", "settings"), [
    (("run",), [(ServingConfig, n) for n in RUN_SETTINGS]),
    (("resume",), [(ServingConfig, n) for n in RUN_SETTINGS]),
    (("farm",), [(FarmConfig, n) for n in FARM_SETTINGS] + [(ServingConfig, n) for n in FARM_SERVING_SETTINGS]),
    (("submit",), [(ServingConfig, "retries")]),
    (("repair",), [(ServingConfig, "retries")]),
])
def test_every_default_in_the_help_is_the_configs(command: tuple[str, ...], settings: list[tuple[type, str]]) -> None:
    text = _help(*command)
    for cls, name in settings:
        flag = settings_of(cls)[name].flag
        shown = _shown_default(text, flag)
        default = default_of(cls, name)
        assert type(default)(shown) == default, f"{' '.join(command)} {flag}: help says {shown}, config {default}"


def test_a_changed_default_would_show_in_the_help(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the help is built from the field, so the check above can fail."""
    import argparse

    from pan2render.runner.serve import config

    field = next(f for f in dataclasses.fields(ServingConfig) if f.name == "retries")
    monkeypatch.setattr(field, "default", 7)
    p = argparse.ArgumentParser()
    config.add_setting_args(p, ServingConfig, ["retries"])
    assert _shown_default(p.format_help(), "--retries") == "7"


def test_the_farm_and_run_share_one_serving_config() -> None:
    farm = FarmConfig(root=Path("/tmp/farm"))
    assert isinstance(farm.serving, ServingConfig)
    shared = {f.name for f in dataclasses.fields(FarmConfig)} & {f.name for f in dataclasses.fields(ServingConfig)}
    assert shared <= {"poll_s"}, f"FarmConfig repeats serving settings: {shared}"
    sched = farm.scheduler_config()
    assert sched.cluster_wait_s == float("inf") and sched.retries == ServingConfig().retries


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"retries": -1}, "--retries"),
    ({"stall_timeout_s": -1.0}, "--stall-timeout"),
    ({"group_start_timeout_s": 0.0}, "--group-start-timeout"),
    ({"cluster_wait_s": float("nan")}, "--cluster-wait"),
])
def test_a_bad_setting_is_refused_naming_its_flag(kwargs: dict[str, float], flag: str) -> None:
    with pytest.raises(SettingError, match=re.escape(flag)):
        ServingConfig(**kwargs)


def test_run_refuses_a_bad_setting_before_writing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "pan2render.runner.cli", "run", "jobs/quickstart.yaml", "--out",
                           str(out), "--stall-timeout", "-5"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[3])
    assert done.returncode == 2, done.stderr
    assert "--stall-timeout -5.0: must be >= 0 seconds" in done.stderr
    assert not out.exists()
