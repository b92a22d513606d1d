"""``pan2-render``: run / resume / status / validate / report.

Exit codes: 0 every job done, 1 some job failed, 2 invalid input or usage (nothing written),
3 the environment failed (disk full, permission, damaged ledger, lost cluster: one paragraph on the
terminal, the traceback in DIR/_logs/), 130 interrupted.
Environment (for tests and debugging, not user settings):
    PAN2_RENDER_PIPELINE  "module:callable(model, device)" that builds the pipeline in each worker
    PAN2_RENDER_FAULTS    JSON test hooks for the workers (see RenderWorker._maybe_crash/_fault)
    PAN2_RENDER_EXECUTOR  "local": run jobs in this process (LocalExecutor), no Ray; for tests of the
                          CLI's behaviour around the driver (ledger, disk, messages)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pan2render.jobs import disk
from pan2render.jobs.ledger import LEDGER_NAME, FolderLock, FolderLockedError, JobRecord, JobState, Ledger
from pan2render.jobs.spec import Batch, BatchValidationError, JobSpec
from pan2render.runner import errors
from pan2render.runner.driver import Driver, DriverConfig, RunSummary, prepare_jobs
from pan2render.runner.groups import (  # ray is imported only on use
    ClusterConnectError,
    Executor,
    LocalExecutor,
    RayExecutor,
)
from pan2render.runner.stages import estimated_bytes
from pan2render.runner.worker import DEFAULT_PIPELINE_FACTORY, WorkerConfig

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT = 0, 1, 2, 3


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # argparse exits 2 on usage errors
    try:
        return int(args.func(args))
    except FolderLockedError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ClusterConnectError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        where = getattr(args, "out", None) or getattr(args, "dir", None) or "DIR"
        print(f"\ninterrupted; finished stages are kept: `pan2-render resume {where}` continues",
              file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - never a traceback on the terminal: one paragraph + a log
        folder = getattr(args, "out", None) or getattr(args, "dir", None)
        log = errors.write_log(folder, traceback.format_exc())
        print(f"error: {errors.explain(e, folder=folder)}"
              + (f"\n(details: {log})" if log is not None else ""), file=sys.stderr)
        return EXIT_ENVIRONMENT


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pan2-render", description="Render PAN2 / Wan2.2 video batches on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    def cluster_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--address", help="join this Ray cluster (e.g. ray://head:10001 or auto); "
                                          "default: start a local one")
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
        sp.add_argument("--no-progress", action="store_true", help="no progress bars (plain log lines)")

    r = sub.add_parser("run", help="render a batch into an output folder")
    r.add_argument("batch", type=Path)
    r.add_argument("--out", type=Path, required=True, metavar="DIR")
    r.add_argument("--dry-run", action="store_true", help="validate and list the jobs; write nothing")
    cluster_args(r)
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("resume", help="finish every unfinished or failed job of an output folder")
    s.add_argument("dir", type=Path)
    cluster_args(s)
    s.set_defaults(func=cmd_resume)

    st = sub.add_parser("status", help="where each job of an output folder stands")
    st.add_argument("dir", type=Path)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    v = sub.add_parser("validate", help="check a batch file and list its jobs")
    v.add_argument("batch", type=Path)
    v.set_defaults(func=cmd_validate)

    rep = sub.add_parser("report", help="write DIR/index.html (every video inline, sweep grids, errors); "
                                         "run and resume write it too")
    rep.add_argument("dir", type=Path)
    rep.add_argument("--open", action="store_true", help="open it in the default web browser")
    rep.set_defaults(func=cmd_report)

    fix = sub.add_parser("repair", help="rebuild a missing or damaged ledger from its backup and the artifacts")
    fix.add_argument("dir", type=Path)
    fix.add_argument("--batch", type=Path, help="the batch file, for jobs that left nothing on disk "
                                                "and are not in the backup")
    fix.add_argument("--retries", type=int, default=2, metavar="N", help="retry budget of rebuilt jobs")
    fix.set_defaults(func=cmd_repair)
    return p


# ---------------------------------------------------------------------- commands
def _load(batch_path: Path) -> Batch | None:
    from pan2render.jobs.batch import load_batch  # noqa: PLC0415

    try:
        return load_batch(batch_path)
    except BatchValidationError as e:
        print(f"error: {batch_path}: {len(e.problems)} problem(s); nothing was run:", file=sys.stderr)
        for problem in e.problems:
            print(f"  {problem}", file=sys.stderr)
        return None


def cmd_validate(args: argparse.Namespace) -> int:
    batch = _load(args.batch)
    if batch is None:
        return EXIT_USAGE
    _print_jobs(batch.jobs, done=set())
    print(f"{args.batch}: valid, {len(batch.jobs)} job(s)")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    if (err := _check_cluster_args(args)) is not None:
        return err
    batch = _load(args.batch)
    if batch is None:
        return EXIT_USAGE  # nothing written: the out folder is created only after validation
    out: Path = args.out
    if out.exists() and not out.is_dir():
        print(f"error: --out {out} is a file, not a folder; name a new or existing folder", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        done: set[str] = set()
        if (out / LEDGER_NAME).is_file():
            ledger = Ledger.open_readonly(out)
            done = {j.id for j in ledger.jobs() if j.state is JobState.DONE}
            ledger.close()
        _print_jobs(batch.jobs, done=done)
        print(f"dry run: {len(batch.jobs) - len(done & {j.job_id for j in batch.jobs})} job(s) would "
              f"render into {out}; nothing written")
        return EXIT_OK
    out.mkdir(parents=True, exist_ok=True)
    with FolderLock(out):
        try:
            ledger = Ledger.open(out)
        except Exception as e:  # noqa: BLE001 - told apart by errors.explain
            raise errors.NothingRecorded(e) from e
        try:
            previous = ledger.get_meta("batch") or {}
            try:
                added, present = ledger.record_batch(
                    {"path": batch.path, "model": batch.model, "preset": batch.preset,
                     "weights_files": batch.weights_files}, batch.jobs, retries=args.retries)
            except Exception as e:  # noqa: BLE001
                raise errors.NothingRecorded(e) from e
            _note_superseded(ledger, batch, set(added), previous.get("weights_files") or {})
            ids = [j.job_id for j in batch.jobs]
            _warn_if_short_of_space(out, [j for j in ledger.jobs(added)])
            n_done = sum(j.state is JobState.DONE for j in ledger.jobs(present))
            print(f"{out}: {len(added)} new job(s), {len(present)} already in the ledger "
                  f"({n_done} done, skipped unless their video is corrupt)", file=sys.stderr)
            return _drive(args, out, ledger, ids)
        finally:
            ledger.close()


def cmd_resume(args: argparse.Namespace) -> int:
    if (err := _check_cluster_args(args)) is not None:
        return err
    out: Path = args.dir
    if not (out / LEDGER_NAME).is_file():
        print(f"error: {out} has no {LEDGER_NAME}: nothing to resume (start with `pan2-render run "
              f"BATCH --out {out}`)", file=sys.stderr)
        return EXIT_USAGE
    with FolderLock(out):
        if not _holds_a_batch(out, "nothing was resumed"):  # checked read-only: an empty file stays so
            return EXIT_USAGE
        ledger = Ledger.open(out)
        try:
            _warn_if_short_of_space(out, [j for j in ledger.jobs() if j.state is not JobState.DONE])
            return _drive(args, out, ledger, [j.id for j in ledger.jobs()])
        finally:
            ledger.close()


def _holds_a_batch(out: Path, consequence: str) -> bool:
    """Does DIR's ledger hold a recorded batch? If not, say so (a damaged one raises LedgerError)."""
    ledger = Ledger.open_readonly(out)
    try:
        if ledger.has_batch():
            return True
    finally:
        ledger.close()
    print(f"error: the ledger {ledger.path} holds no batch (the batch was never recorded, or the file was "
          f"emptied); {consequence}. Start the batch with `pan2-render run BATCH --out {out}`, or if it had "
          f"run, `pan2-render repair {out}` rebuilds the ledger from its backup and the artifacts",
          file=sys.stderr)
    return False


