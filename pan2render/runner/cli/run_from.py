"""``pan2-render run --from PATH``: a job rendered again from its own record, as a one-job batch.

PATH is what a finished render leaves: its ``params.json``, its ``video.mp4`` (whose
``pan2_render_params`` tag holds the spec), or the job's folder holding either. The recorded spec
is written back as a batch (every field a batch may set, its sweep values as one-value axes, so
the id's readable part is the same) and validated like any batch file, ``--set`` / ``--sweep``
applied on top. With nothing changed, and the same checkpoint, image and LoRA files, it is the
same job: the same id, the same pixels. The YAML made here is what the output folder keeps in
``_batches/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from pan2render.jobs.coerce import LORA_SCALE_AXIS
from pan2render.jobs.inputs import InputFileError, read_regular_file
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.presets import list_presets
from pan2render.jobs.spec import JOB_KEYS, Batch, JobSpec
from pan2render.runner.protocol.outputs import MP4_PARAMS_KEY, PARAMS_NAME
from pan2render.tiny_dit import TINY_MODEL

VIDEO_NAME = "video.mp4"
PARAMS_LIMIT = 16 << 20  # a params.json is a few kB; this bounds what is read of a wrong file
# The ids and digests the mp4 tag carries beside the spec's fields (outputs.video_tags).
_TAG_EXTRAS = ("job_id", "spec_hash", "model_id")


class FromError(ValueError):
    """PATH is not a render's record; the message says what it is and what is accepted."""


def recorded_spec(path: Path) -> tuple[JobSpec, str]:
    """The spec a render recorded at ``path`` (a params.json, a video made by pan2-render, or a
    job folder holding either) and where it was read."""
    if path.is_dir():
        for name in (PARAMS_NAME, VIDEO_NAME):
            if (path / name).is_file():
                return recorded_spec(path / name)
        raise FromError(f"{path} is a folder without {PARAMS_NAME} or {VIDEO_NAME}: give a job folder of a "
                        f"pan2-render output, its {PARAMS_NAME}, or its video")
    if not path.exists():
        raise FromError(f"{path} does not exist")
    if path.suffix == ".json":
        try:
            doc = json.loads(read_regular_file(path, limit=PARAMS_LIMIT))
        except (OSError, InputFileError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FromError(f"{path} cannot be read as a pan2-render {PARAMS_NAME}: {e}") from e
        spec = doc.get("spec") if isinstance(doc, dict) else None
        if not isinstance(spec, dict):
            raise FromError(f"{path} is JSON but not a pan2-render {PARAMS_NAME} (it has no \"spec\" object)")
        return _spec(spec, path), str(path)
    from pan2render.media.video import MediaError, read_metadata  # PyAV

    try:
        tag = read_metadata(path).get(MP4_PARAMS_KEY)
    except MediaError as e:
        raise FromError(f"{path} is neither a {PARAMS_NAME} nor a video that can be read: {e}") from e
    if tag is None:
        raise FromError(f"{path} has no {MP4_PARAMS_KEY} tag: it is not a video made by pan2-render (or its tags "
                        f"were stripped by a later tool); give its {PARAMS_NAME} instead")
    try:
        spec = {k: v for k, v in json.loads(tag).items() if k not in _TAG_EXTRAS}
    except (json.JSONDecodeError, AttributeError) as e:
        raise FromError(f"{path}: its {MP4_PARAMS_KEY} tag is not the JSON pan2-render writes: {e}") from e
    return _spec(spec, path), str(path)


def _spec(fields: dict[str, Any], path: Path) -> JobSpec:
    try:
        return JobSpec.from_dict(fields)
    except (TypeError, ValueError, KeyError) as e:  # a field this version does not know, or lacks
        raise FromError(f"{path}: the recorded spec does not fit this pan2-render's jobs ({e}); render it with "
                        f"the version that wrote it (its params.json names it), or write a batch") from e


def batch_text(spec: JobSpec, *, source: str, overridden: set[str]) -> str:
    """The batch that renders ``spec`` again: every field a batch may set, the sweep values as
    one-value axes (``overridden``: fields ``--set`` gives, which are plain fields instead)."""
    axes = {k: [_axis_value(spec, k)] for k in spec.sweep if k not in overridden}
    job = {k: v for k, v in _batch_fields(spec).items() if k not in axes}
    presets = list_presets()
    # Every preset field is the job's own below; a preset is still named, as a batch must.
    preset = spec.preset if spec.preset in presets or Path(spec.preset).is_file() else \
        "tiny-preview" if spec.model == TINY_MODEL else "pan2-720p"
    doc: dict[str, Any] = {"model": spec.model, "preset": preset, "jobs": [job]}
    if axes:
        doc["sweep"] = axes
    head = (f"# pan2-render run --from {source}: job {spec.job_id} as it was recorded (every field; its sweep "
            f"values as one-value axes)\n")
    return head + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=1 << 16)


