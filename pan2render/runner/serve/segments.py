"""A chained job's segments on the driver (``long_video``): the calls that render each, what each
leaves on disk, and how that is checked on resume. Part of the sampling stage (``SamplingStep``
hands a job of more than one segment to this module).

Each segment k (from 1) is two calls on the group's GPU lane and two durable results::

    SampleCall(segment k)        -> DIR/<job>/segments/<k>/latents.safetensors
    SegmentFrameCall(segment k)  -> DIR/<job>/segments/<k>/last.png, then segment.json

``segment.json`` is written last (each file to a temp name, then renamed): it names both files
with their sha256 and records what the segment was made from (its prompt, seed and frames, the
frame it was conditioned on and that frame's sha256, its colour statistics, the attempt that made
it). The ledger mirrors the records (document ``segments``) for ``status``, and logs each segment;
the disk is the truth, as for a step checkpoint: a segment written just before a crash, before its
record reached the ledger, still counts, and ``repair`` loses none.

Resume: the segments done are the longest run from segment 1 whose records check out (this job's
spec hash, index and seed, both files matching their digests, and conditioned on what is now the
previous segment's last frame, or for the first on the job's image). The next one is rendered from
its latents when they are on disk and say they are that segment, conditioned on that frame (a crash
between its sampling and its decode), else from its sampling (continuing its step checkpoint, if
any). A segment redone because its files were damaged may end on another last frame, so every
later one, conditioned on the old frame, is redone too. The sampling stage is done when all are.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pan2render.jobs.ledger import EventKind, Stage, StageEvent
from pan2render.jobs.spec import JobSpec
from pan2render.jobs.weights import sha256_file
from pan2render.long_video import ColourStats, segment_prompts, segment_seed
from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.artifacts import LAST_FRAME_NAME, LATENTS_NAME, SEGMENT_RECORD_NAME, Recorded
from pan2render.runner.protocol.messages import (
    SampleReply,
    Segment,
    SegmentFrameCall,
    SegmentFrameReply,
    SegmentLatents,
    WorkerCall,
)
from pan2render.runner.serve.attempt import JobRun
from pan2render.runner.serve.jobflow import BatchFlow


@dataclass(frozen=True)
class SegmentRecord:
    """What ``segment.json`` says of one segment done."""

    index: int
    count: int
    spec_hash: str
    prompt: str
    seed: int
    frames: int
    conditioning: str  # what its first frame was: "none", "image" (the job's), or "segment k" (its last frame)
    conditioning_sha256: str | None  # that image's or frame's file
    latents: Recorded
    last_frame: Recorded  # colour-matched to segment 1 (the first: as decoded)
    colour: ColourStats  # of its frames as decoded, before matching
    matched_to: int | None  # the segment whose colour it was moved onto (None: the first, the reference)
    attempt: int  # the job's attempt that made it
    seconds: dict[str, float | None]  # "sampling" (None: sampled by an earlier attempt), "decode"

    def to_json(self) -> dict[str, Any]:
        files = {k: {"artifact": r.relpath, "sha256": r.sha256, "size": r.size}
                 for k, r in (("latents", self.latents), ("last_frame", self.last_frame))}
        return {"index": self.index, "count": self.count, "spec_hash": self.spec_hash, "prompt": self.prompt,
                "seed": self.seed, "frames": self.frames, "conditioning": self.conditioning,
                "conditioning_sha256": self.conditioning_sha256, **files, "colour": self.colour.to_json(),
                "matched_to": self.matched_to, "attempt": self.attempt, "seconds": self.seconds}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SegmentRecord:
        files = {k: Recorded(str(d[k]["artifact"]), str(d[k]["sha256"]), int(d[k]["size"]))
                 for k in ("latents", "last_frame")}
        return cls(index=int(d["index"]), count=int(d["count"]), spec_hash=str(d["spec_hash"]), prompt=str(d["prompt"]),
                   seed=int(d["seed"]), frames=int(d["frames"]), conditioning=str(d["conditioning"]),
                   conditioning_sha256=d["conditioning_sha256"], colour=ColourStats.from_json(d["colour"]),
                   matched_to=d["matched_to"], attempt=int(d["attempt"]), seconds=dict(d["seconds"]), **files)


def segment_of(spec: JobSpec, k: int) -> Segment:
    return Segment(index=k, count=spec.segments, seed=segment_seed(spec.seed, k))


# ---------------------------------------------------------------------- what the disk holds
def done_segments(out_dir: Path, spec: JobSpec) -> tuple[list[SegmentRecord], str | None]:
    """The segments done, from the first, and why the next one is not (None: all are)."""
    done: list[SegmentRecord] = []
    conditioning = spec.image_sha256
    for k in range(1, spec.segments + 1):
        rec, problem = _read_record(out_dir, spec, k)
        if rec is not None:
            problem = _record_problem(out_dir, spec, rec, k, conditioning)
        if rec is None or problem is not None:
            return done, problem
        done.append(rec)
        conditioning = rec.last_frame.sha256
    return done, None


def _read_record(out_dir: Path, spec: JobSpec, k: int) -> tuple[SegmentRecord | None, str]:
    rel = artifacts.segment_relpath(spec.job_id, k, SEGMENT_RECORD_NAME)
    try:
        return SegmentRecord.from_json(json.loads((out_dir / rel).read_bytes())), ""
    except FileNotFoundError:
        return None, f"segment {k} of {spec.segments} is not done"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{rel} is unreadable ({type(e).__name__}: {e})"


def _record_problem(out_dir: Path, spec: JobSpec, rec: SegmentRecord, k: int, conditioning: str | None) -> str | None:
    if (rec.spec_hash, rec.index, rec.seed) != (spec.spec_hash, k, segment_seed(spec.seed, k)):
        return f"segment {k}'s record is of another job or segment"
    if rec.conditioning_sha256 != conditioning:
        return f"segment {k} was conditioned on a frame that is no longer the one before it"
    for name, want in (("latents", rec.latents), ("last frame", rec.last_frame)):
        if want.relpath != artifacts.segment_relpath(spec.job_id, k, Path(str(want.relpath)).name):
            return f"segment {k}'s record names a {name} file outside its folder"
        if _digest(out_dir / str(want.relpath)) != want.sha256:
            return f"segment {k}'s {name} ({want.relpath}) is missing or does not match its sha256"
    return None


# A file's sha256 by its identity (device, inode, size, mtime): the segments done are checked before
# every call of a chained job, and hashing each segment's latents every time would grow with the
# square of the segments.
_DIGESTS: OrderedDict[tuple[str, int, int, int, int], str] = OrderedDict()
_DIGESTS_KEPT = 4096


def _digest(path: Path) -> str | None:
    try:
        st = path.stat()
    except OSError:
        return None
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        try:
            _DIGESTS[key] = sha256_file(path)
        except OSError:
            return None
        while len(_DIGESTS) > _DIGESTS_KEPT:
            _DIGESTS.popitem(last=False)
    return _DIGESTS[key]


def _sampled(out_dir: Path, spec: JobSpec, segment: Segment, conditioning: str | None) -> bytes | None:
    """Segment ``segment``'s latents when they are on disk, whole, and say they are that segment
    conditioned on ``conditioning``; None otherwise (it is sampled)."""
    rel = artifacts.segment_relpath(spec.job_id, segment.index, LATENTS_NAME)
    if not (out_dir / rel).is_file():
        return None
    want = {"index": segment.index, "seed": segment.seed, "conditioning_sha256": conditioning}
    if artifacts.check_latents(out_dir, Recorded(rel, None, None), spec=spec, require_digest=True) is not None \
            or artifacts.latents_segment(out_dir, rel) != want:
        return None
    return (out_dir / rel).read_bytes()


def all_done_problem(out_dir: Path, spec: JobSpec) -> str | None:
    """None when every segment of the job is done, else why not."""
    done, problem = done_segments(out_dir, spec)
    return None if len(done) == spec.segments else problem


def sampling_fields(out_dir: Path, spec: JobSpec) -> dict[str, Any] | None:
    """The sampling stage's row when every segment is done (its artifact: the last one's latents),
    for ``repair`` and a stage recorded after a crash; None when a segment is not."""
    done, _ = done_segments(out_dir, spec)
    if len(done) != spec.segments:
        return None
    last = done[-1].latents
    secs = [r.seconds.get("sampling") for r in done]
    return {"artifact": last.relpath, "sha256": last.sha256, "size": last.size,
            "seconds": None if None in secs else sum(s or 0.0 for s in secs)}


# ---------------------------------------------------------------------- the calls
def next_call(flow: BatchFlow, run: JobRun, sample_call: Any) -> WorkerCall:
    """The call that renders the job's next segment: its decode when its latents are on disk, else
    its sampling (``sample_call(prompt=, image=, segment=)`` builds it as for a job of one clip)."""
    spec = run.job.spec
    done, _ = done_segments(flow.out_dir, spec)
    k = len(done) + 1
    assert k <= spec.segments, "every segment is done: the sampling stage is"
    segment = segment_of(spec, k)
    conditioning = done[-1].last_frame.sha256 if done else spec.image_sha256
    latents = _sampled(flow.out_dir, spec, segment, conditioning)
    if latents is not None:
        return SegmentFrameCall(model=spec.model, job_id=run.job.id, spec=run.spec_once(), segment=segment,
                                latents=latents, reference=done[0].colour if done else None)
    image = None if not done else (flow.out_dir / str(done[-1].last_frame.relpath)).read_bytes()
    return sample_call(prompt=segment_prompts(spec)[k - 1], image=image, segment=segment)


def record_sample(flow: BatchFlow, run: JobRun, reply: SampleReply, seconds: float) -> None:
    """A segment's latents (temp name, rename): its decode comes next. Its step checkpoint goes,
    and the next segment's sampling counts its steps (checkpoints, previews) from 0 again."""
    assert reply.segment is not None and reply.latents is not None
    k = reply.segment.index
    artifacts.write_artifact(flow.out_dir, artifacts.segment_relpath(run.job.id, k, LATENTS_NAME), reply.latents)
    flow.drop_step_checkpoint(run.job.id, None)
    run.checkpoint_step = run.preview_step = 0
    run.segment_sampled_s = seconds
    flow.ledger.log(run.job.id, EventKind.SEGMENT, f"segment {k}/{reply.segment.count} sampled in {seconds:.2f} s "
                                                   f"(seed {reply.segment.seed}, attempt {run.job.attempts})")