def cmd_repair(args: argparse.Namespace) -> int:
    from pan2render.runner.repair import repair  # noqa: PLC0415

    out: Path = args.dir
    if not out.is_dir():
        print(f"error: {out} is not a folder; nothing to repair", file=sys.stderr)
        return EXIT_USAGE
    batch = None
    if args.batch is not None:
        batch = _load(args.batch)
        if batch is None:
            return EXIT_USAGE
    with FolderLock(out):
        summary = repair(out, batch=batch, retries=args.retries, say=lambda s: print(s, file=sys.stderr))
    print(summary.describe(), file=sys.stderr)
    return EXIT_OK if summary.jobs else EXIT_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    from pan2render.runner.report import format_table, job_statuses  # noqa: PLC0415

    try:
        if not _holds_a_batch(args.dir, "there is no status to show"):
            return EXIT_USAGE
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    ledger = Ledger.open_readonly(args.dir)
    try:
        rows = job_statuses(args.dir, ledger)
    finally:
        ledger.close()
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=1))
    else:
        print(format_table(rows))
    return EXIT_FAILED if any(r.state == "failed" or r.problem for r in rows) else EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from pan2render.runner.report import open_in_browser, write_report  # noqa: PLC0415

    if not (args.dir / LEDGER_NAME).is_file():
        print(f"error: {args.dir} has no {LEDGER_NAME}; nothing to report", file=sys.stderr)
        return EXIT_USAGE
    path = write_report(args.dir)
    print(path)
    if args.open and not open_in_browser(path):
        print(f"no web browser found; open {path.resolve().as_uri()}", file=sys.stderr)
    return EXIT_OK


