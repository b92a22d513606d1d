"""Raw jobs -> ``JobSpec``s: a name for each job without one, every job under every sweep
combination (built-in default < preset < defaults < job < --set < sweep value), and the checks
only a resolved job allows: its sampler settings together, its model's MagCache calibration when
it caches steps, the cost of its video, and two jobs that would render the same video."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

from pan2render.calibration_store import model_calibration_problem
from pan2render.jobs.coerce import LORA_SCALE_AXIS
from pan2render.jobs.context import LoadContext, RawJob
from pan2render.jobs.inputs import LIMITS, dit_tokens
from pan2render.jobs.references import image_hash, interpolation_hash, lora_hash
from pan2render.jobs.spec import BUILTIN_DEFAULTS, JOB_KEYS, JobSpec, LoraRef, Problem, SourceLocation
from pan2render.lanes import CACHE_NONE, lane_problems
from pan2render.long_video import video_frames
from pan2render.sampling import DMD, combination_problems


def _sweep_label(key: str, value: Any) -> Any:
    """What a job's id, status and report show for one sweep value: adapters by file stem and scale
    (``style@0.5+detail@1``, ``none``), other values as they are."""
    if key == "loras":
        return "+".join(r.label for r in value) or "none"
    if key == "interpolation_weights" and value is not None:
        return Path(value).stem
    return value


def _apply_lora_scales(merged: dict[str, Any], combo: dict[str, Any], raw: RawJob, ctx: LoadContext) -> bool:
    """Put each swept adapter scale (``loras[i].scale``) into the job's adapters; False (a problem
    noted once per job) when the job has no adapter ``i``."""
    for key, scale in combo.items():
        match = LORA_SCALE_AXIS.fullmatch(key)
        if match is None:
            continue
        i, loras = int(match[1]), merged["loras"]
        if i >= len(loras):
            problem = Problem(SourceLocation(raw.location.file, raw.lines.get("loras", raw.location.line)),
                              f"{raw.label}.loras", f"the sweep varies {key} but this job has {len(loras)} "
                              f"adapter(s); give it loras[{i}] (in the job or the defaults) or drop the axis")
            ctx.note_once(problem)
            return False
        merged["loras"] = (*loras[:i], LoraRef(loras[i].path, scale), *loras[i + 1:])
    return True


def resolve_prompts(raw: RawJob) -> None:
    """A story's first prompt is the job's ``prompt`` (its name, its conditioning, what status
    shows): given only ``prompts``, the job gets it (given both, `_check_long_video` sees that they
    agree)."""
    if raw.fields.get("prompts") is not None:
        raw.fields.setdefault("prompt", raw.fields["prompts"][0])


def _cut(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _derived_name(prompt: str) -> str:
    words = re.findall(r"[a-z0-9]+", prompt.lower())[:6]
    return "-".join(words)[:48].strip("-") or "job"


def name_jobs(raw_jobs: list[RawJob], ctx: LoadContext) -> None:
    """Check given names are unique; name the rest after their prompt, unique in file order."""
    seen: dict[str, SourceLocation] = {}
    for raw in raw_jobs:
        name = raw.fields.get("name")
        if name is None:
            continue
        line = raw.lines.get("name", raw.location.line)
        if name in seen:
            ctx.problem(line, raw.label + ".name",
                        f"duplicate job name {name!r} (first used at {seen[name]}); job names must be unique",
                        raw.location.file)
        else:
            seen[name] = SourceLocation(raw.location.file, line)
    taken = set(seen)
    # base -> the suffix its last job got: names only get taken, so every lower one still is. Many
    # jobs of one prompt then cost one probe each, not one per job before them.
    last: dict[str, int] = {}
    for raw in raw_jobs:
        if "name" in raw.fields or "prompt" not in raw.fields:
            continue
        base = _derived_name(raw.fields["prompt"])
        n = last.get(base, 1)
        name = base if n == 1 else f"{base}-{n}"
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name)
        last[base] = n
        raw.fields["name"] = name


def expand_jobs(raw_jobs: list[RawJob], *, model: str, weights: str | None, preset_name: str, preset: dict[str, Any],
                defaults: dict[str, Any], sets: dict[str, Any], sweep: dict[str, list[Any]],
                ctx: LoadContext) -> list[JobSpec]:
    """Resolve every job under every sweep combination:
    built-in < preset < defaults < job < --set < sweep (from the file or --sweep)."""
    keys = list(sweep)
    combos = [dict(zip(keys, values)) for values in itertools.product(*(sweep[k] for k in keys))]
    jobs: list[JobSpec] = []
    cached: dict[tuple[bool, bool], list[RawJob]] = {}  # (conditioned, guided) -> the jobs caching steps
    for raw in raw_jobs:
        for combo in combos:  # [{}] when there is no sweep
            merged = {**BUILTIN_DEFAULTS, **preset, **defaults, **raw.fields, **sets, **combo}
            if not _apply_lora_scales(merged, combo, raw, ctx):
                continue
            if "image" in combo and combo["image"] is not None:
                merged["image"] = str((ctx.base_dir / Path(combo["image"]).expanduser()).resolve())
            image = merged["image"]
            image_sha = None if image is None else image_hash(image, ctx)
            explicit = {**defaults, **raw.fields, **combo}
            if not _check_sampling(merged, raw, explicit, ctx) or not _check_long_video(
                    merged, raw, {**explicit, **sets}, ctx):
                continue
            rife = merged["interpolation_weights"]
            jobs.append(JobSpec(
                **{k: merged[k] for k in JOB_KEYS if k != "image"}, image=image, image_sha256=image_sha,
                lora_digests=tuple((lora_hash(r.path, ctx), r.scale) for r in merged["loras"]),
                interpolation_sha256=None if rife is None else interpolation_hash(rife, ctx),
                model=model, preset=preset_name, weights=weights,
                sweep={k: _sweep_label(k, v) for k, v in combo.items()}, source=raw.location,
            ))
            if merged["cache"] != CACHE_NONE:
                cached.setdefault((image is not None, merged["guidance"] > 1.0), []).append(raw)
    _check_calibrations(model, cached, ctx)
    return jobs


def _check_calibrations(model: str, cached: dict[tuple[bool, bool], list[RawJob]], ctx: LoadContext) -> None:
    """A job with ``cache: magcache`` needs its model's MagCache calibration for its kind of job: one
    problem per kind, at the first job of that kind, rather than every such job failing its sampling.
    Read from the calibration store and the folder's configs (never the weights)."""
    if not (ctx.check_files and ctx.check_model):
        return
    for (conditioned, guided), raws in cached.items():
        problem = model_calibration_problem(model, conditioned=conditioned, guided=guided)
        if problem is None:
            continue
        raw, count = raws[0], len(raws)
        more = f" ({count} jobs of the batch ask for it)" if count > 1 else ""
        ctx.problems.append(Problem(SourceLocation(raw.location.file, raw.lines.get("cache", raw.location.line)),
                                    f"{raw.label}.cache", f"got magcache; {problem}{more}"))


