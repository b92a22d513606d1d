"""What a finished video says about itself, away from the ledger.

Beside every ``DIR/<job-id>/video.mp4`` the driver writes ``params.json`` (:func:`params_document`):
the resolved spec, the sweep values, model and checkpoint, sampler and schedule, seed, attempts,
per-stage seconds, the GPU layout the group reported when it loaded the model, versions and the
time it was written. The same essentials go into the mp4's container tags (:func:`video_tags`),
so a video copied out of the folder still carries its prompt and settings.

The ledger keeps the exact text of each params.json it recorded: a params.json found missing,
truncated or edited on resume is rewritten from it (:func:`restore_params`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pan2render.jobs.ledger import STAGES, JobRecord, Ledger
from pan2render.jobs.spec import JobSpec
from pan2render.runner.protocol import artifacts
from pan2render.sampling import flow_sigma_values

PARAMS_NAME = "params.json"
# The mp4 tag holding the compact spec JSON (beside the standard ``title`` and ``comment``).
MP4_PARAMS_KEY = "pan2_render_params"
PARAMS_FORMAT = 1  # bumped when a field of params.json changes meaning


def params_relpath(job_id: str) -> str:
    return f"{job_id}/{PARAMS_NAME}"


def video_tags(spec: JobSpec, *, model_id: str) -> dict[str, str]:
    """The mp4 container tags: title = job name, comment = prompt, and under
    :data:`MP4_PARAMS_KEY` the spec (every field) with its id, hash and model id as compact JSON."""
    compact = {"job_id": spec.job_id, "spec_hash": spec.spec_hash, "model_id": model_id, **spec.to_dict()}
    return {"title": spec.name, "comment": spec.prompt,
            MP4_PARAMS_KEY: json.dumps(compact, sort_keys=True, separators=(",", ":"), ensure_ascii=False)}


def _schedule(spec: JobSpec, scheduler: dict[str, Any] | None) -> list[float] | None:
    """The sampler's noise levels for this job (the flow-matching sigmas, last 0 excluded)."""
    if spec.timesteps is not None or not scheduler or "num_train_timesteps" not in scheduler:
        return None  # a few-step sampler runs its listed timesteps (recorded beside), not these
    sigmas = flow_sigma_values(num_steps=spec.steps, flow_shift=spec.flow_shift,
                               num_train_timesteps=int(scheduler["num_train_timesteps"]))
    return [round(s, 6) for s in sigmas]


def params_document(*, job: JobRecord, seconds: dict[str, float | None], load: dict[str, Any] | None,
                    created_at: float, fast_lanes: dict[str, Any] | None = None,
                    long_video: dict[str, Any] | None = None) -> dict[str, Any]:
    """params.json for a finished job. ``load``: what the group's worker replied to ``load``
    (model ids, device, backend, the pipeline's ``describe()``, versions); None when unknown (a
    folder rendered before params.json existed, whose params are rebuilt from the ledger alone).
    ``fast_lanes``: what the latents record of the job's fast lanes (which steps computed, reused);
    ``long_video``: a chained or interpolated job's video (frames, fps) and its segments' records
    (the key only for such a job: the params of every other job read as they did)."""
    spec = job.spec
    load = load or {}
    setup = load.get("describe") or {}
    doc = {
        "format": PARAMS_FORMAT,
        "job_id": job.id,
        "name": spec.name,
        "spec_hash": job.spec_hash,
        "sweep": spec.sweep,
        "spec": spec.to_dict(),  # JobSpec.from_dict reads it back (`repair` does)
        "model": {"model": spec.model, "checkpoint": spec.model if spec.model != "tiny" else None,
                  "model_id": load.get("model_id"), "text_encoder_id": load.get("text_encoder_id")},
        "sampler": {"name": spec.sampler, "steps": spec.steps, "flow_shift": spec.flow_shift,
                    "guidance": spec.guidance, "sigmas": _schedule(spec, setup.get("scheduler")),
                    "timesteps": None if spec.timesteps is None else list(spec.timesteps)},
        "fast_lanes": fast_lanes,
        "seed": spec.seed,
        "attempts": job.attempts,
        "seconds": {s.value: (None if seconds.get(s.value) is None else round(float(seconds[s.value]), 3))
                    for s in STAGES},
        "gpu_layout": {"group_size": spec.gpus, "device": load.get("device"), "backend": load.get("backend"),
                       **{k: v for k, v in setup.items() if k != "scheduler"}} if load else None,
        "scheduler": setup.get("scheduler"),
        "versions": load.get("versions"),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created_at)),
    }
    return doc if long_video is None else {**doc, "long_video": long_video}


def params_text(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def write_params(out_dir: Path, *, job: JobRecord, seconds: dict[str, float | None],
                 load: dict[str, Any] | None, long_video: dict[str, Any] | None = None) -> str:
    """Write ``DIR/<job>/params.json`` atomically; returns its text for the ledger to record in the
    same transaction as the video it describes."""
    lanes = artifacts.latents_fast_lanes(out_dir, artifacts.latents_relpath(job.id))
    text = params_text(params_document(job=job, seconds=seconds, load=load, created_at=time.time(),
                                       fast_lanes=lanes, long_video=long_video))
    artifacts.write_artifact(out_dir, params_relpath(job.id), text.encode())
    return text


def restore_params(out_dir: Path, ledger: Ledger, job: JobRecord) -> str | None:
    """For a done job: rewrite params.json if it is missing or differs from the text the ledger
    recorded (a folder from before params.json existed gets one built from the ledger). Returns
    what was wrong, or None when the file was intact."""
    path = out_dir / params_relpath(job.id)
    recorded = ledger.document(job.id, PARAMS_NAME)
    if recorded is None:
        st = ledger.stages(job.id)
        recorded = params_text(params_document(job=job, seconds={s.value: st[s].seconds if s in st else None
                                                                 for s in STAGES},
                                               load=None, created_at=time.time()))
        problem = f"{params_relpath(job.id)} was never recorded"
    else:
        try:
            if path.read_bytes() == recorded.encode():
                return None
            problem = f"{params_relpath(job.id)} differs from the ledger's copy (truncated or edited)"
        except FileNotFoundError:
            problem = f"{params_relpath(job.id)} is missing"
    artifacts.write_artifact(out_dir, params_relpath(job.id), recorded.encode())
    ledger.set_document(job.id, PARAMS_NAME, recorded)
    return problem
