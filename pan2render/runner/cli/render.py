"""The commands that render: `run`, `resume`, `repair` and `node`, and the drive of one batch
through the scheduler on a cluster."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pan2render.jobs.ledger import LEDGER_NAME, FolderLock, JobState
from pan2render.jobs.overrides import Overrides
from pan2render.runner.cli.common import (
    EXIT_ENVIRONMENT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    check_out_folder,
    cmd,
    holds_a_batch,
    install_stop_handlers,
    load_batch_or_report,
    print_error,
    stopped_by,
)
from pan2render.runner.cli.reading import done_ids, print_plan
from pan2render.runner.cluster.choose import LOCAL_ADDRESS
from pan2render.runner.protocol import timeline
from pan2render.runner.serve import errors
from pan2render.runner.serve.config import ServingConfig, SettingError, settings_from_args
from pan2render.runner.serve.progress import RunLog, RunProgress

# The driver, the groups and the workers import torch (seconds); commands that read a batch or a
# ledger (--version, presets, validate, show) do without them, so they are imported on use.
if TYPE_CHECKING:
    from pan2render.runner.serve.driver import RunSummary
    from pan2render.runner.serve.metrics import RunCollector


NODE_PORT = 6379  # Ray's default head port: `--address auto` and `ray status` find it as usual


def cmd_node(args: argparse.Namespace) -> int:
    """A Ray node on this machine that runs join by default: it stays up between batches, so a run
    joins it instead of starting Ray (~2 s against ~7 s on an H200 host, before the first video).
    A run's GPU workers are still its own. `node stop` ends that node alone (runner/cluster/node.py)."""
    from pan2render.runner.cluster import node  # imports ray's scripts only when it starts one
    from pan2render.runner.cluster.choose import local_gpus

    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    if args.action == "stop":
        try:
            stopped = node.stop()
        except node.NodeError as e:
            print_error(f"error: {e}")
            return EXIT_FAILED
        if stopped is None:
            print("no Ray node started by `pan2-render node start` is recorded on this machine; nothing was stopped "
                  "(a node started with plain `ray start` is stopped with Ray's own stop command, which ends every "
                  "Ray process of this user here)")
            return EXIT_OK
        record, n = stopped
        print(f"Ray node stopped (GCS at {record.gcs_address}, {n} process(es)); other Ray clusters on this "
              f"machine were not touched")
        return EXIT_OK
    if args.cpu_gpus is not None and args.cpu_gpus < 1:
        print_error(f"error: --cpu-gpus {args.cpu_gpus}: must be >= 1")
        return EXIT_USAGE
    if not 1 <= args.port <= 65535:
        print_error(f"error: --port {args.port}: must be a TCP port, 1-65535")
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
        print_error(f"error: {e}")
        return EXIT_FAILED
    kind = "GPU(s)" if cuda and args.cpu_gpus is None else "logical GPU(s) on CPU"
    print(f"Ray node up on this machine: {gpus} {kind}, GCS at {record.gcs_address}.\nBatches run here join it "
          f"(`{cmd('run', 'FILE', '--out', 'DIR')}`; `--address local` runs without it). `{cmd('node', 'stop')}` "
          f"ends it, and only it.")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    if (err := _check_cluster_args(args)) is not None:
        return err
    overrides = Overrides(sets=tuple(args.sets), sweeps=tuple(args.sweeps))
    if (args.batch is None) == (args.from_path is None):
        print_error("error: run takes a batch file or --from PATH (a params.json, a video made by pan2-render, or a "
                    "job folder), one of the two")
        return EXIT_USAGE
    if args.from_path is not None:
        from pan2render.runner.cli.run_from import load_from_or_report

        batch = load_from_or_report(args.from_path, overrides, check_model=not args.dry_run, err=print_error)
    else:
        batch = load_batch_or_report(args.batch, overrides, check_model=not args.dry_run)
    if batch is None:
        return EXIT_USAGE  # nothing written: the out folder is created only after validation
    out: Path = args.out
    if (code := check_out_folder(out, batch, args)) is not None:
        return code
    if args.dry_run:
        print_plan(batch, out, args)
        print(f"dry run: nothing written to {out}")
        return EXIT_OK
    from pan2render.runner.serve.session import model_folder_problems

    if model_folder_problems(batch.jobs) and (broken := model_folder_problems(_not_done(batch.jobs, out))):
        # As the farm refuses it (submit): exit 3, nothing recorded. `validate` says so with exit 5.
        print_error(f"error: {errors.broken_checkpoints(broken, resume=None, recorded=False)}")
        return EXIT_ENVIRONMENT
    from pan2render.runner.cli.batches import hand_to_farm

    if (code := hand_to_farm(args, batch)) is not None:
        return code
    from pan2render.runner.serve.session import BatchRequest, BatchSession

    request = BatchRequest(out_dir=out, batch=batch, overrides=overrides, retries=args.retries, prune=args.prune)
    try:
        session = BatchSession.record(request, stream=sys.stderr,
                                      title=f"run {args.batch or '--from ' + str(args.from_path)} "
                                            f"{' '.join(overrides.flags())}".rstrip())
    except errors.UnrecordedWork as e:  # refused before a byte is written (no log either)
        print_error(f"error: {e}")
        return EXIT_ENVIRONMENT
    with session:
        return _drive(args, session)


