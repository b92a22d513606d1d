"""YAML batch files -> validated, fully resolved ``JobSpec``s.

A batch names a ``model``, a ``preset``, optional ``defaults``, a ``jobs`` list and/or a
``prompts_file``, and an optional ``sweep`` (field -> list of values, a cartesian product applied
to every job). Each job field resolves as: built-in default < preset < defaults < job < sweep value.

Everything is checked before anything runs, and every problem is collected with its ``file:line``
before one ``BatchValidationError`` is raised. YAML is read with ``yaml.SafeLoader`` only; we
compose the node tree ourselves so every value keeps the line it was written on.

This module assembles a batch from the parts beside it, one module each: ``yaml_reader`` (the
bounded reader, values with their lines), ``coerce`` (each field's rule), ``presets``,
``overrides`` (``--set`` and ``--sweep``), ``references`` (the model folder, images and LoRAs a
batch names) and ``expansion`` (raw jobs -> ``JobSpec``s, and the checks across them); ``context``
holds what one load carries between them. Here: the top-level keys, the jobs list and the prompts
file, the sweep, and the order of the steps.

Choices a user can rely on:
- A job without ``seed`` gets seed 0 (from the built-in defaults), so a batch renders the same
  videos on every run; set ``seed`` in ``defaults`` or sweep it to vary.
- A job without ``name`` is named after the first words of its prompt ("a-red-fox-runs-through"),
  with ``-2``, ``-3`` for repeats in file order: the name stays stable when jobs are re-ordered, so
  job ids (name + sweep values + spec hash) stay stable too.
- Relative paths (model folder, image, prompts_file) resolve against the folder of the file that
  names them. ``check_files=False`` skips the existence checks for the model folder and images
  (resuming on a machine that lacks them); the prompts file is still read, it defines the jobs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from pan2render.jobs.after import check_after
from pan2render.jobs.coerce import (
    LORA_SCALE_AXIS,
    SWEEP_KEYS,
    BadValue,
    as_path,
    coerce_fields,
    did_you_mean,
    repeated,
    sweep_check,
    type_name,
)
from pan2render.jobs.context import LoadContext, RawJob
from pan2render.jobs.expansion import check_cost, check_unique, expand_jobs, name_jobs, resolve_prompts
from pan2render.jobs.inputs import LIMITS, nesting_depth
from pan2render.jobs.overrides import FlagValues, Overrides
from pan2render.jobs.presets import parse_preset
from pan2render.jobs.references import (
    check_interpolation_files,
    check_lora_files,
    image_problem,
    parse_model,
    resolve_image,
    resolve_interpolation_weights,
    resolve_loras,
)
from pan2render.jobs.spec import DEFAULTS_KEYS, JOB_KEYS, Batch, BatchValidationError, Problem, SourceLocation
from pan2render.jobs.weights import folder_fingerprint
from pan2render.jobs.yaml_reader import Node, YamlReader, read_text, too_deep, unreadable_number
from pan2render.tiny_dit import TINY_MODEL

TOP_LEVEL_KEYS = ("model", "preset", "defaults", "jobs", "prompts_file", "sweep")


def load_batch(path: str | Path, *, check_files: bool = True, check_model: bool = True,
               overrides: Overrides | None = None, say: Callable[[str], None] | None = None,
               text: str | None = None, roots: tuple[Path, ...] | None = None,
               flags_dir: Path | None = None) -> Batch:
    """Parse, validate and resolve a batch file; raise BatchValidationError listing every problem.

    ``check_model=False`` plans without the checkpoint (dry runs); ``overrides`` are the
    command line's ``--set``/``--sweep``, validated like the file and reported by flag. ``say``
    is told when the checkpoint's weights have to be hashed (a line, before the wait). ``text``:
    the batch's YAML when it is not read from ``path`` (a batch made from a render's own record,
    ``run --from``; a batch a client sent to a farm), which then only names it and anchors relative
    paths. ``roots``: the only folders the files the batch names may lie in (a farm's, for a
    client's batch; None: anywhere); ``flags_dir``: what ``--set``/``--sweep`` paths are relative to
    (default: the working folder)."""
    batch_path = Path(path)
    ctx = LoadContext(display=str(path), base_dir=batch_path.absolute().parent, check_files=check_files,
                      check_model=check_model, roots=roots, flags_dir=flags_dir or Path.cwd())
    if text is None:
        text = read_text(batch_path, ctx.display, ctx.problems, what="batch file", limit=LIMITS.batch_bytes)
    root = None if text is None else YamlReader(ctx.display, ctx.problems).read(text)
    if ctx.problems:
        raise BatchValidationError(ctx.problems)
    if root is None or not isinstance(root.value, dict):
        ctx.problem(root.line if root else 1, "(batch)",
                    "a batch must be a YAML mapping with keys: " + ", ".join(TOP_LEVEL_KEYS))
        raise BatchValidationError(ctx.problems)
    top: dict[str, Node] = root.value
    for key, node in top.items():
        if key not in TOP_LEVEL_KEYS:
            ctx.problem(node.line, key, f"unknown top-level key {key!r}{did_you_mean(key, TOP_LEVEL_KEYS)}; "
                                        f"allowed: {', '.join(TOP_LEVEL_KEYS)}")

    flags = FlagValues.parse(overrides or Overrides(), ctx)
    model = flags.model if flags.model is not None else parse_model(top.get("model"), ctx)
    preset_name, preset = flags.preset if flags.preset is not None else parse_preset(top.get("preset"), ctx)
    defaults = _parse_defaults(top.get("defaults"), ctx)
    raw_jobs = _parse_jobs(top.get("jobs"), ctx) + _parse_prompts_file(top.get("prompts_file"), ctx)
    sweep = _parse_sweep(top.get("sweep"), ctx)
    sweep = flags.apply_to_sweep(sweep, top.get("sweep"), ctx)
    defaults_lines = {k: n.line for k, n in top["defaults"].value.items()} if defaults else {}
    for raw in [*raw_jobs, RawJob(defaults, SourceLocation(ctx.display, 1), "defaults", ctx.base_dir,
                                  defaults_lines)]:
        resolve_image(raw, ctx)
        if "loras" in raw.fields:
            where = SourceLocation(raw.location.file, raw.lines.get("loras", raw.location.line))
            raw.fields["loras"] = resolve_loras(raw.fields["loras"], raw.base_dir, ctx, where, raw.label + ".loras")
        if raw.fields.get("interpolation_weights") is not None:
            fld = "interpolation_weights"
            where = SourceLocation(raw.location.file, raw.lines.get(fld, raw.location.line))
            raw.fields[fld] = resolve_interpolation_weights(raw.fields[fld], raw.base_dir, ctx, where,
                                                            f"{raw.label}.{fld}")
        resolve_prompts(raw)
    check_lora_files(model, ctx)
    check_interpolation_files(ctx)
    if not raw_jobs and not any(p.field.startswith(("jobs", "prompts_file")) for p in ctx.problems):
        # (a `jobs:` that is not a list, or an unreadable prompts file, is reported already)
        line = (top.get("jobs") or top.get("prompts_file") or root).line
        ctx.problem(line, "jobs", "the batch has no jobs: add a `jobs:` list (each with a `prompt`) "
                                  "or a `prompts_file`")
    name_jobs(raw_jobs, ctx)
    check_after(raw_jobs, sweep, ctx)
    n_jobs = len(raw_jobs) * math.prod(len(values) for values in sweep.values())
    if n_jobs > LIMITS.jobs:
        where = top.get("sweep") or top.get("jobs") or top.get("prompts_file") or root
        ctx.problem(where.line, "sweep" if sweep else "jobs",
                    f"the batch expands to {n_jobs:,} jobs ({len(raw_jobs)} job(s) x "
                    f"{n_jobs // max(1, len(raw_jobs)):,} sweep combination(s)); allowed: at most {LIMITS.jobs:,} "
                    "jobs in one batch: split it into several batches")
    if ctx.problems:
        raise BatchValidationError(_sorted(ctx))

    weights, weights_files = None, {}
    if model != TINY_MODEL and Path(model).is_dir():
        weights, files = folder_fingerprint(Path(model), say=say)
        weights_files = {rel: {"size": fp.size, "sha256": fp.sha256} for rel, fp in files.items()}
    jobs = expand_jobs(raw_jobs, model=model, weights=weights, preset_name=preset_name, preset=preset,
                       defaults=defaults, sets=flags.fields, sweep=sweep, ctx=ctx)
    check_cost(jobs, ctx)
    check_unique(jobs, ctx)
    if ctx.problems:
        raise BatchValidationError(_sorted(ctx))
    return Batch(path=str(batch_path.absolute()), model=model, preset=preset_name, jobs=jobs,
                 weights_files=weights_files, text=text)


def _sorted(ctx: LoadContext) -> list[Problem]:
    # Batch file first, in line order; then other files (prompts file, presets) in line order.
    return sorted(ctx.problems, key=lambda p: (p.location.file != ctx.display, p.location.file, p.location.line))


def _parse_defaults(node: Node | None, ctx: LoadContext) -> dict[str, Any]:
    if node is None:
        return {}
    if not isinstance(node.value, dict):
        ctx.problem(node.line, "defaults", f"must be a mapping of job fields ({', '.join(DEFAULTS_KEYS)})")
        return {}
    return coerce_fields(node.value, DEFAULTS_KEYS, "defaults.", ctx.display, ctx.problems)


def _parse_jobs(node: Node | None, ctx: LoadContext) -> list[RawJob]:
    if node is None:
        return []
    if not isinstance(node.value, list):
        ctx.problem(node.line, "jobs", "must be a list of jobs, each a mapping with at least `prompt`")
        return []
    raw: list[RawJob] = []
    for i, item in enumerate(node.value):
        label = f"jobs[{i}]"
        where = SourceLocation(ctx.display, item.line)
        if isinstance(item.value, str):  # shorthand: `- a prompt`
            item = Node({"prompt": Node(item.value, item.line)}, item.line)
        if not isinstance(item.value, dict):
            ctx.problem(item.line, label, f"got {item.value!r} ({type_name(item.value)}); allowed: a mapping "
                                          "with `prompt` and optional " + ", ".join(JOB_KEYS[1:]))
            continue
        fields = coerce_fields(item.value, JOB_KEYS, label + ".", ctx.display, ctx.problems)
        if "prompt" not in item.value and "prompts" not in item.value:
            ctx.problem(item.line, label + ".prompt", "missing; every job needs a non-empty `prompt` (or `prompts`, "
                                                      "one per segment)")
        # Kept even when broken, so that its name still takes part in the duplicate check.
        raw.append(RawJob(fields, where, label, ctx.base_dir, {k: n.line for k, n in item.value.items()}))
    return raw


def _parse_prompts_file(node: Node | None, ctx: LoadContext) -> list[RawJob]:
    """One prompt a line (blank and ``#`` lines skipped), or ``.jsonl`` rows of job fields."""
    if node is None:
        return []
    allowed = ("a path to a .txt (one prompt a line) or .jsonl (one job object a line) file, relative to "
               f"this batch, of at most {LIMITS.path_chars:,} characters")
    try:
        name = as_path(node.value, allowed)
    except BadValue as exc:
        ctx.problem(node.line, "prompts_file", str(exc))
        return []
    path = (ctx.base_dir / Path(name).expanduser()).resolve()
    if (outside := ctx.outside_roots(path)) is not None:
        ctx.problem(node.line, "prompts_file", outside)
        return []
    text = read_text(path, ctx.display, ctx.problems, what="prompts file", limit=LIMITS.prompts_file_bytes,
                     location=SourceLocation(ctx.display, node.line), fld="prompts_file")
    if text is None:
        return []
    # Rows are located in the prompts file as written relative to the batch: "jobs/prompts.txt:3".
    display = str(Path(ctx.display).parent / name)
    raw: list[RawJob] = []
    is_jsonl = path.suffix.lower() == ".jsonl"
    rows = 0
    # Split on line feeds only, as the YAML reader counts lines: str.splitlines would also break at
    # form feeds and other controls, hiding them from the checks and shifting every later line.
    for lineno, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        label = f"prompts_file[{rows}]"  # the n-th row (0-based) after skipping blanks and comments
        rows += 1
        where = SourceLocation(display, lineno)
        if not is_jsonl:
            # The line is the job's prompt: checked like a prompt written in YAML.
            fields = coerce_fields({"prompt": Node(stripped, lineno)}, JOB_KEYS, label + ".", display, ctx.problems)
            raw.append(RawJob(fields, where, label, path.parent, {"prompt": lineno}))
            continue
        row = _json_row(stripped, lineno, label, display, ctx)
        if row is None:
            continue
        if not isinstance(row, dict):
            ctx.problem(lineno, label, f"got {type_name(row)}; allowed: a JSON object with `prompt` and "
                                       "optional " + ", ".join(JOB_KEYS[1:]), display)
            continue
        fields = coerce_fields({str(k): Node(v, lineno) for k, v in row.items()}, JOB_KEYS, label + ".", display,
                               ctx.problems)
        if "prompt" not in row and "prompts" not in row:
            ctx.problem(lineno, label + ".prompt", "missing; every row needs a non-empty `prompt` (or `prompts`, "
                                                   "one per segment)", display)
        raw.append(RawJob(fields, where, label, path.parent, {k: lineno for k in row}))
    return raw


def _json_row(text: str, lineno: int, label: str, display: str, ctx: LoadContext) -> Any:
    """One line of a .jsonl prompts file parsed, or None with the problem noted (a row that is
    JSON ``null`` is refused as not an object by the caller either way)."""
    example = 'each line of a .jsonl prompts file is one object like {"prompt": "...", "seed": 1}'
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        ctx.problem(lineno, label, f"not valid JSON ({exc.msg} at column {exc.colno}); {example}", display)
        return None
    except RecursionError:  # json's reader recurses once per level
        ctx.problem(lineno, label, too_deep(), display)
        return None
    except ValueError as exc:  # an integer of more digits than Python converts
        ctx.problem(lineno, label, unreadable_number(exc), display)
        return None
    if nesting_depth(row) > LIMITS.nesting:
        ctx.problem(lineno, label, too_deep(), display)
        return None
    return row


def _parse_sweep(node: Node | None, ctx: LoadContext) -> dict[str, list[Any]]:
    if node is None:
        return {}
    if not isinstance(node.value, dict):
        ctx.problem(node.line, "sweep", "must be a mapping field -> list of values, e.g. {seed: [0, 1]}")
        return {}
    sweep: dict[str, list[Any]] = {}
    for key, values in node.value.items():
        fld = f"sweep.{key}"
        if key not in SWEEP_KEYS and not LORA_SCALE_AXIS.fullmatch(key):
            ctx.problem(values.line, fld, f"cannot sweep unknown field {key!r}{did_you_mean(key, SWEEP_KEYS)}; "
                                          f"allowed: {', '.join(SWEEP_KEYS)}")
            continue
        if not isinstance(values.value, list) or not values.value:
            ctx.problem(values.line, fld, f"got {values.value!r}; allowed: a non-empty list of values, "
                                          f"e.g. {key}: [a, b]")
            continue
        good: list[Any] = []
        for i, item in enumerate(values.value):
            try:
                good.append(sweep_check(key)(item.value))
            except BadValue as exc:
                ctx.problem(item.line, f"{fld}[{i}]", str(exc))
                continue
            if key == "loras":
                good[-1] = resolve_loras(good[-1], ctx.base_dir, ctx, SourceLocation(ctx.display, item.line),
                                         f"{fld}[{i}]")
            if key == "interpolation_weights":
                good[-1] = resolve_interpolation_weights(good[-1], ctx.base_dir, ctx,
                                                         SourceLocation(ctx.display, item.line), f"{fld}[{i}]")
            image = (ctx.base_dir / Path(good[-1]).expanduser()).resolve() if key == "image" else None
            problem = None if image is None else ctx.outside_roots(image) or (
                image_problem(image) if ctx.check_files else None)
            if problem:
                ctx.problem(item.line, f"{fld}[{i}]", problem)
        if twice := repeated(good):
            ctx.problem(values.line, fld, f"values {', '.join(twice)} appear more than once; each sweep value "
                                          "must be distinct")
        sweep[key] = good
    return sweep

