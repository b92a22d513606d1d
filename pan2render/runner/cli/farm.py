"""The farm's own commands: ``farm start|stop|status|repair`` and ``farm user add|list|remove``.
The commands that queue and act on batches are in ``cli/batches.py``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pan2render.client import FarmClient, default_root, find_farm
from pan2render.hints import command
from pan2render.runner.cli.common import EXIT_ENVIRONMENT, EXIT_FAILED, EXIT_OK, EXIT_USAGE, print_error
from pan2render.runner.farm.config import (
    FARM_SERVING_SETTINGS,
    FARM_SETTINGS,
    FarmConfig,
    add_folder_and_model_args,
    folder_and_model_flags,
    folder_and_model_settings,
)
from pan2render.runner.farm.folder import LOG_NAME, TOKEN_NAME, UnsafeRoot, make_root, read_info
from pan2render.runner.serve.config import (
    ServingConfig,
    SettingError,
    add_setting_args,
    setting_flags,
    settings_from_args,
)

START_TIMEOUT_S = 180.0  # Ray's start, the process's imports: seconds; a busy machine: more
STOP_TIMEOUT_S = 60.0  # a farm puts its running jobs back in their ledgers before it ends
# The farm's process exits so when another holds the folder (farm/__main__.py).
EXIT_ALREADY_RUNNING = 75


def root_arg(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--root", type=Path, default=None, metavar="DIR",
                    help=f"the farm's folder (queue, token, log; default ${{PAN2_RENDER_FARM}} or {default_root()})")


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    f = sub.add_parser("farm", help="a render farm that stays up: one queue of batches, warm GPU groups")
    f.add_argument("action", choices=("start", "stop", "status", "repair", "user"),
                   help="repair: put a damaged farm.sqlite back from its backup (the farm stopped); "
                        "user add|list|remove NAME: the farm's users and their tokens")
    f.add_argument("what", nargs="*", help="user: add NAME, list, remove NAME")
    root_arg(f)
    f.add_argument("--address", help="join this Ray cluster (as `run --address`); default: a local cluster of "
                                     "the farm's own, or the node kept up on this machine")
    f.add_argument("--cpu-gpus", type=int, metavar="N", help="declare N logical GPUs on a CPU-only machine")
    add_setting_args(f, FarmConfig, FARM_SETTINGS)
    add_setting_args(f, ServingConfig, FARM_SERVING_SETTINGS)
    add_folder_and_model_args(f)
    f.add_argument("--json", action="store_true", help="status: the farm's state as JSON")
    f.set_defaults(func=cmd_farm)


def farm_client(root: Path | None) -> FarmClient | None:
    """The farm at ``root`` (default: the default folder), or None with a line saying so."""
    client = find_farm(root)
    if client is None:
        where = default_root() if root is None else root
        start = "pan2-render farm start" + ("" if root is None else f" --root {root}")
        print_error(f"error: no farm answers at {where} (`{start}` starts one)")
    return client


def cmd_farm(args: argparse.Namespace) -> int:
    root: Path = (args.root or default_root()).absolute()
    if args.action != "user" and args.what:
        print_error(f"error: farm {args.action} takes no {' '.join(args.what)!r}")
        return EXIT_USAGE
    if args.action == "start":
        return _start(args, root)
    if args.action == "repair":
        return _repair(root)
    if args.action == "user":
        return _user(root, args.what)
    if args.action == "stop":
        return _stop(root)
    client = find_farm(root)
    if client is None:
        print(f"no farm runs at {root} (`pan2-render farm start --root {root}` starts one)")
        return EXIT_FAILED
    snap = client.status()
    print(json.dumps(snap, indent=1) if args.json else format_status(snap))
    return EXIT_OK


# ====================================================================== start, stop
def _start(args: argparse.Namespace, root: Path) -> int:
    if (client := find_farm(root)) is not None:
        print(f"a farm already runs at {root}: {client.url} (`pan2-render farm stop --root {root}` ends it)")
        return EXIT_OK
    if args.cpu_gpus is not None and args.cpu_gpus < 1:
        print_error(f"error: --cpu-gpus {args.cpu_gpus}: must be >= 1")
        return EXIT_USAGE
    try:
        serving = settings_from_args(ServingConfig, args)
        config = settings_from_args(FarmConfig, args, root=root, serving=serving, **folder_and_model_settings(args))
        if config.metrics_token_file is not None:  # (the farm checks it again: here it is said at once)
            from pan2render.runner.farm.metrics import read_metrics_token

            read_metrics_token(config.metrics_token_file)
        make_root(root)
    except (SettingError, UnsafeRoot) as e:
        print_error(f"error: {e}")
        return EXIT_USAGE
    cmd = [sys.executable, "-m", "pan2render.runner.farm", "--root", str(root),
           *setting_flags(config, FARM_SETTINGS), *setting_flags(serving, FARM_SERVING_SETTINGS),
           *folder_and_model_flags(config)]
    if args.address:
        cmd += ["--address", args.address]
    if args.cpu_gpus is not None:
        cmd += ["--cpu-gpus", str(args.cpu_gpus)]
    try:
        fd = os.open(root / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        print_error(f"error: {root / LOG_NAME} cannot be the farm's log ({e.strerror}: a link, or not a regular "
                    f"file?): remove it, the farm makes its own")
        return EXIT_USAGE
    with os.fdopen(fd, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if (client := find_farm(root, timeout_s=1.0)) is not None:
            if (read_info(root) or {}).get("pid") != proc.pid:
                # Another start won the folder (ours then ends at once: it found the folder held), or
                # what answered at the address a killed farm left in the folder is ours, before it
                # wrote its own: the same port, asked for again. Ours still running holds the folder.
                if proc.poll() is None:
                    time.sleep(0.2)
                    continue
                print(f"a farm already runs at {root}: {client.url} (started at the same time)")
                return EXIT_OK
            print(f"farm up at {client.url} (pid {proc.pid}); folder {root}, log {root / LOG_NAME}, admin token in "
                  f"{root / TOKEN_NAME}\nreads batches' files from {', '.join(map(str, config.inputs_roots))}; "
                  f"writes into {', '.join(map(str, config.outputs_roots))}\n{monitor_line(client.url, root)}\n"
                  f"`pan2-render submit BATCH --out DIR` queues a batch; `pan2-render run` hands its batch to this "
                  f"farm while it runs (`--no-farm`: not); `pan2-render farm user add NAME` makes a user's token")
            return EXIT_OK
        code = proc.poll()
        if code is not None and code != EXIT_ALREADY_RUNNING:
            tail = _log_tail(root)
            print_error(f"error: the farm exited ({code}) before it answered; the end of "
                        f"{root / LOG_NAME}:\n  " + "\n  ".join(tail))
            return EXIT_ENVIRONMENT
        time.sleep(0.2)
    print_error(f"error: the farm (pid {proc.pid}) did not answer within {START_TIMEOUT_S:.0f} s; "
                f"see {root / LOG_NAME}")
    return EXIT_ENVIRONMENT


def _log_tail(root: Path) -> list[str]:
    try:
        return (root / LOG_NAME).read_text(errors="replace").splitlines()[-12:]
    except OSError:
        return []


def _stop(root: Path) -> int:
    client = find_farm(root)
    if client is None:
        print(f"no farm runs at {root}")
        return EXIT_OK
    info = read_info(root) or {}
    pid = info.get("pid") if isinstance(info.get("pid"), int) else None
    client.stop()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while pid is not None and _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid is not None and _alive(pid):
        print_error(f"error: the farm at {root} (pid {pid}) was asked to stop but has not ended within "
                    f"{STOP_TIMEOUT_S:.0f} s; see {root / LOG_NAME} (`kill {pid}` asks again, SIGTERM)")
        return EXIT_ENVIRONMENT
    print(f"farm at {root} stopped")
    return EXIT_OK


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _repair(root: Path) -> int:
    from pan2render.jobs.ledger import FolderLock, FolderLockedError
    from pan2render.runner.farm.queue import repair

    if not root.is_dir():
        print_error(f"error: {root} is not a folder; no farm queue to repair")
        return EXIT_USAGE
    try:
        with FolderLock(root):  # the farm holds it while it runs: its queue is not ours to replace
            print(repair(root))
    except FolderLockedError:
        print_error(f"error: a farm runs at {root}; stop it first (`{command('farm', 'stop', '--root', root)}`)")
        return EXIT_ENVIRONMENT
    return EXIT_OK


# ====================================================================== users
def _user(root: Path, what: list[str]) -> int:
    from pan2render.runner.farm.users import UserError, Users

    usage = "farm user add NAME | farm user list | farm user remove NAME"
    if not what or what[0] not in ("add", "list", "remove") or len(what) != (1 if what[0] == "list" else 2):
        print_error(f"error: {usage}")
        return EXIT_USAGE
    try:
        make_root(root)
        users = Users(root)
        if what[0] == "list":
            listed = users.all()
            for u in listed:
                print(f"{u.name}  (since {time.strftime('%Y-%m-%d %H:%M', time.localtime(u.created_at))})")
            if not listed:
                print(f"no users on the farm at {root} (`pan2-render farm user add NAME` makes one); the farm's own "
                      f"token ({root / TOKEN_NAME}) acts as admin")
            return EXIT_OK
        if what[0] == "remove":
            users.remove(what[1])
            print(f"user {what[1]} removed: its token no longer opens the farm (its batches stay)")
            return EXIT_OK
        token = users.add(what[1])
    except (UserError, UnsafeRoot) as e:
        print_error(f"error: {e}")
        return EXIT_USAGE
    print(token)
    print_error(f"user {what[1]} added; the line above is its token, shown only now (the farm keeps its hash). "
                f"Its clients send `Authorization: Bearer <token>`; it acts on its own batches and videos")
    return EXIT_OK


# ====================================================================== status
def monitor_line(url: str, root: Path) -> str:
    """Where the web monitor is: the token goes in the URL's fragment, which the browser keeps to itself."""
    return (f"web monitor: {url}/ (it asks for a token; the farm's own is in {root / TOKEN_NAME}; from a shell: "
            f"xdg-open \"{url}/#token=$(cat {root / TOKEN_NAME})\")")


