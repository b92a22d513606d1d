"""``pan2-render``: run / resume / status / show / validate / report / compare / calibrate / repair / presets.

Exit codes: 0 every job done, 1 some job failed, 2 invalid input or usage (nothing written),
3 the environment failed (disk full, permission, damaged ledger, lost cluster, a checkpoint folder
that cannot be loaded: one paragraph on the terminal, the traceback in DIR/_logs/), 4 (status only,
views.status_code) not finished, 5 (validate only) the batch is valid but its checkpoint folder is
missing or incomplete, so `run` would refuse it, 130 interrupted (Ctrl-C, SIGTERM or SIGHUP;
finished stages kept, `resume` continues). The commands live in cli/render.py (run, resume,
repair, node), cli/reading.py (the rest) and cli/farm.py (the farm's); what they share in cli/common.py.
Environment (for tests and debugging, not user settings):
    PAN2_RENDER_EXECUTOR  "local": run jobs in this process (LocalExecutor), no Ray; for tests of the
                          CLI's behaviour around the driver (ledger, disk, messages)
    PAN2_RENDER_PIPELINE  "module:callable(model, device)" that builds the pipeline in each worker
    PAN2_RENDER_FAULTS    JSON test hooks for the workers (worker/faults.py)
"""

from __future__ import annotations

# First: its import is the fallback start of the run log's start-up stamps where /proc is missing.
from pan2render.runner.protocol import timeline  # isort: skip  # noqa: F401

import argparse
import contextlib
import os
import sys
import traceback
from pathlib import Path

import pan2render
from pan2render.jobs.ledger import FolderLockedError
from pan2render.runner.cli.common import (
    EXIT_CHECKPOINT,
    EXIT_ENVIRONMENT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    add_folder_args,
    add_override_args,
    cmd,
    print_error,
    stop_signals_interrupt,
    stopped_by,
)
from pan2render.runner.cli.reading import (
    cmd_calibrate,
    cmd_compare,
    cmd_presets,
    cmd_report,
    cmd_show,
    cmd_status,
    cmd_validate,
)
from pan2render.runner.cli.render import NODE_PORT, cmd_node, cmd_repair, cmd_resume, cmd_run
from pan2render.runner.serve import errors
from pan2render.runner.serve.config import RUN_SETTINGS, ServingConfig, add_setting_args