def record_frame(flow: BatchFlow, run: JobRun, reply: SegmentFrameReply, seconds: float) -> None:
    """A segment's last frame, then its record (which makes it done), then the ledger: the segments
    document, and the sampling stage done with the last segment."""
    spec, jid, segment = run.job.spec, run.job.id, reply.segment
    k = segment.index
    done, _ = done_segments(flow.out_dir, spec)
    assert len(done) == k - 1, f"segment {k} decoded after {len(done)} segment(s) done"
    frame_rel = artifacts.segment_relpath(jid, k, LAST_FRAME_NAME)
    artifacts.write_artifact(flow.out_dir, frame_rel, reply.last_frame)
    latents = artifacts.segment_relpath(jid, k, LATENTS_NAME)
    rec = SegmentRecord(
        index=k, count=spec.segments, spec_hash=spec.spec_hash, prompt=segment_prompts(spec)[k - 1], seed=segment.seed,
        frames=spec.frames, conditioning=f"segment {k - 1}" if done else "image" if spec.image else "none",
        conditioning_sha256=done[-1].last_frame.sha256 if done else spec.image_sha256,
        latents=_recorded(flow.out_dir, latents), last_frame=_recorded(flow.out_dir, frame_rel), colour=reply.stats,
        matched_to=1 if done else None, attempt=run.job.attempts,
        seconds={"sampling": run.segment_sampled_s, "decode": round(reply.decode_s, 3)})
    artifacts.write_artifact(flow.out_dir, artifacts.segment_relpath(jid, k, SEGMENT_RECORD_NAME),
                             json.dumps(rec.to_json(), indent=1).encode())
    run.segment_sampled_s = None
    document = json.dumps({"count": spec.segments, "done": [r.to_json() for r in [*done, rec]]})
    finished = sampling_fields(flow.out_dir, spec) if k == spec.segments else None
    updates = [] if finished is None else [(Stage.SAMPLING, StageEvent.FINISH, finished)]
    flow.ledger.set_stages(jid, updates, documents={artifacts.SEGMENTS_DOC: document})
    flow.ledger.log(jid, EventKind.SEGMENT, f"segment {k}/{spec.segments} done: last frame {frame_rel}"
                                            + ("" if not done else ", colour-matched to segment 1"))


