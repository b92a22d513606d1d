"""Typed records shared by the batch parser, the ledger and the runner, and the job schema.

The parser (``pan2render.jobs.batch``) turns a YAML batch into these dataclasses once; nothing
downstream reads raw YAML dicts.

``JobSpec`` is the one description of a job's fields: each field's ``Rule`` (its dataclass
metadata, ``jobs/rules.py``) says where a batch may set it, what values are allowed, what it does and whether it
changes the video. The batch keys and value checks, the built-in defaults, the hash behind the job
id, the pipeline's sampling arguments and the README's field table are all derived from it, so a
new field is one declaration here (plus what the pipeline does with it).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pan2render import lanes
from pan2render.jobs.inputs import LIMITS
from pan2render.jobs.rules import Kind, Rule, Scope, before_field, rule_of
from pan2render.jobs.rules import with_rule as _rule  # (short: every field below is declared with it)
from pan2render.media.x264 import DEFAULT_X264_PRESET, DEFAULT_X264_TUNE, X264_PRESETS, X264_TUNES
from pan2render.sampling import DEFAULT_NUM_TRAIN_TIMESTEPS, DMD, SAMPLERS, WAN22

ALLOWED_GPUS = (1, 2, 4, 8)
INTERPOLATION_FACTORS = (1, 2, 4)  # `interpolate`: 1 is off
# Seeds are stored in the SQLite ledger (signed 64-bit INTEGER) and fed to torch.Generator.
MAX_SEED = 2**63 - 1
# The mp4's frame rate: what players and libx264 handle (a tiny rate passed validation and then
# failed only at encode time, after the sampling it needed).
FPS_RANGE = (1.0, 240.0)


@dataclass(frozen=True)
class LoraRef:
    """One adapter of a job: its file (absolute once resolved) and its scale (1.0: as trained)."""

    path: str
    scale: float = 1.0

    @property
    def label(self) -> str:
        """How a sweep over adapters names it: ``style@0.5``."""
        return f"{Path(self.path).stem}@{self.scale:g}"


@dataclass(frozen=True)
class SourceLocation:
    """Where a value came from, for error messages: ``file:line``, or a command-line flag as typed
    (``--set steps=x``), which has no line: ``line`` 0."""

    file: str
    line: int

    def __str__(self) -> str:
        return self.file if self.line == 0 else f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a batch file."""

    location: SourceLocation
    field: str  # dotted path, e.g. "jobs[2].frames"
    message: str  # what is wrong and what is allowed

    def __str__(self) -> str:
        return f"{self.location}: {self.field}: {self.message}"


