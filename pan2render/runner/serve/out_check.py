"""Whether ``run`` may record a batch into ``--out`` as it stands: read-only checks before anything
is written, each refusal saying why and which flag goes ahead anyway.

- A folder that holds another batch's jobs (its ledger records batches from other files): ``--add``
  renders this batch beside them (status and the report then show both). Re-running the same batch
  file, edited or not, needs nothing: its changed jobs are named as superseding their old versions.
- A non-empty folder that is not a pan2-render output (no ledger, and files of its own): ``--force``
  writes the job folders, index.html and run.log among them. A folder whose ledger was lost but
  whose job folders remain is not this case: recording refuses it and points at ``repair``.
"""

from __future__ import annotations

from pathlib import Path

from pan2render.hints import command
from pan2render.jobs.ledger import LEDGER_NAME, Ledger
from pan2render.runner.serve.progress import RUN_LOG_NAME
from pan2render.runner.serve.session import unrecorded_work
from pan2render.runner.views.report import REPORT_FALLBACK, REPORT_NAME


def recorded_batch_files(out: Path) -> list[str]:
    """The batch files (absolute paths) recorded in ``out``'s ledger, oldest first; [] without one.
    A ledger that cannot be read raises (LedgerError): recording says what to do about it."""
    if not (out / LEDGER_NAME).is_file():
        return []
    ledger = Ledger.open_readonly(out)
    try:
        if not ledger.has_batch() or not ledger.jobs():
            return []
        kept = [b["path"] for b in ledger.get_meta("batches", []) or [] if b.get("path")]
        last = (ledger.get_meta("batch", {}) or {}).get("path")
    finally:
        ledger.close()
    return list(dict.fromkeys([*kept, *([last] if last else [])]))


def refusal(out: Path, batch_path: str, job_ids: set[str], *, add: bool, force: bool) -> str | None:
    """Why ``run`` must not record the batch at ``batch_path`` (whose jobs are ``job_ids``) into
    ``out`` without a flag; None when it may."""
    if not out.is_dir():
        return None
    if (out / LEDGER_NAME).is_file():
        try:
            recorded = recorded_batch_files(out)
        except Exception:  # a damaged or emptied ledger: recording refuses it, saying why
            return None
        others = [p for p in recorded if p != batch_path]
        if add or not others or batch_path in recorded:
            return None
        shown = ", ".join(others[-3:]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        return (f"--out {out} holds the jobs of another batch ({shown}), not of {batch_path}: add "
                f"`--add` to render this batch's jobs beside them (`{command('status', out)}` and the report "
                f"then show both), or choose another --out")
    if force or unrecorded_work(out) is not None:  # (the latter is refused with its repair hint)
        return None
    # What pan2-render writes there (its fixed names: a run that stopped before recording leaves
    # run.log or _logs/; this batch's job folders) and hidden files (.DS_Store) do not make a
    # folder someone else's.
    ours = {RUN_LOG_NAME, REPORT_NAME, REPORT_FALLBACK, *job_ids}
    foreign = sorted(p.name for p in out.iterdir()
                     if not p.name.startswith((".", "_", LEDGER_NAME)) and p.name not in ours)
    if not foreign:
        return None
    listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return (f"--out {out} is not empty and is not a pan2-render output folder (it has no {LEDGER_NAME}; it "
            f"holds {listed}): a run would write its job folders, index.html and run.log among them. Name a new "
            f"or empty folder, or add `--force` to write there anyway")