def _not_done(jobs: list[Any], out: Path) -> list[Any]:
    """The jobs ``out``'s ledger does not hold done (all of them where it cannot be read: the run
    that follows says why)."""
    try:
        done = done_ids(out)
    except Exception:
        return jobs
    return [j for j in jobs if j.job_id not in done]


def cmd_resume(args: argparse.Namespace) -> int:
    if (err := _check_cluster_args(args)) is not None:
        return err
    out: Path = args.dir
    if not (out / LEDGER_NAME).is_file():
        print_error(f"error: {out} has no {LEDGER_NAME}: nothing to resume (if a batch ran there, "
                    f"`{cmd('repair', out)}` rebuilds it from the job folders; else start with "
                    f"`{cmd('run', 'BATCH', '--out', out)}`)")
        return EXIT_USAGE
    from pan2render.runner.serve.session import BatchSession

    with FolderLock(out):
        if not holds_a_batch(out, "nothing was resumed"):  # checked read-only: an empty file stays so
            return EXIT_USAGE
    with BatchSession.reopen(out, stream=sys.stderr, title=f"resume {out}: batch {{batch}}") as session:
        _reuse_cpu_gpus(args, session)
        return _drive(args, session)


def _reuse_cpu_gpus(args: argparse.Namespace, session: Any) -> None:
    """`resume` without --cpu-gpus, on a cluster of its own: the logical GPUs of the folder's last
    run (a batch of 2-GPU jobs run with --cpu-gpus 2 must not resume on 1), said so. A run before
    the count was recorded, on a machine without CUDA, ran on logical GPUs: its GPU count."""
    if args.cpu_gpus is not None or _address(args) not in (None, LOCAL_ADDRESS):
        return
    runs = session.ledger.get_meta("runs", []) or []
    if not runs:
        return
    last = runs[-1]
    n = last.get("cpu_gpus")
    if n is None and "cpu_gpus" not in last and last.get("gpus"):
        from pan2render.runner.cluster.devices import cuda_gpu_count

        n = None if cuda_gpu_count() else int(last["gpus"])
    if n:
        args.cpu_gpus = int(n)
        session.log.line(f"resume: the last run in {session.out_dir} ({last.get('command', 'run')}) had {n} logical "
                         f"GPU(s): resuming on as many (--cpu-gpus {n}; give --cpu-gpus N for another count)")


def cmd_repair(args: argparse.Namespace) -> int:
    from pan2render.runner.serve.repair import repair

    out: Path = args.dir
    if not out.is_dir():
        print_error(f"error: {out} is not a folder; nothing to repair")
        return EXIT_USAGE
    batch = None
    if args.batch is not None:
        batch = load_batch_or_report(args.batch, Overrides(), check_model=True)
        if batch is None:
            return EXIT_USAGE
    with FolderLock(out):
        summary = repair(out, batch=batch, retries=args.retries, say=print_error)
    print_error(summary.describe())
    return EXIT_OK if summary.jobs else EXIT_FAILED


def _drive(args: argparse.Namespace, session: Any) -> int:
    """Serve the session's batch in this process (the scheduler serving one batch): its jobs
    prepared, Ray started or joined only when one of them needs rendering; ``--metrics-port``: its
    metrics served meanwhile."""
    out, ledger, log, ids = session.out_dir, session.ledger, session.log, session.job_ids
    config = settings_from_args(ServingConfig, args, progress=not args.no_progress)
    if not ids:
        log.line(f"error: the ledger {ledger.path} holds no jobs; nothing was run")
        return EXIT_USAGE
    jobs = ledger.jobs(ids)
    # `run` renders its batch, jobs cancelled before included; `resume` leaves a cancel as it is
    # unless asked (--cancelled).
    if session.prepare(retries=args.retries, revive_cancelled=getattr(args, "cancelled", True)):
        # Every job done and its video intact: no workers needed, so Ray never starts.
        log.line(f"all {len(ids)} job(s) already done in {out}")
        return EXIT_OK
    from pan2render.runner.serve.session import model_folder_problems

    if broken := model_folder_problems([j.spec for j in jobs if j.state is not JobState.DONE]):
        # Every job would fail its load the same way: one message, no job started or charged.
        log.line(f"error: {errors.broken_checkpoints(broken, resume=cmd('resume', out))}")
        return EXIT_ENVIRONMENT
    metrics = None
    if args.metrics_port:
        from pan2render.runner.serve.metrics import RunCollector, serve_run_metrics

        metrics = RunCollector(out, ids, started_at=timeline.process_started_at())
        try:
            stop_metrics = serve_run_metrics(args.metrics_port, metrics)
        except OSError as e:
            log.line(f"error: --metrics-port {args.metrics_port}: 127.0.0.1:{args.metrics_port} cannot be served "
                     f"({e.strerror}); choose another port (nothing was rendered: `{cmd('resume', out)}` starts it)")
            return EXIT_USAGE
        log.line(f"metrics: http://127.0.0.1:{args.metrics_port}/metrics")
    try:
        return _render(args, session, config, jobs, metrics)
    finally:
        if metrics is not None:
            stop_metrics()


