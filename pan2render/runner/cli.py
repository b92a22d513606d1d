"""``pan2-render``: run / resume / status / show / validate / report / compare / calibrate / repair / presets.

Exit codes: 0 every job done, 1 some job failed, 2 invalid input or usage (nothing written),
3 the environment failed (disk full, permission, damaged ledger, lost cluster, a checkpoint folder
that cannot be loaded: one paragraph on the terminal, the traceback in DIR/_logs/), 4 (status only,
views.status_code) not finished, 5 (validate only) the batch is valid but its checkpoint folder is
missing or incomplete, so `run` would refuse it, 130 interrupted (Ctrl-C, SIGTERM or SIGHUP; finished stages kept, `resume` continues).
Environment (for tests and debugging, not user settings):
    PAN2_RENDER_EXECUTOR  "local": run jobs in this process (LocalExecutor), no Ray; for tests of the
                          CLI's behaviour around the driver (ledger, disk, messages)
    PAN2_RENDER_PIPELINE  "module:callable(model, device)" that builds the pipeline in each worker
    PAN2_RENDER_FAULTS    JSON test hooks for the workers (see RenderWorker._maybe_crash/_fault)
"""

from __future__ import annotations

# First: its import is the fallback start of the run log's start-up stamps where /proc is missing.
from pan2render.runner import timeline  # isort: skip

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pan2render
from pan2render.jobs.batch import TINY_MODEL, Overrides, list_presets, preset_text
from pan2render.hints import command
from pan2render.jobs.ledger import (
    LEDGER_NAME,
    FolderLock,
    FolderLockedError,
    JobState,
    Ledger,
)
from pan2render.jobs.spec import Batch, BatchValidationError
from pan2render.runner import errors
from pan2render.runner.executor import LOCAL_ADDRESS
from pan2render.runner.progress import RunLog, RunProgress

