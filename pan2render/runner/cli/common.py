"""What every pan2-render command shares: the exit codes, the flags that read a batch and name an
output folder, error lines on the terminal, commands to paste, and the stop signals that end a
render as Ctrl-C does."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pan2render.hints import command
from pan2render.jobs.ledger import Ledger
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import Batch, BatchValidationError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CHECKPOINT = 5  # validate: a valid batch whose checkpoint `run` would refuse
EXIT_ALREADY_ENDED = 6  # cancel BATCH JOB: the job had already ended (done, failed or cancelled); nothing changed


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
        print_error(f"error: --out {out} is a file, not a folder; name a new or existing folder")
        return EXIT_USAGE
    from pan2render.runner.serve.out_check import refusal

    if (why := refusal(out, batch.path, {j.job_id for j in batch.jobs}, add=args.add, force=args.force)) is not None:
        print_error(f"error: {why}; nothing was written")
        return EXIT_USAGE
    return None


def load_batch_or_report(batch_path: Path, overrides: Overrides, *, check_model: bool) -> Batch | None:
    """The batch validated, or None with every problem printed (file:line, field, what is allowed)."""
    from pan2render.jobs.batch import load_batch

    try:
        return load_batch(batch_path, overrides=overrides, check_model=check_model, say=print_error)
    except BatchValidationError as e:
        print_error(f"error: {batch_path}: {len(e.problems)} problem(s); nothing was run:")
        for problem in e.problems:
            print_error(f"  {problem}")
        return None


def print_error(text: str) -> None:
    # Text the terminal's encoding cannot show (a path with bytes that are not UTF-8) is escaped,
    # never lost with the rest of the message.
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    text = text.encode(encoding, "backslashreplace").decode(encoding, "replace")
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # the terminal went away (SIGHUP)
        pass


def cmd(*words: str | Path) -> str:
    """A pan2-render command to paste, as this program can be called (see program), shell-quoted."""
    return command(*words, program=program())


def program() -> str:
    """How to call this command again, as typed: ``pan2-render`` when that name on PATH is this
    program, else its full path (a venv that is not activated)."""
    exe = Path(sys.argv[0])
    if exe.name != "pan2-render":
        return "pan2-render"
    found = shutil.which("pan2-render")
    return "pan2-render" if found and Path(found).resolve() == exe.resolve() else str(exe.absolute())


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


stopped_by: list[str] = []  # the stop signal received, for the closing message


def on_stop_signal(signum: int, _frame: object) -> None:
    for s in STOP_SIGNALS:  # one clean stop: later signals must not interrupt the clean-up
        signal.signal(s, signal.SIG_IGN)
    stopped_by.append(signal.Signals(signum).name)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def install_stop_handlers() -> dict[int, Any]:
    """SIGTERM (kill, a scheduler) and SIGHUP (a dropped SSH session) stop a run the way Ctrl-C
    does: the running jobs go back to pending in the ledger and the Ray processes this run started
    are shut down. A signal ignored when we started stays ignored: under ``nohup`` a dropped SSH
    session must not stop the run. Returns the handlers replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, on_stop_signal) for s in STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN}


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    previous = install_stop_handlers()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def holds_a_batch(out: Path, consequence: str) -> bool:
    """Does DIR's ledger hold a recorded batch? If not, say so (a damaged one raises LedgerError)."""
    ledger = Ledger.open_readonly(out)
    try:
        if ledger.has_batch():
            return True
    finally:
        ledger.close()
    print_error(f"error: the ledger {ledger.path} holds no batch (the file was emptied, or the batch was never "
                f"recorded); {consequence}. If the batch had run, `{cmd('repair', out)}` rebuilds the ledger from "
                f"its backup and the artifacts; if it never ran, start it with `{cmd('run', 'BATCH', '--out', out)}`")
    return False
