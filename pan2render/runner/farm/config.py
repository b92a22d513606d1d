"""The farm's settings (:class:`FarmConfig`): its folder, its address, how long idle groups stay
warm and when a faulty one is held out; what it shares with `run` is its ``serving`` config.
Light to import: `farm start` reads its flags from here."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from pan2render.runner.serve.config import ServingConfig, check_settings, setting

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

    def __post_init__(self) -> None:
        check_settings(self)

    def scheduler_config(self) -> ServingConfig:
        """What the scheduler is given: a farm waits for lost GPUs however long it takes (a lost
        GCS ends it: Ray cannot go on without one) and answers its API between short passes."""
        return replace(self.serving, poll_s=self.poll_s, progress=False, cluster_wait_s=float("inf"))


# The settings `farm start` takes as flags, its own and the serving ones.
FARM_SETTINGS = ("host", "port", "idle_release_s", "device_fault_limit")
FARM_SERVING_SETTINGS = ("retries", "group_start_timeout_s", "stall_timeout_s")
