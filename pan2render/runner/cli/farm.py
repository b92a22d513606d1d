"""The farm's commands: ``farm start|stop|status|repair``, ``submit``, ``queue``, ``pause``, ``unpause``,
``cancel``, ``priority``, ``retry``; and ``run``'s hand-over to a farm that is running.

Validation happens here, on the client, exactly as ``run`` validates (exit 2, file:line, nothing
queued): the farm receives a batch already resolved and checked.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pan2render.hints import command
from pan2render.runner.cli.common import (
    EXIT_ENVIRONMENT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    add_folder_args,
    add_override_args,
    check_out_folder,
    load_batch_or_report,
    print_error,
)
from pan2render.runner.farm.client import INFO_NAME, FarmClient, FarmError, default_root, find_farm
from pan2render.runner.farm.config import FARM_SERVING_SETTINGS, FARM_SETTINGS, FarmConfig
from pan2render.runner.serve.config import (
    ServingConfig,
    SettingError,
    add_setting_args,
    setting_flags,
    settings_from_args,
)

START_TIMEOUT_S = 180.0  # Ray's start, the process's imports: seconds; a busy machine: more
_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ")


def _root_arg(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--root", type=Path, default=None, metavar="DIR",
                    help=f"the farm's folder (queue, token, log; default ${{PAN2_RENDER_FARM}} or {default_root()})")


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]

    f = sub.add_parser("farm", help="a render farm that stays up: one queue of batches, warm GPU groups")
    f.add_argument("action", choices=("start", "stop", "status", "repair"),
                   help="repair: put a damaged farm.sqlite back from its backup (the farm stopped)")
    _root_arg(f)
    f.add_argument("--address", help="join this Ray cluster (as `run --address`); default: a local cluster of "
                                     "the farm's own, or the node kept up on this machine")
    f.add_argument("--cpu-gpus", type=int, metavar="N", help="declare N logical GPUs on a CPU-only machine")
    add_setting_args(f, FarmConfig, FARM_SETTINGS)
    add_setting_args(f, ServingConfig, FARM_SERVING_SETTINGS)
    f.add_argument("--json", action="store_true", help="status: the farm's state as JSON")
    f.set_defaults(func=cmd_farm)

    s = sub.add_parser("submit", help="validate a batch here and queue it on the farm")
    s.add_argument("batch", type=Path)
    s.add_argument("--out", type=Path, required=True, metavar="DIR")
    s.add_argument("--priority", type=int, default=0, help="higher runs first (default 0); then submission order")
    s.add_argument("--preempt", action="store_true",
                   help="its jobs may stop a lower-priority batch's sampling at a step boundary to take its GPUs "
                        "(that job continues from its step checkpoint after)")
    s.add_argument("--wait", action="store_true", help="follow it as `run` would, with run's exit codes")
    add_setting_args(s, ServingConfig, ["retries"])
    _root_arg(s)
    add_override_args(s)
    add_folder_args(s)
    s.set_defaults(func=cmd_submit)

    q = sub.add_parser("queue", help="the farm's batches: owner, priority, state, progress, ETA")
    _root_arg(q)
    q.add_argument("--all", action="store_true", help="ended batches too")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_queue)

    for name, what in (("pause", "no new job of the batch starts (running ones finish)"),
                       ("unpause", "the batch's jobs start again"),
                       ("retry", "an ended batch's failed, cancelled and interrupted jobs back in the queue")):
        a = sub.add_parser(name, help=what)
        a.add_argument("batch", help="the batch's id (b3; `pan2-render queue` lists them)")
        _root_arg(a)
        a.set_defaults(func=cmd_action, action=name)
    c = sub.add_parser("cancel", help="cancel a batch, or one of its jobs: a sampling in progress stops at its "
                                      "next step")
    c.add_argument("batch")
    c.add_argument("job", nargs="?", help="one job of the batch (id, unique id prefix or name)")
    _root_arg(c)
    c.set_defaults(func=cmd_action, action="cancel")
    p = sub.add_parser("priority", help="change a batch's priority (higher runs first)")
    p.add_argument("batch")
    p.add_argument("value", type=int)
    _root_arg(p)
    p.set_defaults(func=cmd_action, action="priority")


def _client(root: Path | None) -> FarmClient | None:
    client = find_farm(root)
    if client is None:
        where = default_root() if root is None else root
        start = "pan2-render farm start" + ("" if root is None else f" --root {root}")
        print_error(f"error: no farm answers at {where} (`{start}` starts one)")
    return client


def owner() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


# ====================================================================== farm start / stop / status
def cmd_farm(args: argparse.Namespace) -> int:
    root: Path = (args.root or default_root()).absolute()
    if args.action == "start":
        return _start(args, root)
    if args.action == "repair":
        return _repair(root)
    client = find_farm(root)
    if args.action == "stop":
        if client is None:
            print(f"no farm runs at {root}")
            return EXIT_OK
        pid = _pid(root)
        client.post("/api/stop")
        deadline = time.monotonic() + 60
        while pid is not None and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"farm at {root} stopped" + ("" if pid is None or not _alive(pid) else f" (pid {pid} still ending)"))
        return EXIT_OK
    if client is None:
        print(f"no farm runs at {root} (`pan2-render farm start --root {root}` starts one)")
        return EXIT_FAILED
    snap = client.get("/api/status")
    if args.json:
        import json

        print(json.dumps(snap, indent=1))
        return EXIT_OK
    print(format_status(snap))
    return EXIT_OK


def _start(args: argparse.Namespace, root: Path) -> int:
    if (client := find_farm(root)) is not None:
        print(f"a farm already runs at {root}: {client.url} (`pan2-render farm stop --root {root}` ends it)")
        return EXIT_OK
    if args.cpu_gpus is not None and args.cpu_gpus < 1:
        print_error(f"error: --cpu-gpus {args.cpu_gpus}: must be >= 1")
        return EXIT_USAGE
    try:
        serving = settings_from_args(ServingConfig, args)
        config = settings_from_args(FarmConfig, args, root=root, serving=serving)
    except SettingError as e:
        print_error(f"error: {e}")
        return EXIT_USAGE
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    (root / INFO_NAME).unlink(missing_ok=True)  # a killed farm's: the new one writes its own
    cmd = [sys.executable, "-m", "pan2render.runner.farm", "--root", str(root),
           *setting_flags(config, FARM_SETTINGS), *setting_flags(serving, FARM_SERVING_SETTINGS)]
    if args.address:
        cmd += ["--address", args.address]
    if args.cpu_gpus is not None:
        cmd += ["--cpu-gpus", str(args.cpu_gpus)]
    with open(root / "farm.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if (client := find_farm(root, timeout_s=1.0)) is not None:
            print(f"farm up at {client.url} (pid {proc.pid}); folder {root}, log {root / 'farm.log'}, token in "
                  f"{root / 'token'}\n{monitor_line(client.url, root)}\n`pan2-render submit BATCH --out DIR` queues a "
                  f"batch; `pan2-render run` hands its batch to this farm while it runs (`--no-farm`: not)")
            return EXIT_OK
        if proc.poll() is not None:
            tail = (root / "farm.log").read_text(errors="replace").splitlines()[-12:]
            print_error(f"error: the farm exited ({proc.returncode}) before it answered; the end of "
                        f"{root / 'farm.log'}:\n  " + "\n  ".join(tail))
            return EXIT_ENVIRONMENT
        time.sleep(0.2)
    print_error(f"error: the farm (pid {proc.pid}) did not answer within {START_TIMEOUT_S:.0f} s; "
                f"see {root / 'farm.log'}")
    return EXIT_ENVIRONMENT


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


def _pid(root: Path) -> int | None:
    import json

    try:
        return int(json.loads((root / INFO_NAME).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def monitor_line(url: str, root: Path) -> str:
    """Where the web monitor is: the token goes in the URL's fragment, which the browser keeps to itself."""
    return (f"web monitor: {url}/ (it asks for the token in {root / 'token'}; from a shell: "
            f"xdg-open \"{url}/#token=$(cat {root / 'token'})\")")