# The driver, the groups and the workers import torch (seconds); commands that read a batch or a
# ledger (--version, presets, validate, show) do without them, so they are imported on use.
if TYPE_CHECKING:
    from pan2render.runner.driver import RunSummary

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CHECKPOINT = 5  # validate: a valid batch whose checkpoint `run` would refuse


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # argparse exits 2 on usage errors
    renders = args.command in ("run", "resume") and not getattr(args, "dry_run", False)
    try:
        with _stop_signals_interrupt() if renders else contextlib.nullcontext():
            return int(args.func(args))
    except FolderLockedError as e:
        _err(f"error: {e}")
        return EXIT_USAGE
    except BrokenPipeError:  # `pan2-render status DIR | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        if renders:
            from pan2render.runner.session import recorded  # noqa: PLC0415

            where = getattr(args, "out", None) or getattr(args, "dir", None)
            by = f" by {_stopped_by[-1]}" if _stopped_by else ""
            if recorded(where):
                _err(f"\ninterrupted{by}; finished stages are kept: `{_cmd('resume', where)}` continues")
            else:
                _err(f"\ninterrupted{by}; nothing was recorded in {where}: run the same command again")
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - never a traceback on the terminal: one paragraph + a log
        folder = getattr(args, "out", None) or getattr(args, "dir", None)
        log = errors.write_log(folder, traceback.format_exc())
        # `resume` only where a batch is recorded to resume; else the command itself, once fixed.
        from pan2render.runner.session import recorded  # noqa: PLC0415

        again = _cmd("resume", folder) if renders and recorded(folder) else None
        _err(f"error: {errors.explain(e, folder=folder, resume=again)}"
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
        sp.add_argument("--retries", type=int, default=2, metavar="N", help="retries per job (default 2)")
        sp.add_argument("--group-start-timeout", type=float, default=300.0, metavar="S",
                        help="seconds a GPU group may take to start (its placement group to be granted, its "
                             "actors to join) before the job it was for is charged an attempt (default 300; "
                             "raise it on a shared cluster whose GPUs are often held by others)")
        sp.add_argument("--cluster-wait", type=float, default=300.0, metavar="S",
                        help="seconds to wait for GPUs to come back after the cluster lost them (a node "
                             "died) before the batch stops, its jobs pending and uncharged (default 300)")
        sp.add_argument("--stall-timeout", type=float, default=600.0, metavar="S",
                        help="seconds a sampling may go without finishing a step before its workers count as "
                             "hung: they are restarted and the job retried (default 600; 0: never)")
        sp.add_argument("--no-progress", action="store_true",
                        help="plain lines even on a terminal (one per job event, a summary each minute)")

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

    cal = sub.add_parser("calibrate", help="measure MagCache's magnitude ratios on MODEL with one exact job and "
                                           "keep them beside its model id (cache magcache then uses them)")
    cal.add_argument("model", help='"tiny" or a checkpoint folder')
    cal.add_argument("--preset", default="pan2-720p", help="the job's size, steps, guidance (default pan2-720p)")
    cal.add_argument("--prompt", default="A red fox trots through fresh snow at dawn, cinematic, detailed.")
    cal.add_argument("--image", type=Path, help="calibrate image-conditioned jobs (a first frame) instead")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--device", default="auto")
    cal.set_defaults(func=cmd_calibrate)

    fix = sub.add_parser("repair", help="rebuild a missing or damaged ledger from its backup and the artifacts")
    fix.add_argument("dir", type=Path)
    fix.add_argument("--batch", type=Path, help="the batch file, for jobs that left nothing on disk "
                                                "and are not in the backup")
    fix.add_argument("--retries", type=int, default=2, metavar="N", help="retry budget of rebuilt jobs")
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
    from pan2render.runner.farm.commands import add_commands  # noqa: PLC0415 - it imports this module

    add_commands(sub)
    return p


def add_override_args(sp: argparse.ArgumentParser) -> None:
    """``--set`` and ``--sweep``, as every command that reads a batch takes them."""
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                    help="override for every job, after the batch's defaults and the jobs' own values: "
                         "a job field (steps=4), model=tiny or model=PATH, preset=NAME (repeatable)")
    sp.add_argument("--sweep", action="append", default=[], metavar="KEY=A,B,C", dest="sweeps",
                    help="sweep a job field over these values, adding or replacing the batch's axis "
                         "(repeatable; axes multiply)")


def add_folder_args(sp: argparse.ArgumentParser) -> None:
    """What a batch may do to the output folder it is recorded into (`run` and `submit`)."""
    sp.add_argument("--add", action="store_true",
                    help="render this batch into a folder that holds another batch's jobs, beside them")
    sp.add_argument("--force", action="store_true",
                    help="write into a non-empty folder that is not a pan2-render output")
    sp.add_argument("--prune", action="store_true",
                    help="drop the folder's jobs that are not in this batch and not done (resume would render them)")


def check_out_folder(out: Path, batch: Any, args: argparse.Namespace) -> int | None:
    """The exit code when ``batch`` may not be recorded into ``out`` as it stands (said on stderr,
    nothing written), else None."""
    if out.exists() and not out.is_dir():
        _err(f"error: --out {out} is a file, not a folder; name a new or existing folder")
        return EXIT_USAGE
    from pan2render.runner.out_check import refusal  # noqa: PLC0415

    if (why := refusal(out, batch.path, {j.job_id for j in batch.jobs}, add=args.add, force=args.force)) is not None:
        _err(f"error: {why}; nothing was written")
        return EXIT_USAGE
    return None


# ====================================================================== node
NODE_PORT = 6379  # Ray's default head port: `--address auto` and `ray status` find it as usual