# The entry point, and the exit codes it returns (the module docstring says what each means).
__all__ = ["EXIT_CHECKPOINT", "EXIT_ENVIRONMENT", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "main"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # argparse exits 2 on usage errors
    renders = args.command in ("run", "resume") and not getattr(args, "dry_run", False)
    try:
        with stop_signals_interrupt() if renders else contextlib.nullcontext():
            return int(args.func(args))
    except FolderLockedError as e:
        print_error(f"error: {e}")
        return EXIT_USAGE
    except BrokenPipeError:  # `pan2-render status DIR | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        if renders:
            from pan2render.runner.serve.session import recorded

            where = getattr(args, "out", None) or getattr(args, "dir", None)
            by = f" by {stopped_by[-1]}" if stopped_by else ""
            if recorded(where):
                print_error(f"\ninterrupted{by}; finished stages are kept: `{cmd('resume', where)}` continues")
            else:
                print_error(f"\ninterrupted{by}; nothing was recorded in {where}: run the same command again")
        return EXIT_INTERRUPTED
    except Exception as e:  # never a traceback on the terminal: one paragraph + a log
        folder = getattr(args, "out", None) or getattr(args, "dir", None)
        log = errors.write_log(folder, traceback.format_exc())
        # `resume` only where a batch is recorded to resume; else the command itself, once fixed.
        from pan2render.runner.serve.session import recorded

        again = cmd("resume", folder) if renders and recorded(folder) else None
        print_error(f"error: {errors.explain(e, folder=folder, resume=again)}"
             + (f"\n(details: {log})" if log is not None else ""))
        return EXIT_ENVIRONMENT


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pan2-render", description="Render PAN2 / Wan2.2 video batches on Ray.")
    p.add_argument("--version", action="version", version=f"pan2-render {pan2render.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def cluster_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--address", help="join this Ray cluster (auto, HOST:6379, or ray://HOST:10001 with "
                                          "the client extra); default: the node kept up on this machine "
                                          "(`pan2-render node start`) if one runs, else a local cluster of the "
                                          "run's own (`local`: always that)")
        sp.add_argument("--cpu-gpus", type=int, metavar="N",
                        help="declare N logical GPUs on a CPU-only machine (groups of N run on CPU, gloo)")
        add_setting_args(sp, ServingConfig, RUN_SETTINGS)
        sp.add_argument("--no-progress", action="store_true",
                        help="plain lines even on a terminal (one per job event, a summary each minute)")
        sp.add_argument("--metrics-port", type=int, default=0, metavar="N",
                        help="serve this batch's pan2render_* metrics for Prometheus on 127.0.0.1:N while it renders "
                             "(default 0: off; README, Farm: metrics)")

    r = sub.add_parser("run", help="render a batch into an output folder")
    r.add_argument("batch", type=Path, nargs="?")
    r.add_argument("--from", type=Path, dest="from_path", metavar="PATH",
                   help="render a job again from what it left: its params.json, its video (made by pan2-render) "
                        "or its job folder; same id and pixels, --set/--sweep applied on top")
    r.add_argument("--out", type=Path, required=True, metavar="DIR")
    r.add_argument("--dry-run", action="store_true",
                   help="plan only: the jobs, and an estimate of GPU and wall time; needs no checkpoint, "
                        "writes nothing")
    add_folder_args(r)
    r.add_argument("--no-farm", action="store_true",
                   help="render in this process even where a farm runs (default: a running farm takes the batch, "
                        "and this command follows it)")
    add_override_args(r)
    cluster_args(r)
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("resume", help="finish every unfinished or failed job of an output folder")
    s.add_argument("dir", type=Path)
    s.add_argument("--cancelled", action="store_true",
                   help="render the jobs a client cancelled too (default: a cancelled job stays cancelled)")
    cluster_args(s)
    s.set_defaults(func=cmd_resume)

    st = sub.add_parser("status", help="where each job of an output folder stands")
    st.add_argument("dir", type=Path)
    st.add_argument("--json", action="store_true")
    st.add_argument("--watch", type=float, nargs="?", const=5.0, metavar="S",
                    help="redraw every S seconds (default 5) until the run holding the folder ends")
    st.set_defaults(func=cmd_status)

    sh = sub.add_parser("show", help="one job: its spec, stages, every attempt with its error and traceback, "
                                     "its events")
    sh.add_argument("dir", type=Path)
    sh.add_argument("job", help="a job id, a unique id prefix, or a unique name")
    sh.set_defaults(func=cmd_show)

    v = sub.add_parser("validate", help="check a batch file and its checkpoint's files (no weights read), and plan it")
    v.add_argument("batch", type=Path)
    v.add_argument("--out", type=Path, metavar="DIR",
                   help="the output folder it would render into: its jobs already done are skipped, and its "
                        "and its neighbours' ledgers give the estimate")
    add_override_args(v)
    v.set_defaults(func=cmd_validate)

    rep = sub.add_parser("report", help="write DIR/index.html (every video inline, sweep grids, errors); "
                                         "run and resume write it too")
    rep.add_argument("dir", type=Path)
    rep.add_argument("--open", action="store_true", help="open it in the default web browser")
    rep.set_defaults(func=cmd_report)

    cmp_ = sub.add_parser("compare", help="each fast-lane video's PSNR and SSIM against the exact video of the "
                                          "same job, and both sampling times")
    cmp_.add_argument("dir", type=Path)
    cmp_.add_argument("--json", action="store_true")
    cmp_.set_defaults(func=cmd_compare)

    cal = sub.add_parser("calibrate", help="measure MagCache's magnitude ratios on MODEL with one exact job, fit "
                                           "its previews' latent -> RGB map on the same job, and keep both beside "
                                           "its model id (cache magcache and live previews then use them)")
    cal.add_argument("model", help='"tiny" or a checkpoint folder')
    cal.add_argument("--preset", help="the job's size, steps, guidance (default: tiny-preview for the tiny model, "
                                      "else pan2-720p)")
    cal.add_argument("--prompt", default="A red fox trots through fresh snow at dawn, cinematic, detailed.")
    cal.add_argument("--image", type=Path, help="calibrate image-conditioned jobs (a first frame) instead")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--device", default="auto")
    cal.set_defaults(func=cmd_calibrate)

    fix = sub.add_parser("repair", help="rebuild a missing or damaged ledger from its backup and the artifacts")
    fix.add_argument("dir", type=Path)
    fix.add_argument("--batch", type=Path, help="the batch file, for jobs that left nothing on disk "
                                                "and are not in the backup")
    add_setting_args(fix, ServingConfig, ["retries"])
    fix.set_defaults(func=cmd_repair)

    pr = sub.add_parser("presets", help="list the presets and their fields, or print one")
    pr.add_argument("name", nargs="?", help="print this preset's file, comments included")
    pr.set_defaults(func=cmd_presets)

    nd = sub.add_parser("node", help="keep a Ray node up on this machine between batches (start / stop): "
                                     "runs join it instead of starting Ray")
    nd.add_argument("action", choices=("start", "stop"))
    nd.add_argument("--cpu-gpus", type=int, metavar="N",
                    help="declare N logical GPUs on a CPU-only machine (default: the CUDA GPUs found, else 1)")
    nd.add_argument("--port", type=int, default=NODE_PORT, help=f"the node's GCS port (default {NODE_PORT})")
    nd.set_defaults(func=cmd_node)
    from pan2render.runner.cli import batches, farm  # (the farm's commands: pan2render.client)

    farm.add_commands(sub)
    batches.add_commands(sub)
    return p


if __name__ == "__main__":
    sys.exit(main())