class BatchValidationError(Exception):
    """A batch has one or more problems; all of them are listed, none of the batch ran."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) in the batch:\n{lines}")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One fully resolved job: preset < defaults < job < sweep value already applied.

    Declared in the order a batch lists its job fields (the order of messages and the README).
    """

    prompt: str = _rule(Rule(
        "what the video shows", pixels=True, in_first_ids=True, scope=Scope.JOB, kind=Kind.TEXT,
        max_chars=LIMITS.text_chars, allowed="a non-empty string of at most {max_chars:,} characters"))
    name: str = _rule(Rule(
        "readable name, unique in the batch; an unnamed job is named after its prompt's first words",
        pixels=False, scope=Scope.JOB, kind=Kind.LINE, max_chars=LIMITS.name_chars,
        allowed="a non-empty string of at most {max_chars:,} characters"))
    # Scheduling, not content: not in the job id (jobs/after.py holds what it names and its checks).
    after: tuple[str, ...] = _rule(Rule(
        "jobs of this batch that must be done (video written) before this one starts; a swept job's name "
        "stands for every job its sweep makes", pixels=False, scope=Scope.JOB, kind=Kind.NAMES,
        max_chars=LIMITS.name_chars,
        allowed="a job name of this batch or a list of them, e.g. [fox, harbour] (no job may wait for itself, "
                "nor jobs wait for each other in a cycle)"), ())
    negative_prompt: str = _rule(Rule(
        "what guidance steers away from", pixels=True, in_first_ids=True, scope=Scope.PRESET,
        kind=Kind.TEXT, empty_ok=True, max_chars=LIMITS.text_chars,
        allowed="a string (may be empty) of at most {max_chars:,} characters"), "")
    # The path is not hashed, its content is (image_sha256): a moved image keeps its jobs.
    image: str | None = _rule(Rule(
        "first frame to animate (TI2V): PNG, JPEG or WebP", pixels=False, scope=Scope.DEFAULTS,
        kind=Kind.PATH, max_chars=LIMITS.path_chars,
        allowed="a path to an image file, relative to this file (at most {max_chars:,} characters)"), None)
    seed: int = _rule(Rule(
        "noise seed", pixels=True, in_first_ids=True, scope=Scope.DEFAULTS, kind=Kind.INT,
        allowed="an integer in {min}..{max}", min=0, max=MAX_SEED, to_sampler=True), 0)
    steps: int = _rule(Rule(
        "denoising steps (with sampler dmd: the number of timesteps)", pixels=True, in_first_ids=True,
        scope=Scope.PRESET, kind=Kind.INT, min=1, max=LIMITS.steps, to_sampler=True,
        allowed="an integer from {min} to {max} (sampling steps; the flow-matching schedule has {max} "
                "training timesteps)"))
    guidance: float = _rule(Rule(
        "classifier-free guidance scale", pixels=True, in_first_ids=True, scope=Scope.PRESET,
        kind=Kind.FLOAT, min=1.0, max=LIMITS.guidance, to_sampler=True,
        allowed="a number from {min} to {max:g} ({min} turns classifier-free guidance off)"))
    height: int = _rule(Rule(
        "frame height in pixels", pixels=True, in_first_ids=True, scope=Scope.PRESET, kind=Kind.INT,
        min=0, min_open=True, max=LIMITS.side, step=WAN22.spatial_multiple, to_sampler=True,
        allowed=f"a positive multiple of {{step}} (VAE {WAN22.vae_spatial}x times DiT patch {WAN22.patch[1]}) "
                "up to {max} (libx264's largest frame), e.g. 704, 1248"))
    width: int = _rule(Rule(
        "frame width in pixels", pixels=True, in_first_ids=True, scope=Scope.PRESET, kind=Kind.INT,
        min=0, min_open=True, max=LIMITS.side, step=WAN22.spatial_multiple, to_sampler=True,
        allowed=f"a positive multiple of {{step}} (VAE {WAN22.vae_spatial}x times DiT patch {WAN22.patch[1]}) "
                "up to {max} (libx264's largest frame), e.g. 704, 1248"))
    frames: int = _rule(Rule(
        "frames of the video", pixels=True, in_first_ids=True, scope=Scope.PRESET, kind=Kind.INT,
        min=1, max=WAN22.max_frames, step=WAN22.vae_temporal, offset=1, to_sampler=True,
        allowed="{step}k+1 frames (1, 5, ..., 17, ..., 81, ..., 121) up to {max} (the DiT's positional "
                f"table holds {WAN22.rope_extent} latent frames)"))
    fps: float = _rule(Rule(
        "frame rate of the mp4", pixels=True, in_first_ids=True, scope=Scope.PRESET, kind=Kind.FLOAT,
        min=FPS_RANGE[0], max=FPS_RANGE[1],
        to_encoder="fps", allowed="a number from {min:g} to {max:g} (frames per second of the mp4, e.g. 24)"))
    flow_shift: float = _rule(Rule(
        "how far the schedule leans to the noisy end", pixels=True, in_first_ids=True, scope=Scope.PRESET,
        kind=Kind.FLOAT, min=0, min_open=True, max=LIMITS.flow_shift, to_sampler=True,
        allowed="a number > {min} and at most {max:g} (flow-matching timestep shift; 5.0 for 720p, 3.0 for 480p)"))
    sampler: str = _rule(Rule(
        "unipc and euler run `steps`; dmd (step-distilled checkpoints) runs `timesteps`", pixels=True,
        in_first_ids=True, scope=Scope.PRESET, kind=Kind.CHOICE, choices=SAMPLERS, to_sampler=True))
    gpus: int = _rule(Rule(
        "GPUs of the group that renders the job (sequence-parallel)", pixels=False, scope=Scope.PRESET,
        kind=Kind.CHOICE, choices=ALLOWED_GPUS), 1)
    # Not in the job id: a stopped sampling resumed from a step checkpoint gives the same latents.
    checkpoint_every: float = _rule(Rule(
        "seconds of sampling between step checkpoints, which a stopped or preempted sampling resumes from",
        pixels=False, scope=Scope.PRESET, kind=Kind.FLOAT, min=0,
        allowed="a number of seconds >= {min:g} ({min:g} turns step checkpoints off)"), 60.0)
    # Not in the job id either: a preview only reads the sampling (the same latents with or without).
    preview_every: float = _rule(Rule(
        "seconds of sampling between live previews (a small picture of the predicted frames in the "
        "job's folder and the farm's monitor)", pixels=False, scope=Scope.PRESET, kind=Kind.FLOAT, min=0,
        allowed="a number of seconds >= {min:g} ({min:g} turns previews off)"), 5.0)
    crf: int = _rule(Rule(
        "libx264 quality of the mp4", pixels=True, in_first_ids=True, scope=Scope.PRESET, kind=Kind.INT,
        min=0, max=51, to_encoder="crf",
        allowed="an integer in {min}..{max} (libx264 quality, lower is better; 18 is near lossless)"))
    # None: the checkpoint's own (dmd) or not applicable (unipc, euler).
    timesteps: tuple[int, ...] | None = _rule(Rule(
        "sampler dmd: the timesteps to run, noisiest first", pixels=True, scope=Scope.PRESET,
        kind=Kind.TIMESTEPS, to_sampler=True,
        allowed=f"a non-empty list of integers in 1..{DEFAULT_NUM_TRAIN_TIMESTEPS}, strictly decreasing, "
                "e.g. [1000, 757, 522]"), None)
    # Fast lanes (pan2render.lanes; README "Fast lanes"): each trades a little quality for time,
    # and `pan2-render compare` measures how much against the same job without it.
    cache: str = _rule(Rule(
        "step cache: magcache reuses the DiT's block residual on steps its calibration says change little",
        pixels=True, scope=Scope.PRESET, kind=Kind.CHOICE, choices=lanes.CACHES, to_sampler=True), lanes.CACHE_NONE)
    cache_threshold: float = _rule(Rule(
        "magcache: accumulated magnitude error allowed before a step computes again (0 never reuses)",
        pixels=True, scope=Scope.PRESET, kind=Kind.FLOAT, min=0, to_sampler=True,
        inert_when=("cache", lanes.CACHE_NONE),
        allowed="a number >= {min:g} (MagCache's Wan2.2-TI2V-5B setting: 0.06)"), lanes.DEFAULT_CACHE_THRESHOLD)
    cache_max_skips: int = _rule(Rule(
        "magcache: consecutive steps that may reuse the residual (MagCache's K)", pixels=True, scope=Scope.PRESET,
        kind=Kind.INT, min=0, max=LIMITS.steps, to_sampler=True, inert_when=("cache", lanes.CACHE_NONE),
        allowed="an integer from {min:g} to {max:g} (0 never reuses)"), lanes.DEFAULT_CACHE_MAX_SKIPS)
    cache_retention: float = _rule(Rule(
        "magcache: first fraction of the model calls always computed", pixels=True, scope=Scope.PRESET,
        kind=Kind.FLOAT, min=0, max=1, to_sampler=True, inert_when=("cache", lanes.CACHE_NONE),
        allowed="a number from {min:g} to {max:g}"), lanes.DEFAULT_CACHE_RETENTION)
    guidance_until: float = _rule(Rule(
        "fraction of the steps run with both guidance branches; later steps reuse the last difference",
        pixels=True, scope=Scope.PRESET, kind=Kind.FLOAT, min=0, min_open=True, max=1, to_sampler=True,
        inert_when=("guidance", 1.0), allowed="a number > {min:g} and <= {max:g} (1: every step guided)"),
        lanes.DEFAULT_GUIDANCE_UNTIL)
    precision: str = _rule(Rule(
        "the DiT's per-token linears: bf16, or fp8 e4m3 with per-row scales (CUDA compute capability 8.9+)",
        pixels=True, scope=Scope.PRESET, kind=Kind.CHOICE, choices=lanes.PRECISIONS, to_sampler=True), lanes.BF16)
    encode_preset: str = _rule(Rule(
        "libx264 speed/size trade-off (not the job preset): slower gives a smaller file at a given crf",
        pixels=True, scope=Scope.PRESET, kind=Kind.CHOICE, choices=X264_PRESETS, to_encoder="preset",
        before_field="medium"), DEFAULT_X264_PRESET)
    encode_tune: str = _rule(Rule(
        "libx264 tuning for the content, e.g. animation for flat colours and sharp edges", pixels=True,
        scope=Scope.PRESET, kind=Kind.CHOICE, choices=X264_TUNES, to_encoder="tune"), DEFAULT_X264_TUNE)
    # The paths are not hashed, the files' contents are (lora_digests): a moved file keeps its jobs.
    loras: tuple[LoraRef, ...] = _rule(Rule(
        "LoRA adapters merged into the DiT, in order; each file's content and scale are in the job id",
        pixels=False, scope=Scope.DEFAULTS, kind=Kind.LORAS,
        allowed=f"a list of at most {LIMITS.loras} .safetensors files (relative to this file), each a path or "
                f"{{{{path, scale}}}} with a scale in -{LIMITS.lora_scale:g}..{LIMITS.lora_scale:g} (default 1.0)"), ())
    # A longer, smoother video (pan2render.long_video): chained segments and frame interpolation.
    # Left at 1 they change nothing, and are not hashed: every job before them keeps its id.
    segments: int = _rule(Rule(
        "clips rendered one after another, each conditioned on the previous one's last frame (colour-matched "
        "to the first) and joined without repeating it", pixels=True, scope=Scope.PRESET, kind=Kind.INT, min=1,
        max=LIMITS.segments, allowed="an integer from {min:g} to {max:g} (the video has segments x frames - "
                                     "(segments - 1) frames)"), 1)
    # A story: segment k's prompt. Its number gives `segments`; `prompt` is its first (and may be left out).
    prompts: tuple[str, ...] | None = _rule(Rule(
        "one prompt per segment, in order (a story); their number is the job's segments", pixels=True,
        scope=Scope.JOB, kind=Kind.PROMPTS, min=1, max=LIMITS.segments, max_chars=LIMITS.text_chars,
        allowed="a list of {min:g} to {max:g} non-empty strings of at most {max_chars:,} characters each"), None)
    interpolate: int = _rule(Rule(
        "frame interpolation (RIFE) after decode: factor F puts F - 1 frames between every two and plays F "
        "times as many a second", pixels=True, scope=Scope.PRESET, kind=Kind.CHOICE, choices=INTERPOLATION_FACTORS,
        allowed="one of {choices} (1: off; the video gets (n - 1) x F + 1 frames at fps x F)"), 1)
    # The path is not hashed, its content is (interpolation_sha256): a moved file keeps its jobs.
    interpolation_weights: str | None = _rule(Rule(
        "the RIFE IFNet weights file `interpolate` runs", pixels=False, scope=Scope.DEFAULTS, kind=Kind.PATH,
        max_chars=LIMITS.path_chars,
        allowed="a path to a RIFE IFNet weights file, relative to this file (at most {max_chars:,} characters)"),
        None)

    # Resolved by the batch, not set in it.
    model: str = _rule(Rule("\"tiny\" or an absolute checkpoint folder", pixels=True, in_first_ids=True))
    preset: str = _rule(Rule("the job preset's name", pixels=False))
    image_sha256: str | None = _rule(Rule(
        "content hash of the image, so the job id follows its pixels", pixels=True, in_first_ids=True), None)
    # (sha256, scale) of each of `loras`, in order; hashed only when there are any, so jobs without
    # adapters keep their ids.
    lora_digests: tuple[tuple[str | None, float], ...] = _rule(Rule(
        "content hash and scale of each LoRA, so the job id follows the adapters' weights", pixels=True), ())
    interpolation_sha256: str | None = _rule(Rule(
        "content hash of the interpolation weights, so the job id follows them", pixels=True,
        inert_when=("interpolate", 1)), None)
    # A checkpoint replaced under the same path makes new jobs.
    weights: str | None = _rule(Rule(
        "fingerprint of the checkpoint folder's weights (jobs.weights); None for the tiny model",
        pixels=True), None)
    sweep: dict[str, Any] = _rule(Rule("the sweep values applied to this job", pixels=False), factory=dict)
    source: SourceLocation | None = _rule(Rule("where the job was written", pixels=False), None)

    # Cached: a spec is frozen, and a batch of 20,000 jobs asks each for its id many times over.
    @functools.cached_property
    def spec_hash(self) -> str:
        """sha256 over the render-affecting fields, as canonical JSON: each one hashed since the
        first ids or set away from its value before it existed, and not made inert by another."""
        payload = {}
        for name, always, before, inert_when in HASHING:
            value = getattr(self, name)
            if (always or value != before) and not (inert_when is not None
                                                    and getattr(self, inert_when[0]) == inert_when[1]):
                payload[name] = value
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    @functools.cached_property
    def job_id(self) -> str:
        """Readable, filesystem-safe and deterministic: ``<name>[-<field><value>...]-<hash8>``.

        Only ``[a-z0-9._-]`` survive, the id never starts with a dot, and it is capped in length,
        so a job's folder can never escape the output folder whatever the job is named.
        """
        parts = [self.name] + [f"{k}{v}" for k, v in sorted(self.sweep.items())]
        readable = _slug("-".join(parts))[:80].strip("-.") or "job"
        return f"{readable}-{self.spec_hash[:8]}"

    @property
    def version_key(self) -> str:
        """What stays the same when a batch is edited and run again: the job's name and sweep
        values. Two jobs of one folder with this key and other ids are versions of one job, the
        newer superseding the older."""
        return json.dumps([self.name, self.sweep], sort_keys=True, default=str)

    def changes_from(self, older: JobSpec) -> list[tuple[str, Any, Any]]:
        """(field, older value, this value) for each field that changes the pixels and differs."""
        return [(f.name, getattr(older, f.name), getattr(self, f.name)) for f in PIXEL_FIELDS
                if getattr(older, f.name) != getattr(self, f.name)]

    def sample_args(self) -> dict[str, Any]:
        """The keyword arguments ``PAN2Pipeline.sample`` takes from this job: its sampler fields."""
        args = {f.name: getattr(self, f.name) for f in SAMPLER_FIELDS}
        if self.sampler == DMD:  # the step count is the number of timesteps, the job's or the checkpoint's own
            args["steps"] = None
        return args

    def encode_args(self) -> dict[str, Any]:
        """The keyword arguments ``encode_mp4`` takes from this job: its encoder fields."""
        return {rule_of(f).to_encoder: getattr(self, f.name) for f in ENCODER_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        """What ``dataclasses.asdict`` gives (adapters as dicts, tuples as tuples, copies of the
        containers), ``source`` as ``{file, line}``; built field by field: asdict deep-copies every
        string and number too, which made it most of the cost of recording or reporting a batch."""
        d = {f.name: _plain(getattr(self, f.name)) for f in FIELDS}
        d["source"] = None if self.source is None else {"file": self.source.file, "line": self.source.line}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JobSpec":
        d = dict(d)
        src = d.pop("source", None)
        for key in ("timesteps", "prompts"):  # JSON gives a list
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        d["after"] = tuple(d.get("after", ()))
        d["loras"] = tuple(LoraRef(**r) for r in d.get("loras", ()))
        d["lora_digests"] = tuple((sha, float(scale)) for sha, scale in d.get("lora_digests", ()))
        return cls(**d, source=None if src is None else SourceLocation(src["file"], int(src["line"])))


# --------------------------------------------------------------------------------------------------
# Derived from the schema


FIELDS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(JobSpec)
RULES: dict[str, Rule] = {f.name: rule_of(f) for f in FIELDS}
# Fields that change the rendered video, hence the job id.
PIXEL_FIELDS = tuple(f for f in FIELDS if rule_of(f).pixels)
RENDER_FIELDS = tuple(f.name for f in PIXEL_FIELDS)
# How each pixel field counts in the job id (JobSpec.spec_hash), read from its rule once rather
# than for every job: (name, hashed whatever its value, its value before it existed, inert_when).
HASHING = tuple((f.name, rule_of(f).in_first_ids, before_field(f), rule_of(f).inert_when) for f in PIXEL_FIELDS)
SAMPLER_FIELDS = tuple(f for f in FIELDS if rule_of(f).to_sampler)
ENCODER_FIELDS = tuple(f for f in FIELDS if rule_of(f).to_encoder)

# What a batch's job may set; `defaults` (and sweeps, --set) anything but what identifies one job;
# a preset holds render settings only (no paths, no seeds).
JOB_KEYS = tuple(f.name for f in FIELDS if rule_of(f).scope is not Scope.NOWHERE)
DEFAULTS_KEYS = tuple(f.name for f in FIELDS if rule_of(f).scope in (Scope.DEFAULTS, Scope.PRESET))
PRESET_FIELDS = tuple(f.name for f in FIELDS if rule_of(f).scope is Scope.PRESET)
# The value a field settable in a batch gets when nothing sets it; the others a preset must give.
BUILTIN_DEFAULTS: dict[str, Any] = {f.name: f.default for f in FIELDS
                                    if f.name in JOB_KEYS and f.default is not dataclasses.MISSING}
PRESET_REQUIRED = tuple(k for k in PRESET_FIELDS if k not in BUILTIN_DEFAULTS)


def _check_schema() -> None:
    for f in FIELDS:
        rule = rule_of(f)
        if rule.pixels and not rule.in_first_ids and f.default is dataclasses.MISSING:
            raise TypeError(f"JobSpec.{f.name}: a pixel field added after the first job ids needs a default "
                            "(it counts in the hash only when set away from it, so old ids stay)")
        if (rule.scope is Scope.NOWHERE) != (rule.kind is None):
            raise TypeError(f"JobSpec.{f.name}: a field a batch may set needs a kind, and only such a field")
        if rule.inert_when is not None and rule.inert_when[0] not in {g.name for g in FIELDS}:
            raise TypeError(f"JobSpec.{f.name}: inert_when names {rule.inert_when[0]!r}, which is not a field")
        if (rule.to_sampler or rule.to_encoder) and not rule.pixels:
            raise TypeError(f"JobSpec.{f.name}: what the sampler or the encoder reads changes the video: pixels=True")

    declared = {f.name: f.default for f in SAMPLER_FIELDS}
    for name in lanes.FAST_LANE_FIELDS:
        if declared.get(name, dataclasses.MISSING) != getattr(lanes.FastLanes(), name):
            raise TypeError(f"JobSpec.{name}: a fast-lane field handed to the sampler, with FastLanes' default")


_check_schema()


def field_table() -> str:
    """The README's table of job fields, as markdown."""
    rows = ["| field | what it does | allowed | default | set in | hashed into the job id |",
            "|---|---|---|---|---|---|"]
    for name in JOB_KEYS:
        f = next(f for f in FIELDS if f.name == name)
        rule = rule_of(f)
        if f.default is not dataclasses.MISSING:
            default = "none" if f.default is None else f"`{json.dumps(f.default)}`"
        else:
            default = "from the preset" if rule.scope is Scope.PRESET else "required" if name == "prompt" else "-"
        in_id = ("no" if not rule.pixels else "yes" if rule.in_first_ids
                 else "yes, when not the default" if before_field(f) == f.default
                 else f"yes, when not `{before_field(f)}`")
        rows.append(f"| `{name}` | {rule.help} | {rule.allowed_text()} | {default} | {rule.scope.value} | {in_id} |")
    return "\n".join(rows) + "\n"


@dataclass(frozen=True)
class Batch:
    """A parsed, validated batch file."""

    path: str
    model: str
    preset: str
    jobs: list[JobSpec]
    # The model folder's per-file fingerprints ({relpath: {"size", "sha256"}}), recorded in
    # the ledger so a later change can be explained file by file; empty for the tiny model.
    weights_files: dict[str, Any] = field(default_factory=dict)
    text: str | None = None  # the batch file as read (the output folder keeps a copy)


def _plain(value: Any) -> Any:
    """A field's value as ``dataclasses.asdict`` turns it: a dataclass into a dict, a tuple, list or
    dict into a new one of its items turned so; a string, number, bool or None is itself (what
    asdict's deep copy returns for them), anything else a deep copy."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if type(value) in (tuple, list):
        return type(value)(_plain(v) for v in value)
    if type(value) is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    return copy.deepcopy(value)


def _slug(text: str) -> str:
    text = text.lower()
    text = re.sub(r"[^a-z0-9._-]+", "-", text)
    text = re.sub(r"-{2,}", "-", text)
    return text.lstrip(".")