def cmd_node(args: argparse.Namespace) -> int:
    """A Ray node on this machine that runs join by default: it stays up between batches, so a run
    joins it instead of starting Ray (~2 s against ~7 s on an H200 host, before the first video).
    A run's GPU workers are still its own. `node stop` ends that node alone (runner/node.py)."""
    from pan2render.runner import node  # noqa: PLC0415 - imports ray's scripts only when it starts one
    from pan2render.runner.executor import local_gpus  # noqa: PLC0415

    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    if args.action == "stop":
        try:
            stopped = node.stop()
        except node.NodeError as e:
            _err(f"error: {e}")
            return EXIT_FAILED
        if stopped is None:
            print("no Ray node started by `pan2-render node start` is recorded on this machine; nothing was stopped "
                  "(a node started with plain `ray start` is stopped with `ray stop`, which ends every Ray process "
                  "of this user here)")
            return EXIT_OK
        record, n = stopped
        print(f"Ray node stopped (GCS at {record.gcs_address}, {n} process(es)); other Ray clusters on this "
              f"machine were not touched")
        return EXIT_OK
    if args.cpu_gpus is not None and args.cpu_gpus < 1:
        _err(f"error: --cpu-gpus {args.cpu_gpus}: must be >= 1")
        return EXIT_USAGE
    if not 1 <= args.port <= 65535:
        _err(f"error: --port {args.port}: must be a TCP port, 1-65535")
        return EXIT_USAGE
    try:
        if (up := node.running()) is not None:  # before anything else is said: one line
            print(node.NodeAlreadyUp(up))
            return EXIT_OK
        gpus, cuda, why = local_gpus(args.cpu_gpus, max_gpus=1)
        if why:
            print(why.replace("running on CPU", "the node runs on CPU"))
        record = node.start(gpus=gpus, port=args.port, env=env)
    except node.NodeError as e:
        _err(f"error: {e}")
        return EXIT_FAILED
    kind = "GPU(s)" if cuda and args.cpu_gpus is None else "logical GPU(s) on CPU"
    print(f"Ray node up on this machine: {gpus} {kind}, GCS at {record.gcs_address}.\nBatches run here join it "
          f"(`{_cmd('run', 'FILE', '--out', 'DIR')}`; `--address local` runs without it). `{_cmd('node', 'stop')}` "
          f"ends it, and only it.")
    return EXIT_OK


# ====================================================================== run
def cmd_run(args: argparse.Namespace) -> int:
    if (err := _check_cluster_args(args)) is not None:
        return err
    overrides = Overrides(sets=tuple(args.sets), sweeps=tuple(args.sweeps))
    if (args.batch is None) == (args.from_path is None):
        _err("error: run takes a batch file or --from PATH (a params.json, a video made by pan2-render, or a "
             "job folder), one of the two")
        return EXIT_USAGE
    if args.from_path is not None:
        from pan2render.runner.cli_from import load_from_or_report  # noqa: PLC0415

        batch = load_from_or_report(args.from_path, overrides, check_model=not args.dry_run, err=_err)
    else:
        batch = load_batch_or_report(args.batch, overrides, check_model=not args.dry_run)
    if batch is None:
        return EXIT_USAGE  # nothing written: the out folder is created only after validation
    out: Path = args.out
    if (code := check_out_folder(out, batch, args)) is not None:
        return code
    if args.dry_run:
        _print_plan(batch, out, args)
        print(f"dry run: nothing written to {out}")
        return EXIT_OK
    from pan2render.runner.farm.commands import hand_to_farm  # noqa: PLC0415

    if (code := hand_to_farm(args, batch, overrides)) is not None:
        return code
    from pan2render.runner.session import BatchRequest, BatchSession  # noqa: PLC0415

    request = BatchRequest(out_dir=out, batch=batch, overrides=overrides, retries=args.retries, prune=args.prune)
    try:
        session = BatchSession.record(request, stream=sys.stderr,
                                      title=f"run {args.batch or '--from ' + str(args.from_path)} "
                                            f"{' '.join(overrides.flags())}".rstrip())
    except errors.UnrecordedWork as e:  # refused before a byte is written (no log either)
        _err(f"error: {e}")
        return EXIT_ENVIRONMENT
    with session:
        return _drive(args, session)