# ---------------------------------------------------------------------- helpers
def _check_cluster_args(args: argparse.Namespace) -> int | None:
    if args.retries < 0:
        print(f"error: --retries {args.retries}: must be >= 0", file=sys.stderr)
        return EXIT_USAGE
    if not args.group_start_timeout > 0:
        print(f"error: --group-start-timeout {args.group_start_timeout}: must be > 0 seconds", file=sys.stderr)
        return EXIT_USAGE
    if not args.cluster_wait >= 0:
        print(f"error: --cluster-wait {args.cluster_wait}: must be >= 0 seconds", file=sys.stderr)
        return EXIT_USAGE
    if args.cpu_gpus is not None and args.cpu_gpus < 1:
        print(f"error: --cpu-gpus {args.cpu_gpus}: must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    if args.cpu_gpus is not None and _address(args):
        given = "--address" if args.address else f"RAY_ADDRESS={os.environ['RAY_ADDRESS']} (set in the environment)"
        print(f"error: --cpu-gpus declares GPUs of a LOCAL cluster; it cannot be used with {given}",
              file=sys.stderr)
        return EXIT_USAGE
    return None


def _address(args: argparse.Namespace) -> str | None:
    """The cluster to join: --address, else RAY_ADDRESS as Ray documents it (set on a cluster's
    nodes, it means "join this cluster", never "start one"), else None (start a local one)."""
    return args.address or os.environ.get("RAY_ADDRESS") or None


def _note_superseded(ledger: Ledger, batch: Batch, added: set[str], old_files: dict[str, Any]) -> None:
    """A new job that is an old one with other weights (same name, sweep values and model path):
    the checkpoint was replaced in place. Say so, in the ledger and here, naming the files."""
    def key(spec: JobSpec) -> str:
        return json.dumps([spec.name, spec.sweep, spec.model], sort_keys=True, default=str)

    old = {key(j.spec): j for j in ledger.jobs() if j.id not in added}
    changed = sorted(r for r in set(old_files) | set(batch.weights_files)
                     if old_files.get(r) != batch.weights_files.get(r))
    files = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    for spec in batch.jobs:
        prev = old.get(key(spec))
        if spec.job_id in added and prev is not None and prev.spec.weights != spec.weights:
            why = f"the weights in {spec.model} changed" + (f" ({files})" if files else "")
            ledger.log(prev.id, "superseded", f"by {spec.job_id}: {why}")
            print(f"{prev.id} is superseded by {spec.job_id}: {why}", file=sys.stderr)


def _warn_if_short_of_space(out: Path, jobs: list[JobRecord]) -> None:
    """Before starting: warn (only) when the unfinished jobs' artifacts may not fit. An estimate:
    each write is checked against its real size, and a full disk stops the batch cleanly."""
    need = sum(estimated_bytes(j.spec) for j in jobs)
    free = disk.free_bytes(out)
    if need + disk.HEADROOM_BYTES > free:
        print(f"warning: {len(jobs)} job(s) need about {need / 2**30:.2f} GiB in {out} but only "
              f"{free / 2**30:.2f} GiB is free; the batch will stop when the disk fills (`resume` "
              f"continues once space is freed)", file=sys.stderr)


def _print_jobs(jobs: list[JobSpec], *, done: set[str]) -> None:
    for j in jobs:
        mark = "done, skip" if j.job_id in done else "to render"
        print(f"  {j.job_id:55} {j.width}x{j.height}x{j.frames} {j.steps} steps  gpus {j.gpus}  "
              f"seed {j.seed}  [{mark}]")


def _drive(args: argparse.Namespace, out: Path, ledger: Ledger, ids: list[str]) -> int:
    """Run the jobs, keeping DIR/index.html current as they end and writing it once more at the
    end, however the run ends."""
    from pan2render.runner.report import ReportUpdater  # noqa: PLC0415

    report = ReportUpdater(out, say=lambda s: print(s, file=sys.stderr))
    try:
        return _drive_jobs(args, out, ledger, ids, on_job_end=report.request)
    finally:
        if (path := report.close()) is not None:
            print(f"report: {path}", file=sys.stderr)


def _drive_jobs(args: argparse.Namespace, out: Path, ledger: Ledger, ids: list[str], *,
                on_job_end: Callable[[], None]) -> int:
    config = DriverConfig(retries=args.retries, progress=not args.no_progress and sys.stderr.isatty(),
                          group_start_timeout_s=args.group_start_timeout, cluster_wait_s=args.cluster_wait)
    if not ids:
        print(f"error: the ledger {ledger.path} holds no jobs; nothing was run", file=sys.stderr)
        return EXIT_USAGE
    jobs = ledger.jobs(ids)
    prepare_jobs(out_dir=out, ledger=ledger, job_ids=ids, retries=args.retries,
                 say=lambda s: print(s, file=sys.stderr))
    if all(j.state is JobState.DONE for j in ledger.jobs(ids)):
        # Every job done and its video intact: no workers needed, so Ray never starts.
        print(f"all {len(ids)} job(s) already done in {out}", file=sys.stderr)
        return EXIT_OK
    executor = _make_executor(args, max_gpus=max(j.spec.gpus for j in jobs))
    try:
        driver = Driver(out_dir=out, ledger=ledger, executor=executor, config=config, on_job_end=on_job_end)
        summary = driver.run(ids, prepared=True)
    finally:
        executor.shutdown()
    _print_summary(out, summary)
    return summary.exit_code


def _make_executor(args: argparse.Namespace, *, max_gpus: int) -> Executor:
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # no uv-run runtime env probing
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import torch  # noqa: PLC0415

    faults = json.loads(os.environ.get("PAN2_RENDER_FAULTS", "{}"))
    factory = os.environ.get("PAN2_RENDER_PIPELINE", DEFAULT_PIPELINE_FACTORY)
    if os.environ.get("PAN2_RENDER_EXECUTOR") == "local":
        return LocalExecutor(gpus=args.cpu_gpus or max_gpus,
                             config=WorkerConfig(pipeline_factory=factory, faults=faults))
    cpus = os.cpu_count() or 1
    if _address(args):
        return RayExecutor(address=_address(args), gpus=None, cpus=None,
                           config=WorkerConfig(pipeline_factory=factory, faults=faults))
    import ray  # noqa: PLC0415

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ray.is_initialized():  # embedded in a process already connected to a cluster (tests)
        gpus = int(ray.cluster_resources().get("GPU", 0)) or 1
    elif args.cpu_gpus is not None:
        gpus = args.cpu_gpus
    elif cuda:
        gpus = cuda
    else:
        gpus = max_gpus  # a CPU-only machine: logical GPUs, enough for the largest group
        print(f"no CUDA GPU found: running on CPU with {gpus} logical GPU(s) "
              f"(set --cpu-gpus N to change)", file=sys.stderr)
    threads = None if cuda and args.cpu_gpus is None else max(1, cpus // gpus)
    return RayExecutor(address=None, gpus=gpus, cpus=cpus,
                       config=WorkerConfig(pipeline_factory=factory, faults=faults, threads=threads))


def _print_summary(out: Path, s: RunSummary) -> None:
    print(f"{len(s.done)} done, {len(s.failed)} failed in {s.seconds:.1f} s "
          f"({s.groups_created} worker group(s) started); see `pan2-render status {out}`",
          file=sys.stderr)
    for jid in s.failed:
        print(f"  failed: {jid}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