def format_status(snap: dict[str, Any]) -> str:
    from pan2render.runner.views.format import duration, table

    now = time.time()
    lines = [f"farm at {snap['url']} (pid {snap['pid']} on {snap['host']}), up {duration(now - snap['started_at'])}",
             f"{snap['cluster']}: {snap['gpus']} GPU(s); idle groups released after {snap['idle_release_s']:.0f} s",
             f"queue: {snap['queue_depth']} job(s) waiting; log: {snap['log']}",
             monitor_line(snap["url"], Path(snap["root"]))]
    if snap.get("roots"):
        roots = snap["roots"]
        lines.append(f"reads from {', '.join(roots['inputs'])}; writes into {', '.join(roots['outputs'])}")
    if snap.get("write_error"):
        lines.append(f"WARNING: the queue cannot be written ({snap['write_error']}); free space in {snap['root']}")
    rows = [[g["id"], str(g["gpus"]), ", ".join(g["models"]) or "-", g["state"],
             duration(now - g["since"]) if g["since"] else "-", ", ".join(g["jobs"]) or "-",
             str(g["faults"])] for g in snap["groups"]]
    lines.append(table(["group", "gpus", "model", "state", "since", "jobs", "faults"], rows) if rows
                 else "no GPU group up")
    return "\n".join(lines)