def format_status(snap: dict[str, Any]) -> str:
    from pan2render.runner.views.format import duration, table

    now = time.time()
    lines = [f"farm at {snap['url']} (pid {snap['pid']} on {snap['host']}), up {duration(now - snap['started_at'])}",
             f"{snap['cluster']}: {snap['gpus']} GPU(s); idle groups released after {snap['idle_release_s']:.0f} s",
             f"queue: {snap['queue_depth']} job(s) waiting; log: {snap['log']}",
             monitor_line(snap["url"], Path(snap["root"]))]
    rows = [[g["id"], str(g["gpus"]), ", ".join(g["models"]) or "-", g["state"],
             duration(now - g["since"]) if g["since"] else "-", ", ".join(g["jobs"]) or "-",
             str(g["faults"])] for g in snap["groups"]]
    lines.append(table(["group", "gpus", "model", "state", "since", "jobs", "faults"], rows) if rows
                 else "no GPU group up")
    return "\n".join(lines)


# ====================================================================== submit / follow
def cmd_submit(args: argparse.Namespace) -> int:
    from pan2render.jobs.overrides import Overrides

    if (problem := _retries_problem(args.retries)) is not None:
        print_error(f"error: {problem}")
        return EXIT_USAGE
    overrides = Overrides(sets=tuple(args.sets), sweeps=tuple(args.sweeps))
    batch = load_batch_or_report(args.batch, overrides, check_model=True)
    if batch is None:
        return EXIT_USAGE
    if (code := check_out_folder(args.out, batch, args)) is not None:
        return code
    client = _client(args.root)
    if client is None:
        return EXIT_ENVIRONMENT
    return submit(client, batch, overrides, out=args.out, priority=args.priority, retries=args.retries,
                  wait=args.wait, preempt=args.preempt, prune=args.prune)


def _retries_problem(retries: int) -> str | None:
    try:
        ServingConfig(retries=retries)
    except SettingError as e:
        return str(e)
    return None


