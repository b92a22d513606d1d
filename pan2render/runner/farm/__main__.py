"""``python -m pan2render.runner.farm``: the farm process, as ``farm start`` runs it: one per
folder (its lock), its log in ``ROOT/farm.log``, its address in ``ROOT/farm.json`` while it is up,
stopped cleanly by SIGTERM, SIGINT or SIGHUP."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import stat
import sys
import time
import traceback
from pathlib import Path
from typing import TextIO

from pan2render.jobs.ledger import FolderLock, FolderLockedError
from pan2render.model_files import folder_problems
from pan2render.runner.cluster.choose import make_executor
from pan2render.runner.cluster.leftovers import RECORD_NAME as CLUSTER_RECORD_NAME
from pan2render.runner.farm.api import start_api
from pan2render.runner.farm.config import (
    FARM_SERVING_SETTINGS,
    FARM_SETTINGS,
    FarmConfig,
    add_folder_and_model_args,
    folder_and_model_settings,
)
from pan2render.runner.farm.folder import INFO_NAME, LOG_NAME, UnsafeRoot, check_root, ensure_token, write_private
from pan2render.runner.farm.intake import Roots
from pan2render.runner.farm.service import Farm
from pan2render.runner.farm.users import Users
from pan2render.runner.serve import errors
from pan2render.runner.serve.config import ServingConfig, SettingError, add_setting_args, settings_from_args

# What the farm's process exits with when it does not start (`farm start` tells them apart).
EXIT_SETTINGS, EXIT_UNSAFE_ROOT, EXIT_ALREADY_RUNNING = 2, 4, 75


def main(argv: list[str] | None = None) -> int:
    """The farm process (``python -m pan2render.runner.farm``), started by ``farm start``."""
    p = argparse.ArgumentParser(prog="python -m pan2render.runner.farm")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--address")
    p.add_argument("--cpu-gpus", type=int)
    add_setting_args(p, FarmConfig, FARM_SETTINGS)
    add_setting_args(p, ServingConfig, FARM_SERVING_SETTINGS)
    add_folder_and_model_args(p)
    args = p.parse_args(argv)
    root: Path = args.root
    try:
        check_root(root)
    except UnsafeRoot as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_UNSAFE_ROOT
    lock = FolderLock(root)
    try:
        lock.acquire()  # one farm per folder; the kernel drops it when this process dies
    except FolderLockedError:
        print(f"a farm is already starting or running in {root}", file=sys.stderr, flush=True)
        return EXIT_ALREADY_RUNNING
    logf = open_log(root)  # the farm's whole life

    def log(text: str) -> None:
        logf.write(time.strftime("%Y-%m-%dT%H:%M:%SZ ", time.gmtime()) + text + "\n")
        logf.flush()

    try:
        config = settings_from_args(FarmConfig, args, root=root, serving=settings_from_args(ServingConfig, args),
                                    **folder_and_model_settings(args))
        if broken := {path: found for _, path in config.models if (found := folder_problems(Path(path)))}:
            raise SettingError(errors.broken_checkpoints(broken, resume=None))
        token = ensure_token(root)
        # ROOT/ray-cluster.json: the processes of the farm's local Ray cluster, which the next farm
        # started here ends should this one be killed (its Ray agents outlive it by minutes).
        executor = make_executor(address=args.address, cpu_gpus=args.cpu_gpus, max_gpus=args.cpu_gpus or 1, say=log,
                                 cluster_record=root / CLUSTER_RECORD_NAME, started_by="farm")
        farm = Farm(config, executor, log=log)
        roots = Roots.of(list(config.inputs_roots), list(config.outputs_roots))
        api = start_api(farm, users=Users(root, admin_token=token), roots=roots, host=config.host, port=config.port,
                        say=log)
        farm.url = api.url
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, lambda *_: farm.stop())
        write_private(root / INFO_NAME, (json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(), "url": api.url, "root": str(root),
            "started_at": farm.started_at, "cluster": executor.cluster}, indent=1) + "\n").encode())
        log(f"farm up at {api.url} on {executor.cluster} ({executor.total_gpus()} GPU(s)), pid {os.getpid()}; "
            f"reads from {', '.join(map(str, roots.inputs))}, writes into {', '.join(map(str, roots.outputs))}")
        try:
            farm.run()
        finally:
            api.stop()
            executor.shutdown()
            (root / INFO_NAME).unlink(missing_ok=True)
            log("farm stopped")
        return 0
    except SettingError as e:
        log(f"farm not started: {e}")
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_SETTINGS
    except BaseException:
        log("farm failed:\n" + traceback.format_exc())
        raise
    finally:
        logf.close()
        lock.release()


def open_log(root: Path) -> TextIO:
    """``ROOT/farm.log`` for appending: never through a link, a regular file only, the owner's."""
    fd = os.open(root / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeRoot(f"{root / LOG_NAME} is not a regular file: remove it")
    return os.fdopen(fd, "a", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