def cmd_resume(args: argparse.Namespace) -> int:
    if (err := _check_cluster_args(args)) is not None:
        return err
    out: Path = args.dir
    if not (out / LEDGER_NAME).is_file():
        _err(f"error: {out} has no {LEDGER_NAME}: nothing to resume (if a batch ran there, `{_cmd('repair', out)}` "
             f"rebuilds it from the job folders; else start with `{_cmd('run', 'BATCH', '--out', out)}`)")
        return EXIT_USAGE
    from pan2render.runner.session import BatchSession  # noqa: PLC0415

    with FolderLock(out):
        if not _holds_a_batch(out, "nothing was resumed"):  # checked read-only: an empty file stays so
            return EXIT_USAGE
    with BatchSession.reopen(out, stream=sys.stderr, title=f"resume {out}: batch {{batch}}") as session:
        return _drive(args, session)


def _holds_a_batch(out: Path, consequence: str) -> bool:
    """Does DIR's ledger hold a recorded batch? If not, say so (a damaged one raises LedgerError)."""
    ledger = Ledger.open_readonly(out)
    try:
        if ledger.has_batch():
            return True
    finally:
        ledger.close()
    _err(f"error: the ledger {ledger.path} holds no batch (the file was emptied, or the batch was never "
          f"recorded); {consequence}. If the batch had run, `{_cmd('repair', out)}` rebuilds the ledger from its "
          f"backup and the artifacts; if it never ran, start it with `{_cmd('run', 'BATCH', '--out', out)}`")
    return False


def cmd_repair(args: argparse.Namespace) -> int:
    from pan2render.runner.repair import repair  # noqa: PLC0415

    out: Path = args.dir
    if not out.is_dir():
        _err(f"error: {out} is not a folder; nothing to repair")
        return EXIT_USAGE
    batch = None
    if args.batch is not None:
        batch = load_batch_or_report(args.batch, Overrides(), check_model=True)
        if batch is None:
            return EXIT_USAGE
    with FolderLock(out):
        summary = repair(out, batch=batch, retries=args.retries, say=_err)
    _err(summary.describe())
    return EXIT_OK if summary.jobs else EXIT_FAILED


def _drive(args: argparse.Namespace, session: Any) -> int:
    """Serve the session's batch in this process (the scheduler serving one batch): its jobs
    prepared, Ray started or joined only when one of them needs rendering."""
    from pan2render.runner.cluster import ClusterConnectError  # noqa: PLC0415
    from pan2render.runner.driver import Driver, DriverConfig  # noqa: PLC0415
    from pan2render.runner.executor import make_executor  # noqa: PLC0415
    from pan2render.runner.session import warn_if_no_backup  # noqa: PLC0415

    out, ledger, log, ids = session.out_dir, session.ledger, session.log, session.job_ids
    config = DriverConfig(retries=args.retries, progress=not args.no_progress,
                          group_start_timeout_s=args.group_start_timeout, cluster_wait_s=args.cluster_wait,
                          stall_timeout_s=args.stall_timeout)
    if not ids:
        log.line(f"error: the ledger {ledger.path} holds no jobs; nothing was run")
        return EXIT_USAGE
    jobs = ledger.jobs(ids)
    if session.prepare(retries=args.retries):
        # Every job done and its video intact: no workers needed, so Ray never starts.
        log.line(f"all {len(ids)} job(s) already done in {out}")
        return EXIT_OK
    from pan2render.runner.session import checkpoint_problems  # noqa: PLC0415

    if broken := checkpoint_problems([j.spec for j in jobs if j.state is not JobState.DONE]):
        # Every job would fail its load the same way: one message, no job started or charged.
        log.line(f"error: {errors.broken_checkpoints(broken, resume=_cmd('resume', out))}")
        return EXIT_ENVIRONMENT
    asked = time.time()
    try:
        executor = make_executor(address=_address(args), cpu_gpus=args.cpu_gpus,
                                 max_gpus=max(j.spec.gpus for j in jobs), say=log.line, note=log.file_line)
    except SystemExit as e:
        # While ray.init starts or joins Ray, its own SIGTERM handler stands in for ours and ends
        # the process with sys.exit: the same stop as any other, with its message.
        _stopped_by.append(signal.Signals.SIGTERM.name)
        raise KeyboardInterrupt(signal.Signals.SIGTERM.name) from e
    except ClusterConnectError as e:
        log.line(f"error: {e}")
        return EXIT_USAGE
    log.line(f"start-up: {executor.cluster} ready at {timeline.stamp()}, {time.time() - asked:.2f} s after "
             f"it was asked for (start-up stamps are seconds since the command started)")
    # ray.init installs its own SIGTERM handler, which aborts the process: ours again.
    _install_stop_handlers()
    try:
        if executor.worker_logs:
            log.line(f"Ray's worker logs: {executor.worker_logs}")
        session.note_run(command=args.command, gpus=executor.total_gpus())
        progress = RunProgress(log=log, live=config.progress and log.is_terminal)
        summary = _run_with_report(out, log, lambda on_job_end: Driver(
            out_dir=out, ledger=ledger, executor=executor, config=config, progress=progress,
            on_job_end=on_job_end).run(ids, prepared=True))
    finally:
        executor.shutdown()
    _print_summary(out, summary, log)
    warn_if_no_backup(ledger, log)
    return summary.exit_code