def submit(client: FarmClient, batch: Any, overrides: Any, *, out: Path, priority: int, retries: int,
           wait: bool, preempt: bool = False, prune: bool = False) -> int:
    from pan2render.runner.serve.session import BatchRequest

    request = BatchRequest(out_dir=out.absolute(), batch=batch, overrides=overrides, retries=retries, prune=prune)
    log_start = _log_size(out)
    try:
        b = client.post("/api/batches", {"request": request.to_json(), "owner": owner(), "priority": priority,
                                         "preempt": preempt})
    except FarmError as e:
        print_error(f"error: the farm refused the batch: {e}")
        # 422: the batch is valid but cannot be rendered as things stand (its checkpoint), as `run`'s 3
        return EXIT_USAGE if e.status in (400, 409) else EXIT_ENVIRONMENT
    print(f"queued batch {b['id']}: {b['counts']['total']} job(s) into {b['out_dir']}, priority {priority} "
          f"(`pan2-render queue` lists the farm's batches)", flush=True)
    return follow(client, b["id"], offset=log_start) if wait else EXIT_OK


def _log_size(out: Path) -> int:
    try:
        return (out / "run.log").stat().st_size
    except OSError:
        return 0


def follow(client: FarmClient, batch_id: str, *, offset: int = 0) -> int:
    """Print the batch's run log as it grows (its lines, as `run` prints them) until it ends; its
    exit code is run's. Ctrl-C stops following only: the batch goes on."""
    try:
        while True:
            got = client.get(f"/api/batches/{batch_id}/log?offset={offset}")
            for line in got["text"].splitlines():
                print(_STAMP.sub("", line), file=sys.stderr, flush=True)
            offset = got["offset"]
            code = got["batch"]["exit_code"]
            if code is not None and not got["text"]:
                return int(code)
            if not got["text"]:
                time.sleep(0.3)
    except KeyboardInterrupt:
        print_error(f"\nstopped following; batch {batch_id} goes on on the farm (`pan2-render cancel {batch_id}` "
                    f"stops it, `pan2-render queue` shows it)")
        return EXIT_INTERRUPTED
    except FarmError as e:
        print_error(f"error: lost the farm while following batch {batch_id}: {e}")
        return EXIT_ENVIRONMENT


# ====================================================================== queue and actions
def cmd_queue(args: argparse.Namespace) -> int:
    from pan2render.runner.views.format import duration, table

    client = _client(args.root)
    if client is None:
        return EXIT_ENVIRONMENT
    batches = client.get("/api/batches")
    if not args.all:
        batches = [b for b in batches if b["exit_code"] is None]
    if args.json:
        import json

        print(json.dumps(batches, indent=1))
        return EXIT_OK
    if not batches:
        print("the queue is empty" + ("" if args.all else " (`--all` lists ended batches)"))
        return EXIT_OK
    rows = []
    for b in batches:
        c = b["counts"]
        state = "running" if b["state"] == "active" and b["running"] else \
            "queued" if b["state"] == "active" else b["state"]
        rows.append([b["id"], b["owner"], str(b["priority"]), state,
                     f"{c.get('done', 0)}/{c.get('failed', 0)}/{c['total']}", str(len(b["running"])),
                     "-" if b.get("eta_s") is None else duration(b["eta_s"]), b["out_dir"]])
    print(table(["batch", "owner", "priority", "state", "done/failed/total", "running", "ETA", "folder"], rows))
    return EXIT_OK


def cmd_action(args: argparse.Namespace) -> int:
    client = _client(args.root)
    if client is None:
        return EXIT_ENVIRONMENT
    data: dict[str, Any] = {}
    if args.action == "priority":
        data["priority"] = args.value
    if args.action == "cancel" and args.job:
        data["job"] = args.job
    try:
        b = client.post(f"/api/batches/{args.batch}/{args.action}", data)
    except FarmError as e:
        print_error(f"error: {e}")
        return EXIT_USAGE if e.status in (400, 404, 409) else EXIT_ENVIRONMENT
    c = b["counts"]
    print(f"batch {b['id']}: {b['state']}, priority {b['priority']}; {c.get('done', 0)} done, "
          f"{c.get('failed', 0)} failed, {c.get('cancelled', 0)} cancelled of {c['total']}; "
          f"{len(b['running'])} running, {b['queued']} queued")
    return EXIT_OK


def hand_to_farm(args: argparse.Namespace, batch: Any, overrides: Any) -> int | None:
    """``run``'s hand-over: where a farm runs (and ``--no-farm`` is not given), the batch is submitted
    to it and followed, as ``submit --wait``; None when no farm runs (``run`` serves it itself)."""
    if getattr(args, "no_farm", False):
        return None
    client = find_farm(getattr(args, "farm_root", None))
    if client is None:
        return None
    print(f"run: a farm runs at {client.url} ({client.root}): the batch is submitted to it and followed here "
          f"(`--no-farm` renders it in this process)", file=sys.stderr, flush=True)
    return submit(client, batch, overrides, out=args.out, priority=0, retries=args.retries, wait=True,
                  prune=getattr(args, "prune", False))