def record_all_done(flow: BatchFlow, job_id: str, spec: JobSpec) -> None:
    """Every segment found done on disk while the ledger's stage is not (a crash between the last
    segment's record and the ledger's): recorded now, as it would have been."""
    done, _ = done_segments(flow.out_dir, spec)
    document = json.dumps({"count": spec.segments, "done": [r.to_json() for r in done]})
    flow.ledger.set_stages(job_id, [(Stage.SAMPLING, StageEvent.FINISH, sampling_fields(flow.out_dir, spec) or {})],
                           documents={artifacts.SEGMENTS_DOC: document})


def decode_segments(out_dir: Path, spec: JobSpec) -> tuple[SegmentLatents, ...]:
    """Every segment's latents and colour, in order, for the video's decode."""
    done, problem = done_segments(out_dir, spec)
    assert problem is None and len(done) == spec.segments, problem
    return tuple(SegmentLatents(latents=(out_dir / str(r.latents.relpath)).read_bytes(), stats=r.colour) for r in done)


def segment_records(out_dir: Path, spec: JobSpec) -> list[dict[str, Any]]:
    """The records of the job's segments done, for params.json."""
    return [r.to_json() for r in done_segments(out_dir, spec)[0]]


def _recorded(out_dir: Path, relpath: str) -> Recorded:
    path = out_dir / relpath
    return Recorded(relpath, _digest(path), os.stat(path).st_size)