def _render(args: argparse.Namespace, session: Any, config: ServingConfig, jobs: list[Any],
            metrics: RunCollector | None) -> int:
    """Start Ray (or join it) and run the driver over the session's prepared batch."""
    from pan2render.runner.cluster.choose import make_executor
    from pan2render.runner.cluster.ray_cluster import ClusterConnectError
    from pan2render.runner.serve.driver import Driver
    from pan2render.runner.serve.session import warn_if_no_backup

    out, ledger, log, ids = session.out_dir, session.ledger, session.log, session.job_ids
    asked = time.time()
    try:
        executor = make_executor(address=_address(args), cpu_gpus=args.cpu_gpus,
                                 max_gpus=max(j.spec.gpus for j in jobs), say=log.line, note=log.file_line)
    except SystemExit as e:
        # While ray.init starts or joins Ray, its own SIGTERM handler stands in for ours and ends
        # the process with sys.exit: the same stop as any other, with its message.
        stopped_by.append(signal.Signals.SIGTERM.name)
        raise KeyboardInterrupt(signal.Signals.SIGTERM.name) from e
    except ClusterConnectError as e:
        log.line(f"error: {e}")
        return EXIT_USAGE
    try:  # from here on, however the run ends, the executor shuts down what it started
        log.line(f"start-up: {executor.cluster} ready at {timeline.stamp()}, {time.time() - asked:.2f} s after "
                 f"it was asked for (start-up stamps are seconds since the command started)")
        # ray.init installs its own SIGTERM handler, which aborts the process: ours again.
        install_stop_handlers()
        if executor.worker_logs:
            log.line(f"Ray's worker logs: {executor.worker_logs}")
        session.note_run(command=args.command, gpus=executor.total_gpus(), cpu_gpus=args.cpu_gpus)
        from pan2render.runner.views.eta import BatchEta

        eta = BatchEta(out, ids, gpus=executor.total_gpus())
        progress = RunProgress(log=log, live=config.progress and log.is_terminal, eta=lambda: eta.seconds(ledger))
        if metrics is not None:
            metrics.progress, metrics.gpus = progress, executor.total_gpus()
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
    from pan2render.runner.views.report import ReportUpdater

    report = ReportUpdater(out, say=log.line)
    try:
        return run(report.request)
    finally:
        if (path := report.close()) is not None:
            log.line(f"report: {path}")


def _address_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the cluster address (--address or RAY_ADDRESS) as written, before
    anything is recorded; None if it has a form Ray takes."""
    from pan2render.runner.cluster.ray_cluster import RAY_CLIENT_SCHEME, parse_gcs_address

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
    # The batch's own seconds, then the command's: Ray's start and the report are in the second.
    log.line(f"{len(s.done)} done, {len(s.failed)} failed in {s.seconds:.1f} s "
             f"({time.time() - timeline.process_started_at():.1f} s since the command started; "
             f"{s.groups_created} worker group(s) started); see `{cmd('status', out)}`")
    for jid in s.failed:
        log.line(f"  failed: {jid}  (`{cmd('show', out, jid)}` has its traceback)")


def _settings_problem(args: argparse.Namespace) -> str | None:
    try:
        settings_from_args(ServingConfig, args)
    except SettingError as e:
        return str(e)
    return None


def _check_cluster_args(args: argparse.Namespace) -> int | None:
    """Usage checks that need no cluster; all before anything is written."""
    problem = _settings_problem(args)
    if problem is None and args.cpu_gpus is not None and args.cpu_gpus < 1:
        problem = f"--cpu-gpus {args.cpu_gpus}: must be >= 1"
    elif problem is None and not 0 <= args.metrics_port <= 65535:
        problem = f"--metrics-port {args.metrics_port}: must be a TCP port, 1-65535 (0: no metrics)"
    elif problem is None and args.cpu_gpus is not None and _address(args) not in (None, LOCAL_ADDRESS):
        given = "--address" if args.address else f"RAY_ADDRESS={os.environ['RAY_ADDRESS']} (set in the environment)"
        problem = f"--cpu-gpus declares GPUs of a LOCAL cluster; it cannot be used with {given}"
    elif problem is None:
        from pan2render.runner.cluster.ray_cluster import ray_client_missing

        problem = _address_problem(args) or ray_client_missing(_address(args))
    if problem is None and _address(args) and not getattr(args, "dry_run", False):
        from pan2render.runner.cluster.ray_cluster import ClusterConnectError, probe_address

        try:
            probe_address(_address(args))
        except ClusterConnectError as e:  # before the output folder exists
            problem = str(e)
    if problem is not None:
        print_error(f"error: {problem}")
        return EXIT_USAGE
    return None
