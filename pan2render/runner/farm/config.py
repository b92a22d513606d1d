"""The farm's settings (:class:`FarmConfig`): its folder, its address, how long idle groups stay
warm and when a faulty one is held out; what it shares with `run` is its ``serving`` config.
Light to import: `farm start` reads its flags from here."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pan2render.runner.serve.config import ServingConfig, SettingError, check_settings, setting
from pan2render.tiny_dit import TINY_MODEL

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a served model's name
FARM_POLL_S = 0.1  # the loop's longest wait for a reply: the API's requests are answered between passes


def _valid_port(port: int) -> bool:
    return 0 <= port <= 65535


@dataclass(frozen=True)
class FarmConfig:
    """The farm's own settings; what it shares with `run` is ``serving``."""

    root: Path
    serving: ServingConfig = field(default_factory=ServingConfig)
    host: str = setting("127.0.0.1", flag="--host", metavar="ADDRESS",
                        help="address the API listens on (127.0.0.1: this machine only; see README, Farm)",
                        allowed="an address", check=bool)
    port: int = setting(0, flag="--port", metavar="PORT", help="the API's port (0: a free one, in ROOT/farm.json)",
                        allowed="a TCP port, 0-65535 (0: any free one)", check=_valid_port)
    idle_release_s: float = setting(600.0, flag="--idle-release", metavar="S",
                                    help="seconds an idle GPU group keeps its GPUs and its loaded model",
                                    allowed="> 0 seconds", check=lambda v: v > 0)
    device_fault_limit: int = setting(3, flag="--device-fault-limit", metavar="N",
                                      help="device faults in a row after which a GPU group is held out of service",
                                      allowed=">= 1", check=lambda v: v >= 1)

    poll_s: float = FARM_POLL_S  # (tests poll faster)
    # The models served by name (``farm start --model NAME=PATH``; ``tiny`` always): what a video
    # request's ``model`` names. The first is the default.
    models: tuple[tuple[str, str], ...] = ()
    # The folders clients' batches may read files from and write into (farm/intake.py); `farm
    # start` gives the folder it runs in when none is named.
    inputs_roots: tuple[Path, ...] = ()
    outputs_roots: tuple[Path, ...] = ()
    # A file holding the token that opens /metrics, /healthz and /readyz alone, for a scraper or a
    # load balancer (``--metrics-token-file``; farm/metrics.py reads and checks it).
    metrics_token_file: Path | None = None

    @property
    def default_model(self) -> str:
        return self.models[0][0] if self.models else TINY_MODEL

    def model_paths(self) -> dict[str, str]:
        return {TINY_MODEL: TINY_MODEL, **dict(self.models)}

    def __post_init__(self) -> None:
        check_settings(self)

    def scheduler_config(self) -> ServingConfig:
        """What the scheduler is given: a farm waits for lost GPUs however long it takes (a lost
        GCS ends it: Ray cannot go on without one) and answers its API between short passes."""
        return replace(self.serving, poll_s=self.poll_s, progress=False, cluster_wait_s=float("inf"))


# The settings `farm start` takes as flags, its own and the serving ones.
FARM_SETTINGS = ("host", "port", "idle_release_s", "device_fault_limit")
FARM_SERVING_SETTINGS = ("retries", "group_start_timeout_s", "stall_timeout_s")


def add_folder_and_model_args(parser: argparse.ArgumentParser) -> None:
    """The farm's flags that are not plain settings: the models it serves by name, its input and output
    roots, the file of its metrics token."""
    parser.add_argument("--model", action="append", default=[], metavar="NAME=PATH", dest="models",
                        help="serve the model folder PATH as NAME to video requests (repeatable; the first is their "
                             "default; 'tiny' is always served)")
    parser.add_argument("--inputs-root", action="append", default=[], type=Path, metavar="DIR", dest="inputs_roots",
                        help="a folder submitted batches may read files from: model folders, images, LoRAs, prompts "
                             "files (repeatable; default: the folder `farm start` runs in)")
    parser.add_argument("--outputs-root", action="append", default=[], type=Path, metavar="DIR", dest="outputs_roots",
                        help="a folder submitted batches may write into (repeatable; default: the folder `farm start` "
                             "runs in)")
    parser.add_argument("--metrics-token-file", type=Path, metavar="PATH",
                        help="a file (yours, readable by you alone) holding a token that opens /metrics, /healthz and "
                             "/readyz and nothing else (default: they need a user's token, except on a loopback farm)")


def folder_and_model_settings(args: argparse.Namespace) -> dict[str, Any]:
    """FarmConfig's list settings from the flags of :func:`add_folder_and_model_args` (relative
    folders made absolute here, in the folder the command runs in); SettingError on a bad one."""
    models = []
    for text in args.models:
        name, sep, path = text.partition("=")
        if not sep or not NAME.fullmatch(name) or not path:
            raise SettingError(f"--model {text!r}: NAME=PATH, NAME of letters, digits, '.', '-' and '_' (at most 64)")
        if name == TINY_MODEL:
            raise SettingError(f"--model {text!r}: 'tiny' is always served as the embedded model")
        models.append((name, str(Path(path).expanduser().absolute())))
    here = [Path.cwd()]
    token_file: Path | None = args.metrics_token_file
    return {"models": tuple(models),
            "inputs_roots": tuple(p.expanduser().absolute() for p in (args.inputs_roots or here)),
            "outputs_roots": tuple(p.expanduser().absolute() for p in (args.outputs_roots or here)),
            "metrics_token_file": None if token_file is None else token_file.expanduser().absolute()}


def folder_and_model_flags(config: FarmConfig) -> list[str]:
    """The flags that give another process the same lists (the farm's process is started so)."""
    return ([x for name, path in config.models for x in ("--model", f"{name}={path}")]
            + [x for p in config.inputs_roots for x in ("--inputs-root", str(p))]
            + [x for p in config.outputs_roots for x in ("--outputs-root", str(p))]
            + ([] if config.metrics_token_file is None else ["--metrics-token-file", str(config.metrics_token_file)]))