def check_cost(jobs: list[JobSpec], ctx: LoadContext) -> None:
    """One job's video must fit what the DiT and the VAE can hold (see InputLimits.dit_tokens), and
    a long one what its worker holds at once (InputLimits.video_bytes)."""
    seen: set[tuple[str, int, int, int]] = set()
    for job in jobs:
        assert job.source is not None
        _check_video_bytes(job, ctx)
        key = (str(job.source), job.frames, job.height, job.width)
        tokens = dit_tokens(frames=job.frames, height=job.height, width=job.width)
        if tokens <= LIMITS.dit_tokens or key in seen:
            continue
        seen.add(key)
        ctx.problem(job.source.line, "frames x height x width",
                    f"job {_describe(job)} asks for {job.frames} frames of {job.width}x{job.height} = "
                    f"{tokens:,} DiT tokens; allowed: at most {LIMITS.dit_tokens:,} tokens (e.g. 241 frames at "
                    "1088x1920): the DiT attends over all of them at once and the VAE decodes every pixel, so "
                    "more runs a GPU out of memory; lower frames, width or height", job.source.file)


def _check_sampling(merged: dict[str, Any], raw: RawJob, explicit: dict[str, Any], ctx: LoadContext) -> bool:
    """The sampler/timesteps/guidance rules of one resolved job; with dmd timesteps, ``steps`` becomes
    their number (an explicit, different ``steps`` is a problem). False if the job is invalid."""
    problems = combination_problems(sampler=merged["sampler"], timesteps=merged["timesteps"],
                                    guidance=merged["guidance"])
    problems += lane_problems(sampler=merged["sampler"], cache=merged["cache"])
    if merged["sampler"] == DMD and merged["timesteps"] is not None:
        count = len(merged["timesteps"])
        if "steps" in explicit and explicit["steps"] != count:
            problems.append(("steps", f"got {explicit['steps']} but the job lists {count} timesteps; with "
                                      "sampler dmd the step count is the number of timesteps: drop steps"))
        merged["steps"] = count
    for fld, message in problems:
        problem = Problem(SourceLocation(raw.location.file, raw.lines.get(fld, raw.location.line)),
                          f"{raw.label}.{fld}", message)
        ctx.note_once(problem)  # once per job, not once per sweep combination
    return not problems


