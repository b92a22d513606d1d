"""The commands that read: `validate` (and `run --dry-run`'s plan), `status`, `show`, `report`,
`compare`, `calibrate` and `presets`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pan2render.jobs.ledger import LEDGER_NAME, JobState, Ledger
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.presets import list_presets, preset_text
from pan2render.jobs.spec import Batch
from pan2render.runner.cli.common import (
    EXIT_CHECKPOINT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    holds_a_batch,
    load_batch_or_report,
    print_error,
)
from pan2render.runner.cluster.choose import LOCAL_ADDRESS
from pan2render.tiny_dit import TINY_MODEL


def cmd_validate(args: argparse.Namespace) -> int:
    overrides = Overrides(sets=tuple(args.sets), sweeps=tuple(args.sweeps))
    batch = load_batch_or_report(args.batch, overrides, check_model=True)
    if batch is None:
        return EXIT_USAGE
    print_plan(batch, args.out, args)
    from pan2render.runner.serve.session import model_folder_problems

    broken = model_folder_problems(batch.jobs)
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


def print_plan(batch: Batch, out: Path | None, args: argparse.Namespace) -> None:
    from pan2render.runner.views.estimates import CPU, CUDA, History, history_folders, plan
    from pan2render.runner.views.status import format_estimate, format_plan

    done = done_ids(out)
    todo = [j for j in batch.jobs if j.job_id not in done]
    max_gpus = max((j.gpus for j in batch.jobs), default=1)
    from pan2render.runner.cluster.choose import local_gpus

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


def done_ids(out: Path | None) -> set[str]:
    """The ids of the jobs done in ``out``'s ledger (none without one)."""
    if out is None or not (out / LEDGER_NAME).is_file():
        return set()
    ledger = Ledger.open_readonly(out)
    try:
        return {j.id for j in ledger.jobs() if j.state is JobState.DONE}
    finally:
        ledger.close()


def _is_output_folder(folder: Path) -> bool:
    """Does ``folder`` hold a ledger? If not, say so."""
    if (folder / LEDGER_NAME).is_file():
        return True
    print_error(f"error: no ledger at {folder / LEDGER_NAME}: {folder} is not a pan2-render output folder")
    return False


def cmd_status(args: argparse.Namespace) -> int:
    from pan2render.runner.views.status import format_status, holder, status_document

    if not _is_output_folder(args.dir):
        return EXIT_USAGE
    if not holds_a_batch(args.dir, "there is no status to show"):
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
    from pan2render.runner.views.status import JobNotFound, find_job, format_show

    if not _is_output_folder(args.dir):
        return EXIT_USAGE
    ledger = Ledger.open_readonly(args.dir)
    try:
        try:
            job = find_job(ledger, args.job)
        except JobNotFound as e:
            print_error(f"error: {e}")
            return EXIT_USAGE
        print(format_show(args.dir, ledger, job))
        return EXIT_FAILED if job.state is JobState.FAILED else EXIT_OK
    finally:
        ledger.close()


def cmd_report(args: argparse.Namespace) -> int:
    from pan2render.runner.views.report import open_in_browser, write_report

    if not (args.dir / LEDGER_NAME).is_file():
        print_error(f"error: {args.dir} has no {LEDGER_NAME}; nothing to report")
        return EXIT_USAGE
    if not holds_a_batch(args.dir, "there is nothing to report"):
        return EXIT_USAGE
    path = write_report(args.dir)
    print(path)
    if args.open and not open_in_browser(path):
        print_error(f"no web browser found; open {path.resolve().as_uri()}")
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    from pan2render.runner.views.compare import comparisons, format_comparisons

    if not (args.dir / LEDGER_NAME).is_file():
        print_error(f"error: {args.dir} has no {LEDGER_NAME}; nothing to compare")
        return EXIT_USAGE
    ledger = Ledger.open_readonly(args.dir)
    try:
        rows = comparisons(args.dir, ledger, say=None if args.json else lambda line: print_error(line))
    finally:
        ledger.close()
    print(json.dumps([r.to_json() for r in rows], indent=2) if args.json else format_comparisons(rows))
    return EXIT_OK


