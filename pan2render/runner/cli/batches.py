"""The commands that queue batches on a farm and act on them: ``submit``, ``queue``, ``pause``,
``unpause``, ``cancel``, ``priority``, ``retry``; and ``run``'s hand-over to a farm that is running.

They speak the farm's HTTP API through ``pan2render.client``, as any other client would: the
batch file's text travels and the farm validates it (exit 2 with its file:line problems, nothing
queued), resolving its paths itself inside the folders it allows.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from pan2render.client import FarmClient, FarmError, find_farm
from pan2render.runner.cli.common import (
    EXIT_ENVIRONMENT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    add_folder_args,
    add_override_args,
    print_error,
)
from pan2render.runner.cli.farm import farm_client, root_arg
from pan2render.runner.serve.config import ServingConfig, add_setting_args

_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ")


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("submit", help="queue a batch on the farm (the farm validates it)")
    s.add_argument("batch", type=Path)
    s.add_argument("--out", type=Path, required=True, metavar="DIR")
    s.add_argument("--priority", type=int, default=0, help="higher runs first (default 0; -1000..1000); then "
                                                          "submission order")
    s.add_argument("--preempt", action="store_true",
                   help="its jobs may stop a lower-priority batch's sampling at a step boundary to take its GPUs "
                        "(that job continues from its step checkpoint after)")
    s.add_argument("--wait", action="store_true", help="follow it as `run` would, with run's exit codes")
    add_setting_args(s, ServingConfig, ["retries"])
    root_arg(s)
    add_override_args(s)
    add_folder_args(s)
    s.set_defaults(func=cmd_submit)

    q = sub.add_parser("queue", help="the farm's batches: owner, priority, state, progress, ETA")
    root_arg(q)
    q.add_argument("--all", action="store_true", help="ended batches too")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_queue)

    for name, what in (("pause", "no new job of the batch starts (running ones finish)"),
                       ("unpause", "the batch's jobs start again"),
                       ("retry", "an ended batch's failed, cancelled and interrupted jobs back in the queue")):
        a = sub.add_parser(name, help=what)
        a.add_argument("batch", help="the batch's id (b3; `pan2-render queue` lists them)")
        root_arg(a)
        a.set_defaults(func=cmd_action, action=name)
    c = sub.add_parser("cancel", help="cancel a batch, or one of its jobs: a sampling in progress stops at its "
                                      "next step")
    c.add_argument("batch")
    c.add_argument("job", nargs="?", help="one job of the batch (id, unique id prefix or name)")
    root_arg(c)
    c.set_defaults(func=cmd_action, action="cancel")
    p = sub.add_parser("priority", help="change a batch's priority (higher runs first)")
    p.add_argument("batch")
    p.add_argument("value", type=int)
    root_arg(p)
    p.set_defaults(func=cmd_action, action="priority")


# ====================================================================== submit / follow
def cmd_submit(args: argparse.Namespace) -> int:
    try:
        text = args.batch.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print_error(f"error: {args.batch}: cannot be read ({e}); nothing was queued")
        return EXIT_USAGE
    client = farm_client(args.root)
    if client is None:
        return EXIT_ENVIRONMENT
    return submit(client, text, name=args.batch.name, base=args.batch.absolute().parent, out=args.out,
                  sets=args.sets, sweeps=args.sweeps, priority=args.priority, retries=args.retries, wait=args.wait,
                  preempt=args.preempt, add=args.add, force=args.force, prune=args.prune)


def submit(client: FarmClient, text: str, *, name: str, base: Path, out: Path, sets: list[str], sweeps: list[str],
           priority: int, retries: int, wait: bool, preempt: bool = False, add: bool = False, force: bool = False,
           prune: bool = False) -> int:
    out = out.absolute()
    log_start = _log_size(out)
    try:
        b = client.submit_text(text, name=name, base=base, out=out, sets=sets, sweeps=sweeps, priority=priority,
                               preempt=preempt, retries=retries, add=add, force=force, prune=prune)
    except FarmError as e:
        if e.problems:
            print_error(f"error: {name}: {len(e.problems)} problem(s); nothing was queued:")
            for problem in e.problems:
                print_error(f"  {problem}")
            return EXIT_USAGE
        print_error(f"error: the farm refused the batch: {e}")
        # 422 without problems: valid, but its model folder cannot be loaded (as `run`'s exit 3)
        return EXIT_USAGE if e.status in (400, 403, 404, 409, 413) else EXIT_ENVIRONMENT
    print(f"queued batch {b['id']}: {b['counts']['total']} job(s) into {b['out_dir']}, priority {priority} "
          f"(`pan2-render queue` lists the farm's batches)", flush=True)
    return follow(client, b["id"], offset=log_start, out_dir=out) if wait else EXIT_OK


def _log_size(out: Path) -> int:
    try:
        return (out / "run.log").stat().st_size
    except OSError:
        return 0


def follow(client: FarmClient, batch_id: str, *, offset: int = 0, out_dir: Path | None = None) -> int:
    """Print the batch's run log as it grows (its lines, as `run` prints them) until it ends; its
    exit code is run's. Ctrl-C stops following only: the batch goes on."""
    try:
        return client.follow(batch_id, offset=offset, out_dir=out_dir,
                             on_line=lambda line: print(_STAMP.sub("", line), file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print_error(f"\nstopped following; batch {batch_id} goes on on the farm (`pan2-render cancel {batch_id}` "
                    f"stops it, `pan2-render queue` shows it)")
        return EXIT_INTERRUPTED
    except FarmError as e:
        if e.status:
            print_error(f"error: the farm refused to show batch {batch_id}'s log: {e}")
        else:
            print_error(f"error: lost the farm while following batch {batch_id}: {e}; the lines above are its "
                        f"run.log to the end (`pan2-render farm start` continues the batch, `pan2-render status` "
                        f"shows it)")
        return EXIT_ENVIRONMENT


# ====================================================================== queue and actions
def cmd_queue(args: argparse.Namespace) -> int:
    from pan2render.runner.views.format import duration, printable, table

    client = farm_client(args.root)
    if client is None:
        return EXIT_ENVIRONMENT
    batches = client.batches(all=args.all)
    if not args.all:
        batches = [b for b in batches if b["exit_code"] is None or b["state"] in ("active", "paused", "cancelling")]
    if args.json:
        print(json.dumps(batches, indent=1))
        return EXIT_OK
    if not batches:
        print("the queue is empty" + ("" if args.all else " (`--all` lists ended batches)"))
        return EXIT_OK
    rows = []
    for b in batches:
        c = b.get("counts") or {}
        state = "running" if b["state"] == "active" and b.get("running") else \
            "queued" if b["state"] == "active" else b["state"]
        rows.append([b["id"], printable(b["owner"]), str(b["priority"]), state,
                     f"{c.get('done', 0)}/{c.get('failed', 0)}/{c.get('total', '?')}", str(len(b.get("running", []))),
                     "-" if b.get("eta_s") is None else duration(b["eta_s"]), printable(b["out_dir"])])
    print(table(["batch", "owner", "priority", "state", "done/failed/total", "running", "ETA", "folder"], rows))
    return EXIT_OK


def cmd_action(args: argparse.Namespace) -> int:
    client = farm_client(args.root)
    if client is None:
        return EXIT_ENVIRONMENT
    data: dict[str, Any] = {}
    if args.action == "priority":
        data["priority"] = args.value
    if args.action == "cancel" and args.job:
        data["job"] = args.job
    try:
        b = client.act(args.batch, args.action, data)
    except FarmError as e:
        print_error(f"error: {e}")
        if e.body.get("request"):
            print_error(f"(`curl` its outcome: GET /api/requests/{e.body['request']})")
        return EXIT_USAGE if e.status in (400, 403, 404, 409) else EXIT_ENVIRONMENT
    c = b["counts"]
    print(f"batch {b['id']}: {b['state']}, priority {b['priority']}; {c.get('done', 0)} done, "
          f"{c.get('failed', 0)} failed, {c.get('cancelled', 0)} cancelled of {c['total']}; "
          f"{len(b['running'])} running, {b['queued']} queued"
          + (f" ({b['waiting']} of them waiting for the jobs they run after)" if b.get("waiting") else ""))
    return EXIT_OK


def hand_to_farm(args: argparse.Namespace, batch: Any) -> int | None:
    """``run``'s hand-over: where a farm runs (and ``--no-farm`` is not given), the batch is submitted
    to it and followed, as ``submit --wait``; None when no farm runs (``run`` serves it itself)."""
    if getattr(args, "no_farm", False) or batch.text is None:
        return None
    client = find_farm(getattr(args, "farm_root", None))
    if client is None:
        return None
    print(f"run: a farm runs at {client.url} ({client.root}): the batch is submitted to it and followed here "
          f"(`--no-farm` renders it in this process)", file=sys.stderr, flush=True)
    source = Path(batch.path)
    return submit(client, batch.text, name=source.name, base=source.absolute().parent, out=args.out, sets=args.sets,
                  sweeps=args.sweeps, priority=0, retries=args.retries, wait=True, add=getattr(args, "add", False),
                  force=getattr(args, "force", False), prune=getattr(args, "prune", False))
