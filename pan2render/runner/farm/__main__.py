"""``python -m pan2render.runner.farm``: the farm process, as ``farm start`` runs it: one per
folder (its lock), its log in ``ROOT/farm.log``, its address in ``ROOT/farm.json`` while it is up,
stopped cleanly by SIGTERM, SIGINT or SIGHUP."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from pan2render.jobs.ledger import FolderLock
from pan2render.runner.cluster.choose import make_executor
from pan2render.runner.cluster.leftovers import RECORD_NAME as CLUSTER_RECORD_NAME
from pan2render.runner.farm.api import start_api
from pan2render.runner.farm.config import FARM_SERVING_SETTINGS, FARM_SETTINGS, FarmConfig
from pan2render.runner.farm.service import INFO_NAME, LOG_NAME, Farm, ensure_token
from pan2render.runner.protocol.artifacts import write_atomic
from pan2render.runner.serve.config import ServingConfig, add_setting_args, settings_from_args


def write_info(root: Path, info: dict[str, Any]) -> None:
    write_atomic(root / INFO_NAME, (json.dumps(info, indent=1) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    """The farm process (``python -m pan2render.runner.farm``), started by ``farm start``."""
    p = argparse.ArgumentParser(prog="python -m pan2render.runner.farm")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--address")
    p.add_argument("--cpu-gpus", type=int)
    add_setting_args(p, FarmConfig, FARM_SETTINGS)
    add_setting_args(p, ServingConfig, FARM_SERVING_SETTINGS)
    args = p.parse_args(argv)
    root: Path = args.root
    lock = FolderLock(root)
    lock.acquire()  # one farm per folder; the kernel drops it when this process dies
    logf = open(root / LOG_NAME, "a", encoding="utf-8")  # the farm's whole life

    def log(text: str) -> None:
        logf.write(time.strftime("%Y-%m-%dT%H:%M:%SZ ", time.gmtime()) + text + "\n")
        logf.flush()

    try:
        config = settings_from_args(FarmConfig, args, root=root, serving=settings_from_args(ServingConfig, args))
        token = ensure_token(root)
        # ROOT/ray-cluster.json: the processes of the farm's local Ray cluster, which the next farm
        # started here ends should this one be killed (its Ray agents outlive it by minutes).
        executor = make_executor(address=args.address, cpu_gpus=args.cpu_gpus, max_gpus=args.cpu_gpus or 1, say=log,
                                 cluster_record=root / CLUSTER_RECORD_NAME)
        farm = Farm(config, executor, log=log)
        api = start_api(farm, token=token, host=config.host, port=config.port)
        farm.url = api.url
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, lambda *_: farm.stop())
        write_info(root, {"pid": os.getpid(), "host": socket.gethostname(), "url": api.url, "root": str(root),
                          "started_at": farm.started_at, "cluster": executor.cluster})
        log(f"farm up at {api.url} on {executor.cluster} ({executor.total_gpus()} GPU(s)), pid {os.getpid()}")
        try:
            farm.run()
        finally:
            api.stop()
            executor.shutdown()
            (root / INFO_NAME).unlink(missing_ok=True)
            log("farm stopped")
        return 0
    except BaseException:
        log("farm failed:\n" + traceback.format_exc())
        raise
    finally:
        logf.close()
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