def _run_with_report(out: Path, log: RunLog, run: Callable[[Callable[[], None]], RunSummary]) -> RunSummary:
    """Run the driver, keeping DIR/index.html current as jobs end and writing it once more at the
    end, however the run ends."""
    from pan2render.runner.report import ReportUpdater  # noqa: PLC0415

    report = ReportUpdater(out, say=log.line)
    try:
        return run(report.request)
    finally:
        if (path := report.close()) is not None:
            log.line(f"report: {path}")


def _address_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the cluster address (--address or RAY_ADDRESS) as written, before
    anything is recorded; None if it has a form Ray takes."""
    from pan2render.runner.cluster import RAY_CLIENT_SCHEME, parse_gcs_address  # noqa: PLC0415

    address = _address(args)
    if address is None or address in ("auto", LOCAL_ADDRESS):
        return None
    rest = address.removeprefix(RAY_CLIENT_SCHEME)
    if "://" not in rest and parse_gcs_address(rest) is not None:
        return None
    given = f"--address {address}" if args.address else f"RAY_ADDRESS={address} (set in the environment)"
    return (f"{given}: not a Ray cluster address; allowed: auto, local, HOST:PORT (the head's GCS, e.g. "
            f"10.0.0.5:6379) or ray://HOST:PORT (a Ray client)")


def _address(args: argparse.Namespace) -> str | None:
    """The cluster to join: --address, else RAY_ADDRESS as Ray documents it (set on a cluster's
    nodes, it means "join this cluster", never "start one"), else None (start a local one)."""
    return args.address or os.environ.get("RAY_ADDRESS") or None


def _print_summary(out: Path, s: RunSummary, log: RunLog) -> None:
    log.line(f"{len(s.done)} done, {len(s.failed)} failed in {s.seconds:.1f} s "
             f"({s.groups_created} worker group(s) started); see `{_cmd('status', out)}`")
    for jid in s.failed:
        log.line(f"  failed: {jid}  (`{_cmd('show', out, jid)}` has its traceback)")


# ====================================================================== validate / dry run
def cmd_validate(args: argparse.Namespace) -> int:
    batch = load_batch_or_report(args.batch, Overrides(sets=tuple(args.sets), sweeps=tuple(args.sweeps)), check_model=False)
    if batch is None:
        return EXIT_USAGE
    _print_plan(batch, args.out, args)
    from pan2render.runner.session import checkpoint_problems  # noqa: PLC0415

    broken = checkpoint_problems(batch.jobs)
    for model, problems in broken.items():
        print(f"checkpoint {model}: {len(problems)} problem(s); `run` will refuse it:")
        print("\n".join(f"  {p}" for p in problems))
    if broken:
        print(f"{args.batch}: the batch is valid ({len(batch.jobs)} job(s)), but its checkpoint cannot be loaded "
              f"(exit {EXIT_CHECKPOINT})")
        return EXIT_CHECKPOINT
    models = sorted({j.model for j in batch.jobs})
    print(f"{args.batch}: valid, {len(batch.jobs)} job(s); checkpoint: "
          + ", ".join("the embedded tiny model" if m == TINY_MODEL else f"{m}: its configs and weight files are "
                      f"there (the weights themselves are read by `run`)" for m in models))
    return EXIT_OK


def _print_plan(batch: Batch, out: Path | None, args: argparse.Namespace) -> None:
    from pan2render.runner.estimates import CPU, CUDA, History, history_folders, plan  # noqa: PLC0415
    from pan2render.runner.views import format_estimate, format_plan  # noqa: PLC0415

    done: set[str] = set()
    if out is not None and (out / LEDGER_NAME).is_file():
        ledger = Ledger.open_readonly(out)
        done = {j.id for j in ledger.jobs() if j.state is JobState.DONE}
        ledger.close()
    todo = [j for j in batch.jobs if j.job_id not in done]
    max_gpus = max((j.gpus for j in batch.jobs), default=1)
    from pan2render.runner.executor import local_gpus  # noqa: PLC0415

    if getattr(args, "address", None) not in (None, LOCAL_ADDRESS):
        gpus, device, note = max_gpus, CUDA, "the cluster's GPU count is known only once joined: assumed"
    else:
        gpus, cuda, _why = local_gpus(getattr(args, "cpu_gpus", None), max_gpus=max_gpus)
        on_gpus = bool(cuda) and gpus == cuda
        device, note = (CUDA, "GPUs found on this machine") if on_gpus else (CPU, "logical GPUs on this CPU")
    the_plan = plan(todo, gpus=gpus, device=device, history=History.from_folders(history_folders(out)))
    print(format_plan(batch.jobs, done=done, the_plan=the_plan))
    print(f"{len(todo)} job(s) to render, {len(batch.jobs) - len(todo)} done already")
    print(format_estimate(the_plan, gpus_note=note))


def load_batch_or_report(batch_path: Path, overrides: Overrides, *, check_model: bool) -> Batch | None:
    """The batch validated, or None with every problem printed (file:line, field, what is allowed)."""
    from pan2render.jobs.batch import load_batch  # noqa: PLC0415

    try:
        return load_batch(batch_path, overrides=overrides, check_model=check_model, say=_err)
    except BatchValidationError as e:
        _err(f"error: {batch_path}: {len(e.problems)} problem(s); nothing was run:")
        for problem in e.problems:
            _err(f"  {problem}")
        return None


# ====================================================================== status / show
def cmd_status(args: argparse.Namespace) -> int:
    from pan2render.runner.views import format_status, holder, status_document  # noqa: PLC0415

    if not (args.dir / LEDGER_NAME).is_file():
        _err(f"error: no ledger at {args.dir / LEDGER_NAME}: {args.dir} is not a pan2-render output folder")
        return EXIT_USAGE
    if not _holds_a_batch(args.dir, "there is no status to show"):
        return EXIT_USAGE
    while True:
        live = holder(args.dir) is not None  # before the ledger: a run that ends meanwhile reads as done
        ledger = Ledger.open_readonly(args.dir)
        try:
            if args.json:
                doc, code = status_document(args.dir, ledger)
                text = json.dumps(doc, indent=1)
            else:
                text, code = format_status(args.dir, ledger)
        finally:
            ledger.close()
        if args.watch is None:
            print(text)
            return code
        if sys.stdout.isatty():
            sys.stdout.write("\x1b[H\x1b[J")  # redraw from the top of the screen
        print(f"{text}\n(every {args.watch:g} s; Ctrl-C to stop watching, the run carries on)", flush=True)
        if not live:
            return code
        time.sleep(args.watch)


def cmd_show(args: argparse.Namespace) -> int:
    from pan2render.runner.views import JobNotFound, find_job, format_show  # noqa: PLC0415

    if not (args.dir / LEDGER_NAME).is_file():
        _err(f"error: no ledger at {args.dir / LEDGER_NAME}: {args.dir} is not a pan2-render output folder")
        return EXIT_USAGE
    ledger = Ledger.open_readonly(args.dir)
    try:
        try:
            job = find_job(ledger, args.job)
        except JobNotFound as e:
            _err(f"error: {e}")
            return EXIT_USAGE
        print(format_show(args.dir, ledger, job))
        return EXIT_FAILED if job.state is JobState.FAILED else EXIT_OK
    finally:
        ledger.close()


def cmd_report(args: argparse.Namespace) -> int:
    from pan2render.runner.report import open_in_browser, write_report  # noqa: PLC0415

    if not (args.dir / LEDGER_NAME).is_file():
        _err(f"error: {args.dir} has no {LEDGER_NAME}; nothing to report")
        return EXIT_USAGE
    if not _holds_a_batch(args.dir, "there is nothing to report"):
        return EXIT_USAGE
    path = write_report(args.dir)
    print(path)
    if args.open and not open_in_browser(path):
        _err(f"no web browser found; open {path.resolve().as_uri()}")
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    from pan2render.runner.compare import comparisons, format_comparisons  # noqa: PLC0415

    if not (args.dir / LEDGER_NAME).is_file():
        _err(f"error: {args.dir} has no {LEDGER_NAME}; nothing to compare")
        return EXIT_USAGE
    ledger = Ledger.open_readonly(args.dir)
    try:
        rows = comparisons(args.dir, ledger, say=None if args.json else lambda line: _err(line))
    finally:
        ledger.close()
    print(json.dumps([r.to_json() for r in rows], indent=2) if args.json else format_comparisons(rows))
    return EXIT_OK


def cmd_calibrate(args: argparse.Namespace) -> int:
    import numpy as np  # noqa: PLC0415
    from PIL import Image  # noqa: PLC0415

    from pan2render.models.calibration import calibrate, store_calibration  # noqa: PLC0415
    from pan2render.models.pipeline import PAN2Pipeline, PAN2PipelineConfig  # noqa: PLC0415

    try:
        preset = list_presets()[args.preset]
    except KeyError:
        _err(f"pan2-render calibrate: no preset {args.preset!r}; `pan2-render presets` lists them")
        return EXIT_USAGE
    pipe = PAN2Pipeline.from_pretrained(args.model, PAN2PipelineConfig(device=args.device))
    image = None if args.image is None else np.asarray(Image.open(args.image).convert("RGB"))
    job = {k: preset[k] for k in ("height", "width", "frames", "steps", "guidance", "flow_shift", "sampler")}
    cal = calibrate(pipe, prompt=args.prompt, negative_prompt=preset.get("negative_prompt", ""), image=image,
                    seed=args.seed, **job)
    path = store_calibration(pipe.model_id, cal, conditioned=image is not None)
    print(f"{pipe.model_id}: {cal.steps} steps, cond ratios {min(cal.cond[1:]):.4f}..{max(cal.cond[1:]):.4f}"
          + (f", uncond {min(cal.uncond[1:]):.4f}..{max(cal.uncond[1:]):.4f}" if cal.uncond else "") + f" -> {path}")
    return EXIT_OK


def cmd_presets(args: argparse.Namespace) -> int:
    from pan2render.runner.views import table  # noqa: PLC0415

    if args.name is not None:
        try:
            print(preset_text(args.name), end="")
        except LookupError as exc:
            _err(f"pan2-render presets: {exc.args[0]}")
            return EXIT_USAGE
        return EXIT_OK
    keys = ["height", "width", "frames", "fps", "steps", "guidance", "flow_shift", "sampler", "gpus", "crf"]
    rows = [[name, *(str(values.get(k, "")) for k in keys), str(values.get("description", ""))]
            for name, values in sorted(list_presets().items())]
    print(table(["preset", *keys, "description"], rows))
    print("`pan2-render presets NAME` prints one. Use one with `preset: NAME` in a batch or `--set preset=NAME`; "
          "any job field overrides it.")
    return EXIT_OK


# ====================================================================== helpers
def _err(text: str) -> None:
    # Text the terminal's encoding cannot show (a path with bytes that are not UTF-8) is escaped,
    # never lost with the rest of the message.
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    text = text.encode(encoding, "backslashreplace").decode(encoding, "replace")
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # the terminal went away (SIGHUP)
        pass


def _cmd(*words: str | Path) -> str:
    """A pan2-render command to paste, as this program can be called (see _me), shell-quoted."""
    return command(*words, program=_me())


def _me() -> str:
    """How to call this command again, as typed: ``pan2-render`` when that name on PATH is this
    program, else its full path (a venv that is not activated)."""
    exe = Path(sys.argv[0])
    if exe.name != "pan2-render":
        return "pan2-render"
    found = shutil.which("pan2-render")
    return "pan2-render" if found and Path(found).resolve() == exe.resolve() else str(exe.absolute())


def _check_cluster_args(args: argparse.Namespace) -> int | None:
    """Usage checks that need no cluster; all before anything is written."""
    problem = None
    if args.retries < 0:
        problem = f"--retries {args.retries}: must be >= 0"
    elif not args.group_start_timeout > 0:
        problem = f"--group-start-timeout {args.group_start_timeout}: must be > 0 seconds"
    elif not args.cluster_wait >= 0:
        problem = f"--cluster-wait {args.cluster_wait}: must be >= 0 seconds"
    elif not args.stall_timeout >= 0:
        problem = f"--stall-timeout {args.stall_timeout}: must be >= 0 seconds (0: no watchdog)"
    elif args.cpu_gpus is not None and args.cpu_gpus < 1:
        problem = f"--cpu-gpus {args.cpu_gpus}: must be >= 1"
    elif args.cpu_gpus is not None and _address(args) not in (None, LOCAL_ADDRESS):
        given = "--address" if args.address else f"RAY_ADDRESS={os.environ['RAY_ADDRESS']} (set in the environment)"
        problem = f"--cpu-gpus declares GPUs of a LOCAL cluster; it cannot be used with {given}"
    else:
        from pan2render.runner.cluster import ray_client_missing  # noqa: PLC0415

        problem = _address_problem(args) or ray_client_missing(_address(args))
    if problem is None and _address(args) and not getattr(args, "dry_run", False):
        from pan2render.runner.cluster import ClusterConnectError, probe_address  # noqa: PLC0415

        try:
            probe_address(_address(args))
        except ClusterConnectError as e:  # before the output folder exists
            problem = str(e)
    if problem is not None:
        _err(f"error: {problem}")
        return EXIT_USAGE
    return None


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_stopped_by: list[str] = []  # the stop signal received, for the closing message


def _on_stop_signal(signum: int, _frame: object) -> None:
    for s in _STOP_SIGNALS:  # one clean stop: later signals must not interrupt the clean-up
        signal.signal(s, signal.SIG_IGN)
    _stopped_by.append(signal.Signals(signum).name)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _install_stop_handlers() -> dict[int, Any]:
    """SIGTERM (kill, a scheduler) and SIGHUP (a dropped SSH session) stop a run the way Ctrl-C
    does: the running jobs go back to pending in the ledger and the Ray processes this run started
    are shut down. A signal ignored when we started stays ignored: under ``nohup`` a dropped SSH
    session must not stop the run. Returns the handlers replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, _on_stop_signal) for s in _STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN}


@contextlib.contextmanager
def _stop_signals_interrupt() -> Iterator[None]:
    previous = _install_stop_handlers()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