def _batch_fields(spec: JobSpec) -> dict[str, Any]:
    d = spec.to_dict()
    # Not `after`: the jobs it ran after are not in a one-job batch, and the order changed no pixel.
    out = {k: d[k] for k in JOB_KEYS if d.get(k) is not None and k != "after"}
    out["loras"] = [{"path": r.path, "scale": r.scale} for r in spec.loras]
    for key in ("timesteps", "prompts"):  # (tuples: YAML's safe writer takes lists)
        if getattr(spec, key) is not None:
            out[key] = list(getattr(spec, key))
    return out


def _axis_value(spec: JobSpec, key: str) -> Any:
    if (m := LORA_SCALE_AXIS.fullmatch(key)) is not None:
        return spec.loras[int(m[1])].scale
    if key == "loras":
        return [{"path": r.path, "scale": r.scale} for r in spec.loras]
    return _batch_fields(spec).get(key)


def load_from(path: Path, overrides: Overrides, *, check_model: bool, say: Any) -> tuple[Batch, JobSpec]:
    """The one-job batch that renders PATH's job again, and the recorded spec (raises FromError,
    or BatchValidationError with every problem)."""
    from pan2render.jobs.batch import load_batch

    spec, source = recorded_spec(path)
    overridden = {item.partition("=")[0].strip() for item in overrides.sets}
    text = batch_text(spec, source=source, overridden=overridden)
    return load_batch(path, overrides=overrides, check_model=check_model, say=say, text=text), spec


def differences(recorded: JobSpec, now: JobSpec) -> str | None:
    """Why the job renders under another id than the one recorded, for a person (None: the same)."""
    if recorded.job_id == now.job_id:
        return None
    named = {"weights": f"the weights in {now.model} changed", "image_sha256": "the image's content changed",
             "lora_digests": "a LoRA file's content changed",
             "interpolation_sha256": "the interpolation weights' content changed"}
    parts = [named.get(k, f"{k} {json.dumps(a, default=str)} -> {json.dumps(b, default=str)}")
             for k, a, b in now.changes_from(recorded)]
    return ", ".join(parts) or "its sweep values or name differ"


def load_from_or_report(path: Path, overrides: Overrides, *, check_model: bool, err: Any) -> Batch | None:
    """``run --from``'s batch, or None with what is wrong printed through ``err`` (exit 2). Says so
    when the job no longer renders under its recorded id, and why."""
    from pan2render.jobs.spec import BatchValidationError

    try:
        batch, recorded = load_from(path, overrides, check_model=check_model, say=err)
    except FromError as e:
        err(f"error: --from {e}; nothing was run")
        return None
    except BatchValidationError as e:
        err(f"error: --from {path}: the recorded job is not valid now, {len(e.problems)} problem(s); nothing was run:")
        for problem in e.problems:
            err(f"  {problem}")
        return None
    (job,) = batch.jobs
    why = differences(recorded, job)
    if why is None:
        err(f"--from {path}: job {job.job_id}, as recorded")
    else:
        err(f"--from {path}: job {recorded.job_id} renders as {job.job_id}: {why}")
    return batch
