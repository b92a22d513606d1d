"""The files a batch names besides itself: its model folder, first-frame images and LoRA adapters.

Each path resolves against the folder of the file that names it (the batch, a prompts file, or the
working folder for a flag). When the load checks files, each must be there and of a kind and size
we read; a LoRA is checked once the model is known, its keys and shapes against the DiT's layers.
Images and adapters are hashed into the job ids, each file once per load. Every file is read
through ``jobs.inputs`` (regular files within the limits, a stalled read refused).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from pan2render.ifnet_files import check_ifnet_weights
from pan2render.jobs.coerce import BadValue, as_path, type_name
from pan2render.jobs.context import LoadContext, RawJob
from pan2render.jobs.inputs import LIMITS, InputFileError, image_size, read_regular_file, sha256_regular_file
from pan2render.jobs.spec import LoraRef, Problem, SourceLocation
from pan2render.jobs.yaml_reader import Node
from pan2render.lora_plan import LoraFileError, detect_layout, dit_linears, plan_lora, read_header
from pan2render.tiny_dit import TINY_DIT_CONFIG, TINY_MODEL


def parse_model(node: Node | None, ctx: LoadContext) -> str:
    """The batch's ``model``: ``tiny``, or a model folder made absolute; ``tiny`` with the problem
    noted when the value cannot be used. Whether the folder can be loaded is not a problem of the
    batch: ``model_files.folder_problems`` says (validate's exit 5, run's and submit's exit 3)."""
    allowed = ("'tiny' (the embedded toy model) or a checkpoint folder in the diffusers layout (a path of at "
               f"most {LIMITS.path_chars:,} characters)")
    if node is None:
        ctx.problem(1, "model", f"missing; allowed: {allowed}")
        return TINY_MODEL
    if not isinstance(node.value, str) or not node.value.strip():
        ctx.problem(node.line, "model", f"got {node.value!r} ({type_name(node.value)}); allowed: {allowed}")
        return TINY_MODEL
    if node.value == TINY_MODEL:
        return TINY_MODEL
    try:
        value = as_path(node.value, allowed)
    except BadValue as exc:
        ctx.problem(node.line, "model", str(exc))
        return TINY_MODEL
    folder = (ctx.base_dir / Path(value).expanduser()).resolve()
    if (outside := ctx.outside_roots(folder)) is not None:
        ctx.problem(node.line, "model", outside)
    return str(folder)


def resolve_loras(refs: tuple[LoraRef, ...], base_dir: Path, ctx: LoadContext, where: SourceLocation,
                  fld: str) -> tuple[LoraRef, ...]:
    """The adapters with absolute paths (against the file that named them), each noted for
    `check_lora_files` where it was first named."""
    out = []
    for ref in refs:
        path = str((base_dir / Path(ref.path).expanduser()).resolve())
        if (outside := ctx.outside_roots(Path(path))) is not None:
            ctx.problems.append(Problem(where, fld, outside))
            continue
        ctx.lora_sources.setdefault(path, (where, fld))
        out.append(LoraRef(path, ref.scale))
    return tuple(out)


def _model_linears(model: str, ctx: LoadContext) -> dict[str, tuple[int, int]] | None:
    """The DiT's linear layers (name -> (out, in)) from its config.json, to check LoRAs against;
    None when the checkpoint is not to be read (a dry run) or has no readable config."""
    if model == TINY_MODEL:
        return dit_linears(TINY_DIT_CONFIG)
    if not (ctx.check_files and ctx.check_model):
        return None
    folder = Path(model) / "transformer"
    config = folder / "config.json" if folder.is_dir() else Path(model) / "config.json"
    try:
        return dit_linears(json.loads(read_regular_file(config, limit=LIMITS.model_config_bytes)))
    except (OSError, InputFileError, ValueError, TypeError):
        return None  # the model's own load reports it, with the file


def check_lora_files(model: str, ctx: LoadContext) -> None:
    """Every LoRA named anywhere: a safetensors file within the limits, in a layout we read, whose
    keys and shapes fit the batch's DiT; each problem at the place that first named the file."""
    if not ctx.check_files:
        return
    linears = _model_linears(model, ctx)
    for path, (where, fld) in ctx.lora_sources.items():
        try:
            header = read_header(path, read_first=_lora_reader(path))
            if linears is None:
                detect_layout(list(header.tensors), path)
            else:
                plan_lora(header, linears, name=path)
        except LoraFileError as exc:
            ctx.problems.append(Problem(where, fld, str(exc)))
        except FileNotFoundError:
            ctx.problems.append(Problem(where, fld, f"LoRA {path!r} does not exist"))
        except (InputFileError, OSError) as exc:
            why = str(exc) if isinstance(exc, InputFileError) else f"cannot be read: {exc.strerror or exc}"
            ctx.problems.append(Problem(where, fld, f"LoRA {path!r} {why}"))


def resolve_interpolation_weights(value: str, base_dir: Path, ctx: LoadContext, where: SourceLocation,
                                  fld: str) -> str:
    """The interpolation weights' path made absolute (against the file that named it), noted for
    `check_interpolation_files` where it was first named."""
    path = (base_dir / Path(value).expanduser()).resolve()
    if (outside := ctx.outside_roots(path)) is not None:
        ctx.problems.append(Problem(where, fld, outside))
    ctx.interpolation_sources.setdefault(str(path), (where, fld))
    return str(path)


def check_interpolation_files(ctx: LoadContext) -> None:
    """Every interpolation weights file named anywhere: a regular file within its limit that the
    interpolation model loads (its own check, without building the model); each problem at the
    place that first named the file."""
    if not ctx.check_files:
        return
    for path, (where, fld) in ctx.interpolation_sources.items():
        if ctx.outside_roots(Path(path)) is not None:
            continue  # said where it was named
        problem = None
        if interpolation_hash(path, ctx) is None:
            try:
                sha256_regular_file(path, limit=LIMITS.interpolation_weights_bytes)
            except FileNotFoundError:
                problem = "does not exist"
            except (InputFileError, OSError) as exc:
                problem = str(exc) if isinstance(exc, InputFileError) else f"cannot be read: {exc.strerror or exc}"
            problem = (f"interpolation weights {path!r} {problem}; allowed: a RIFE IFNet weights file (v4.25 / "
                       "v4.26, .safetensors or a torch state dict)")
        else:  # the loader's own check (a safetensors file from its header, a torch file mapped, not run),
            problem = check_ifnet_weights(Path(path))  # which names the file and what it accepts
        if problem is not None:
            ctx.problems.append(Problem(where, fld, problem))


def interpolation_hash(path: str, ctx: LoadContext) -> str | None:
    """The weights file's sha256, hashed once per load; None when it cannot be read."""
    if path not in ctx.interpolation_hashes:
        ctx.interpolation_hashes[path] = _hash(path, limit=LIMITS.interpolation_weights_bytes)
    return ctx.interpolation_hashes[path]


def _lora_reader(path: str) -> Callable[[int], bytes]:
    """``n`` -> the adapter's first ``n`` bytes, for `read_header`."""
    return lambda n: read_regular_file(path, limit=LIMITS.lora_bytes, first=n)


def lora_hash(path: str, ctx: LoadContext) -> str | None:
    """The adapter file's sha256, hashed once per load; None when it cannot be read (the check of
    the file says why)."""
    if path not in ctx.lora_hashes:
        ctx.lora_hashes[path] = _hash(path, limit=LIMITS.lora_bytes)
    return ctx.lora_hashes[path]


def image_hash(path: str, ctx: LoadContext) -> str | None:
    """The image file's sha256, hashed once per load; None when it cannot be read (the check of
    the file says why)."""
    if path not in ctx.image_hashes:
        ctx.image_hashes[path] = _hash(path, limit=LIMITS.image_bytes)
    return ctx.image_hashes[path]


def _hash(path: str, *, limit: int) -> str | None:
    try:
        return sha256_regular_file(path, limit=limit)
    except (OSError, InputFileError):
        return None


def resolve_image(raw: RawJob, ctx: LoadContext) -> None:
    """Make ``image`` absolute (against the file that named it) and check it, once per load."""
    image = raw.fields.get("image")
    if image is None:
        return
    path = (raw.base_dir / Path(image).expanduser()).resolve()
    raw.fields["image"] = str(path)
    problem = ctx.outside_roots(path)
    if problem is None and not ctx.check_files:
        return
    if problem is None:
        if str(path) not in ctx.image_problems:
            ctx.image_problems[str(path)] = image_problem(path)
        problem = ctx.image_problems[str(path)]
    if problem:
        ctx.problem(raw.lines.get("image", raw.location.line), raw.label + ".image", problem, raw.location.file)


def image_problem(path: Path, *, relative_to: str = "the file that names it") -> str | None:
    """None if ``path`` is a PNG/JPEG/WebP file within the size and pixel limits, else why not."""
    allowed = (f"a PNG, JPEG or WebP file of at most {LIMITS.image_bytes >> 20} MiB and "
               f"{LIMITS.image_pixels:,} pixels, relative to {relative_to}")
    try:
        data = read_regular_file(path, limit=LIMITS.image_bytes)
        width, height = image_size(data)
    except FileNotFoundError:
        return f"image {str(path)!r} does not exist; allowed: {allowed}"
    except InputFileError as exc:
        return f"image {str(path)!r} {exc}; allowed: {allowed}"
    except OSError as exc:
        return f"cannot read image {str(path)!r}: {exc.strerror}; allowed: {allowed}"
    if width * height > LIMITS.image_pixels:
        return (f"image {str(path)!r} is {width}x{height} = {width * height:,} pixels (decoding it needs "
                f"{width * height * 3 / 2**30:.1f} GiB); allowed: {allowed}")
    return None