def _check_long_video(merged: dict[str, Any], raw: RawJob, explicit: dict[str, Any], ctx: LoadContext) -> bool:
    """Segments and interpolation of one resolved job: a story's prompts give its segments (an
    explicit, different ``segments`` is a problem; one prompt is a job of one segment, as a plain
    ``prompt`` is), and interpolating needs its weights. False if the job is invalid."""
    problems = []
    prompts = merged["prompts"]
    if prompts is not None:
        if "segments" in explicit and explicit["segments"] != len(prompts):
            problems.append(("segments", f"got {explicit['segments']} but the job lists {len(prompts)} prompts, one "
                                         f"per segment; drop segments, or give {explicit['segments']} prompts"))
        if merged["prompt"] != prompts[0]:
            problems.append(("prompt", f"differs from prompts[0] ({_cut(prompts[0])}); with `prompts` the first "
                                       "segment's prompt is prompts[0]: drop `prompt`, or make it the same"))
        merged["segments"] = len(prompts)
        if len(prompts) == 1:
            merged["prompts"] = None
    if merged["interpolate"] > 1 and merged["interpolation_weights"] is None:
        problems.append(("interpolate", f"interpolate {merged['interpolate']} needs `interpolation_weights`: the RIFE "
                                        "IFNet weights file it runs (a path relative to this file)"))
    for fld, message in problems:
        ctx.note_once(Problem(SourceLocation(raw.location.file, raw.lines.get(fld, raw.location.line)),
                              f"{raw.label}.{fld}", message))
    return not problems


def _check_video_bytes(job: JobSpec, ctx: LoadContext) -> None:
    frames = video_frames(job)
    size = frames * job.height * job.width * 3
    if size > LIMITS.video_bytes:
        assert job.source is not None
        ctx.note_once(Problem(job.source, "segments x frames x interpolate",
                              f"job {_describe(job)} makes a video of {frames:,} frames of {job.width}x{job.height}, "
                              f"{size / 2**30:.1f} GiB of RGB frames; allowed: at most {LIMITS.video_bytes >> 30} GiB "
                              "(its worker holds the whole video at once to colour-match, interpolate and encode it): "
                              "fewer segments or frames, a smaller interpolation factor, or a smaller size"))


def _describe(job: JobSpec) -> str:
    sweep = "".join(f" {k}={v}" for k, v in job.sweep.items())
    return f"{job.name!r}{' with' + sweep if sweep else ''}"


def check_unique(jobs: list[JobSpec], ctx: LoadContext) -> None:
    """Two resolved jobs that would render the same video (or share an id) are a mistake."""
    by_render: dict[tuple[str, int], JobSpec] = {}
    by_id: dict[str, JobSpec] = {}
    for job in jobs:
        assert job.source is not None
        key = (job.spec_hash, job.gpus)
        if key in by_render:
            first = by_render[key]
            ctx.problem(job.source.line, "jobs",
                        f"job {_describe(job)} resolves to exactly the same render as job {_describe(first)} "
                        f"({first.source}); remove one or change its prompt, seed or settings",
                        job.source.file)
            continue
        by_render[key] = job
        if job.job_id in by_id:
            other = by_id[job.job_id].source
            ctx.problem(job.source.line, "jobs", f"job id {job.job_id!r} is used twice (also {other}); "
                                                 "rename one of the jobs", job.source.file)
        by_id[job.job_id] = job