# The preset `calibrate` runs when none is given: one the model renders (the tiny model's own; a
# checkpoint's at the size MagCache's published ratios were measured at).
CALIBRATE_PRESETS = {TINY_MODEL: "tiny-preview"}
CALIBRATE_PRESET = "pan2-720p"


def cmd_calibrate(args: argparse.Namespace) -> int:
    import numpy as np
    from PIL import Image

    from pan2render.models.calibration import calibrate, store_calibration
    from pan2render.models.pipeline import PAN2Pipeline, PAN2PipelineConfig
    from pan2render.models.preview import FitSamples, calibrate_rgb_map, store_rgb_map

    name = args.preset or CALIBRATE_PRESETS.get(args.model, CALIBRATE_PRESET)
    try:
        preset = list_presets()[name]
    except KeyError:
        print_error(f"pan2-render calibrate: no preset {name!r}; `pan2-render presets` lists them")
        return EXIT_USAGE
    job = {k: preset[k] for k in ("height", "width", "frames", "steps", "guidance", "flow_shift", "sampler")}
    print(f"calibrate {args.model}: one exact job of preset {name} ({job['width']}x{job['height']}, {job['frames']} "
          f"frames, {job['steps']} steps, guidance {job['guidance']}{', with --image' if args.image else ''}); "
          f"loading the model", flush=True)
    pipe = PAN2Pipeline.from_pretrained(args.model, PAN2PipelineConfig(device=args.device))
    image = None if args.image is None else np.asarray(Image.open(args.image).convert("RGB"))
    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        print(f"  step {done}/{total}, {time.monotonic() - started:.1f} s", flush=True)

    # The same exact job fits the previews' latent -> RGB map: its x0 at a few boundaries, whole,
    # decoded by the model's own VAE (`pan2render.models.preview`).
    x0s = FitSamples(steps=job["steps"])
    cal = calibrate(pipe, prompt=args.prompt, negative_prompt=preset.get("negative_prompt", ""), image=image,
                    seed=args.seed, progress=progress, preview_every_s=1e-9, on_preview=x0s,
                    preview_frames=job["frames"], **job)
    path = store_calibration(pipe.model_id, cal, conditioned=image is not None)
    print(f"{pipe.model_id}: {cal.steps} steps, cond ratios {min(cal.cond[1:]):.4f}..{max(cal.cond[1:]):.4f}"
          + (f", uncond {min(cal.uncond[1:]):.4f}..{max(cal.uncond[1:]):.4f}" if cal.uncond else "") + f" -> {path}")
    print(f"fitting the previews' latent -> RGB map on {len(x0s.x0s)} decodes", flush=True)
    rgb_map, quality = calibrate_rgb_map(pipe, x0s.x0s)
    path = store_rgb_map(pipe.model_id, rgb_map, quality=quality)
    print(f"{pipe.model_id}: previews' latent -> RGB map fitted on {len(x0s.x0s)} decodes, PSNR "
          f"{quality['psnr_db']:.1f} dB at the latent grid (a grey picture: {quality['grey_psnr_db']:.1f} dB) "
          f"-> {path}")
    return EXIT_OK


def cmd_presets(args: argparse.Namespace) -> int:
    from pan2render.runner.views.format import table

    if args.name is not None:
        try:
            print(preset_text(args.name), end="")
        except LookupError as exc:
            print_error(f"pan2-render presets: {exc.args[0]}")
            return EXIT_USAGE
        return EXIT_OK
    keys = ["height", "width", "frames", "fps", "steps", "guidance", "flow_shift", "sampler", "gpus", "crf"]
    rows = [[name, *(str(values.get(k, "")) for k in keys), str(values.get("description", ""))]
            for name, values in sorted(list_presets().items())]
    print(table(["preset", *keys, "description"], rows))
    print("`pan2-render presets NAME` prints one. Use one with `preset: NAME` in a batch or `--set preset=NAME`; "
          "any job field overrides it.")
    return EXIT_OK
