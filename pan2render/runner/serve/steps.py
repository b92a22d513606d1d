"""The stages every batch runs, in order (:data:`PAN2_FLOW`), each declared once as a `Step` of the
flow (``serve/jobflow.py`` says how a flow is run, resumed and repaired)::

    conditioning  EncodePromptsCall -> DIR/_cache/embeddings/<key>.safetensors (shared by prompt)
    sampling      SampleCall        -> DIR/<job>/latents.safetensors
                  (a chained job: per segment, SampleCall + SegmentFrameCall -> DIR/<job>/segments/<k>/,
                  serve/segments.py)
    decode        DecodeCall        -> frames on the worker, encoded there in the background
    interpolate   InterpolateCall   -> (interpolate > 1) those frames interpolated there, then encoded
    collect       CollectCall       -> DIR/<job>/video.mp4 + params.json (ledger stage "encode")

The GPU never waits for the encoder or the scheduler: a decode returns once the frames are on the
worker's host, and the job then only waits for its background encode (the collect, on the
worker's I/O lane) while the group already works on the next job.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

from pan2render.jobs.inputs import LIMITS, InputFileError, read_regular_file
from pan2render.jobs.ledger import EventKind, Stage, StageEvent, StageRecord, StageState, stage_name
from pan2render.jobs.spec import JobSpec
from pan2render.jobs.weights import folder_fingerprint
from pan2render.long_video import is_long, job_texts, video_fps, video_frames
from pan2render.runner.protocol import artifacts, outputs
from pan2render.runner.protocol.failures import JobInputError
from pan2render.runner.protocol.messages import (
    Adapter,
    CollectCall,
    CollectReply,
    DecodeCall,
    DecodeReply,
    EncodePromptsCall,
    EncodePromptsReply,
    InterpolateCall,
    InterpolateReply,
    SampleCall,
    SampleReply,
    Segment,
    SegmentFrameCall,
    SegmentFrameReply,
    WorkerCall,
)
from pan2render.runner.serve import segments
from pan2render.runner.serve.attempt import JobRun
from pan2render.runner.serve.jobflow import BatchFlow, JobFlow, Redo, Status, Step, StepStatus, file_proof

# Prompts encoded in one encode_prompts call (the current job's and upcoming jobs'); each
# embedding is 512 x 4096 float32 = 8 MB of reply.
CONDITIONING_AHEAD_TEXTS = 16
# Queued jobs the look-ahead looks at, at most: past those encoded already or by calls in flight,
# a few calls' worth.
CONDITIONING_AHEAD_JOBS = 256


class ConditioningStep(Step):
    """Prompt and negative prompt -> umT5 embeddings, in the folder's cache (content-addressed by
    prompt and text encoder). Upcoming jobs' prompts ride along with the current job's."""

    stage = Stage.CONDITIONING
    calls = (EncodePromptsCall,)
    per_job_artifact = False

    def status(self, flow: BatchFlow, run: JobRun, rec: StageRecord) -> Status:
        problems = embedding_problems(flow, run.job.spec)
        if not problems:
            if rec.state is not StageState.DONE:  # cached by another job, or before a crash
                record_conditioning(flow, run.job.id, run.job.spec, seconds=0.0)
            return StepStatus.DONE
        problem = next(iter(problems.values()))
        if rec.state is StageState.DONE:  # recorded, but its embedding no longer checks out
            return Redo(problem)
        if run.encode_texts:  # written by this attempt's own encode, and already rejected
            flow.count_redo(run.job.id, problem)
        return StepStatus.TO_DO

    def call(self, flow: BatchFlow, run: JobRun) -> WorkerCall:
        missing = list(embedding_problems(flow, run.job.spec))
        # prompt == negative prompt: encode once; upcoming jobs' prompts ride along.
        texts = list(dict.fromkeys(missing + upcoming_texts(flow, run.job.spec.model)))
        run.encode_texts = texts[:max(CONDITIONING_AHEAD_TEXTS, len(missing))]
        flow.encoding(run.encode_texts, asked=True)
        return EncodePromptsCall(model=run.job.spec.model, texts=tuple(run.encode_texts))

    def record(self, flow: BatchFlow, run: JobRun, value: EncodePromptsReply, seconds: float) -> None:
        encoder = flow.text_encoder_id(run.job.spec.model)
        for text, data in zip(run.encode_texts, value.embeddings, strict=True):
            key = artifacts.embedding_key(prompt=text, text_encoder_id=encoder)
            artifacts.write_artifact(flow.out_dir, artifacts.embedding_relpath(key), data)
        flow.encoding(run.encode_texts, asked=False)
        record_conditioning(flow, run.job.id, run.job.spec, seconds=seconds)
        flow.ledger.log(run.job.id, EventKind.CONDITIONING,
                        f"{len(run.encode_texts)} prompt(s) encoded in one call, {seconds:.2f} s")


class SamplingStep(Step):
    """The DiT + sampler -> ``DIR/<job>/latents.safetensors`` (the spec in its metadata); a chained
    job's segments one after another, each sampled and decoded (serve/segments.py)."""

    stage = Stage.SAMPLING
    calls = (SampleCall, SegmentFrameCall)

    def status(self, flow: BatchFlow, run: JobRun, rec: StageRecord) -> Status:
        spec = run.job.spec
        if spec.segments > 1:
            problem = segments.all_done_problem(flow.out_dir, spec)
            if problem is None and rec.state is not StageState.DONE:  # done before a crash, not recorded
                segments.record_all_done(flow, run.job.id, spec)
            return StepStatus.DONE if problem is None else Redo(problem) if rec.state is StageState.DONE \
                else StepStatus.TO_DO
        if rec.state is not StageState.DONE:
            return StepStatus.TO_DO
        problem = artifacts.check_latents(flow.out_dir, artifacts.recorded(rec), spec=spec, proven=flow.proven)
        return StepStatus.DONE if problem is None else Redo(problem)

    def call(self, flow: BatchFlow, run: JobRun) -> WorkerCall:
        spec = run.job.spec
        if spec.weights is not None and folder_fingerprint(Path(spec.model))[0] != spec.weights:
            # The id promises these weights; rendering others under it would mislabel the video.
            raise JobInputError(f"the weights in {spec.model} changed since the batch was validated "
                                f"(fingerprint differs); run the batch again: its jobs get new ids")
        if spec.segments > 1:
            return segments.next_call(flow, run, lambda **segment: self._sample_call(flow, run, **segment))
        return self._sample_call(flow, run, prompt=spec.prompt, image=None, segment=None)

    def _sample_call(self, flow: BatchFlow, run: JobRun, *, prompt: str, image: bytes | None,
                     segment: Segment | None) -> SampleCall:
        """``image``: the frame a later segment is conditioned on (None: the job's own image, if any)."""
        spec = run.job.spec
        embeds, negative = (read_embedding(flow, spec.model, t) for t in (prompt, spec.negative_prompt))
        return SampleCall(model=spec.model, job_id=run.job.id, spec=run.spec_once(), prompt_embeds=embeds,
                          negative_embeds=negative, image=image if image is not None else _image_bytes(spec),
                          adapters=_adapters(spec, held=run.group.adapters), resume=flow.step_checkpoint(run),
                          progress_key=run.progress_key, segment=segment)

    def record(self, flow: BatchFlow, run: JobRun, value: SampleReply | SegmentFrameReply, seconds: float) -> None:
        if isinstance(value, SegmentFrameReply):
            return segments.record_frame(flow, run, value, seconds)
        run.group.adapters = frozenset(value.adapters_held)
        if value.resume_refused:
            flow.drop_step_checkpoint(run.job.id, value.resume_refused)
        if value.latents is None:  # stopped at a step boundary: its state is what goes on from there
            assert value.stopped_at is not None and value.checkpoint is not None, "a stop brings its state"
            flow.write_step_checkpoint(run, value.checkpoint, step=value.stopped_at)
            run.stopped_after(value.stopped_at)
            flow.ledger.set_stage(run.job.id, Stage.SAMPLING, StageEvent.STOP)
            return None
        if value.segment is not None:
            return segments.record_sample(flow, run, value, seconds)
        rel = artifacts.latents_relpath(run.job.id)
        artifacts.write_artifact(flow.out_dir, rel, value.latents)
        flow.ledger.set_stage(run.job.id, Stage.SAMPLING, StageEvent.FINISH, artifact=rel,
                              sha256=artifacts.sha256_bytes(value.latents), size=len(value.latents),
                              seconds=seconds)
        flow.drop_step_checkpoint(run.job.id, None)  # done with: the latents are the sampling's result
        return None

    def proof(self, out_dir: Path, spec: JobSpec) -> dict[str, Any] | None:
        if spec.segments > 1:
            return segments.sampling_fields(out_dir, spec)
        found = file_proof(out_dir, artifacts.latents_relpath(spec.job_id))
        # No ledger recorded the file's sha256 here: the digest of the data inside it is the proof.
        if found is None or artifacts.check_latents(out_dir, found[0], spec=spec, require_digest=True) is not None:
            return None
        return found[1]


def _image_bytes(spec: JobSpec) -> bytes | None:
    """The first-frame image's bytes (workers need no shared disk), checked against the digest
    the job id was made with. Read as validation reads it (``jobs.inputs``): the path may name a
    FIFO or a device by now, or a network filesystem that no longer answers, and the scheduler's
    loop must not wait on it."""
    if spec.image is None:
        return None
    try:
        image = read_regular_file(spec.image, limit=LIMITS.image_bytes)
    except (InputFileError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        # The input is gone, unreadable or no longer a file we read; retrying reads the same path.
        raise JobInputError(f"image {spec.image} {_unreadable(e)}; restore it or run the batch again with "
                            f"another image") from e
    if spec.image_sha256 and artifacts.sha256_bytes(image) != spec.image_sha256:
        # The spec hash covers the image's content; rendering a changed file under the old id
        # would mislabel the video.
        raise JobInputError(f"image {spec.image} changed since the batch was validated "
                            f"(sha256 differs); run the batch again to render the new image")
    return image


def _adapters(spec: JobSpec, *, held: frozenset[str]) -> tuple[Adapter, ...]:
    """The job's LoRAs for its workers: each file read (only where the group does not hold it) and
    checked against the digest its job id was made with."""
    out = []
    for ref, (sha, scale) in zip(spec.loras, spec.lora_digests, strict=True):
        data = None
        if sha not in held:
            try:
                data = read_regular_file(ref.path, limit=LIMITS.lora_bytes)
            except (InputFileError, OSError) as e:
                raise JobInputError(f"LoRA {ref.path} {_unreadable(e)}; restore it or run the batch again "
                                    f"without it") from e
            if artifacts.sha256_bytes(data) != sha:
                raise JobInputError(f"LoRA {ref.path} changed since the batch was validated (sha256 differs); run "
                                    f"the batch again: its jobs get new ids")
        out.append(Adapter(sha256=str(sha), scale=scale, name=Path(ref.path).name, data=data))
    return tuple(out)


def _unreadable(e: Exception) -> str:
    """Why a named file was not read: what it is instead, or the system's error."""
    if isinstance(e, InputFileError):
        return str(e)
    return f"cannot be read ({type(e).__name__}: {getattr(e, 'strerror', None) or e})"


class DecodeStep(Step):
    """Latents -> frames on the worker's host, handed to its encode thread. Not durable: the
    frames never leave the worker, so the stage is recorded done together with the video."""

    stage = Stage.DECODE
    calls = (DecodeCall,)
    per_job_artifact = False

    def status(self, flow: BatchFlow, run: JobRun, rec: StageRecord) -> Status:
        return StepStatus.DONE if run.decode_s is not None else StepStatus.TO_DO

    def call(self, flow: BatchFlow, run: JobRun) -> WorkerCall:
        spec = run.job.spec
        if spec.segments > 1:
            return DecodeCall(model=spec.model, job_id=run.job.id, spec=run.spec_once(), latents=b"",
                              segments=segments.decode_segments(flow.out_dir, spec))
        rec = flow.ledger.stages(run.job.id)[Stage.SAMPLING]
        latents = (flow.out_dir / str(rec.artifact)).read_bytes()  # checked by SamplingStep.status
        return DecodeCall(model=spec.model, job_id=run.job.id, spec=run.spec_once(), latents=latents)

    def record(self, flow: BatchFlow, run: JobRun, value: DecodeReply, seconds: float) -> None:
        run.decode_s = value.decode_s
        if run.job.spec.interpolate == 1:  # (else the interpolation hands the frames to the encode)
            flow.ledger.set_stage(run.job.id, Stage.ENCODE, StageEvent.START)


class InterpolateStep(Step):
    """The decoded frames interpolated on the worker's GPU lane (RIFE's IFNet, ``interpolate`` > 1),
    then handed to its encode thread. Like decode's, its result never leaves the worker (frames are
    hundreds of MB: DESIGN keeps them out of the object store), so it reaches the disk inside the
    video and the stage is recorded done with it: a job whose video is written never interpolates
    again; one whose worker was lost before that decodes and interpolates again (seconds; its
    samplings are kept). A job that does not interpolate is as far along here as its decode."""

    stage = Stage.INTERPOLATE
    calls = (InterpolateCall,)
    per_job_artifact = False

    def status(self, flow: BatchFlow, run: JobRun, rec: StageRecord) -> Status:
        done = run.decode_s if run.job.spec.interpolate == 1 else run.interpolate_s
        return StepStatus.DONE if done is not None else StepStatus.TO_DO

    def call(self, flow: BatchFlow, run: JobRun) -> WorkerCall:
        spec = run.job.spec
        assert spec.interpolation_weights is not None and spec.interpolation_sha256 is not None, "checked at validation"
        try:
            weights = read_regular_file(spec.interpolation_weights, limit=LIMITS.interpolation_weights_bytes)
        except (InputFileError, OSError) as e:
            raise JobInputError(f"interpolation weights {spec.interpolation_weights} {_unreadable(e)}; restore them "
                                f"or run the batch again with others") from e
        if artifacts.sha256_bytes(weights) != spec.interpolation_sha256:
            raise JobInputError(f"interpolation weights {spec.interpolation_weights} changed since the batch was "
                                f"validated (sha256 differs); run the batch again: its jobs get new ids")
        return InterpolateCall(model=spec.model, job_id=run.job.id, spec=run.spec_once(), weights=weights,
                               weights_sha256=spec.interpolation_sha256)

    def record(self, flow: BatchFlow, run: JobRun, value: InterpolateReply, seconds: float) -> None:
        run.interpolate_s = value.interpolate_s
        flow.ledger.set_stage(run.job.id, Stage.ENCODE, StageEvent.START)


class CollectStep(Step):
    """The worker's background encode -> ``DIR/<job>/video.mp4``, with ``params.json`` beside it."""

    stage = Stage.ENCODE
    calls = (CollectCall,)

    def call(self, flow: BatchFlow, run: JobRun) -> WorkerCall:
        return CollectCall(job_id=run.job.id)

    def record(self, flow: BatchFlow, run: JobRun, value: CollectReply, seconds: float) -> None:
        jid, spec = run.job.id, run.job.spec
        # params.json first: a write that fails between the two then leaves no video that the
        # ledger does not record (a lone params.json is rewritten with the next attempt).
        times = {stage_name(s): r.seconds for s, r in flow.ledger.stages(jid).items()}
        times.update({Stage.DECODE.value: run.decode_s, Stage.INTERPOLATE.value: run.interpolate_s,
                      Stage.ENCODE.value: value.encode_s + value.check_s})
        load = run.group.loads.get(spec.model)
        params = outputs.write_params(flow.out_dir, job=run.job, seconds=times,
                                      load=None if load is None else dataclasses.asdict(load),
                                      long_video=long_video_params(flow.out_dir, spec))
        rel = artifacts.video_relpath(jid)
        artifacts.write_artifact(flow.out_dir, rel, value.mp4)
        rec = artifacts.Recorded(rel, artifacts.sha256_bytes(value.mp4), len(value.mp4))
        # The worker decoded these very bytes back and counted the spec's frames at the spec's
        # size before sending them (encode_mp4, after decode checked the frames' shape), and they
        # were written and fsynced from memory: the file needs only to be there at their size.
        # Decoding it again here would stall the loop, and so the GPU's next call, for seconds per
        # 720p video; reading it back to hash it, MBs a job, proves nothing the page cache would
        # not say. Resume still decodes it.
        problem = artifacts.check_present(flow.out_dir, rec)
        if problem:
            raise RuntimeError(f"the written video does not check out: {problem}")
        flow.ledger.set_stages(jid, [
            (Stage.DECODE, StageEvent.FINISH, {"seconds": run.decode_s}),
            (Stage.INTERPOLATE, StageEvent.FINISH, {"seconds": run.interpolate_s}),
            (Stage.ENCODE, StageEvent.FINISH, {"artifact": rel, "sha256": rec.sha256, "size": rec.size,
                                             "seconds": value.encode_s + value.check_s}),
        ], documents={outputs.PARAMS_NAME: params})
        flow.ledger.log(jid, EventKind.ENCODE, f"libx264 {value.encode_s:.2f} s, decode-back check "
                                               f"{value.check_s:.2f} s, {len(value.mp4)} bytes")

    def proof(self, out_dir: Path, spec: JobSpec) -> dict[str, Any] | None:
        found = file_proof(out_dir, artifacts.video_relpath(spec.job_id))
        if found is None or artifacts.check_video(out_dir, found[0], frames=video_frames(spec), width=spec.width,
                                                  height=spec.height) is not None:
            return None
        return found[1]


PAN2_FLOW = JobFlow(steps=(ConditioningStep(), SamplingStep(), DecodeStep(), InterpolateStep(), CollectStep()))


# ---------------------------------------------------------------------- conditioning, shared by the steps
def long_video_params(out_dir: Path, spec: JobSpec) -> dict[str, Any] | None:
    """What params.json says of a long video: its frames and rate, and each segment's record."""
    if not is_long(spec):
        return None
    return {"frames": video_frames(spec), "fps": video_fps(spec), "segments": segments.segment_records(out_dir, spec),
            "interpolate": spec.interpolate}


def embedding_problems(flow: BatchFlow, spec: JobSpec) -> dict[str, str]:
    """Text -> why its cached embedding cannot be used, for the job's prompts and negative prompt."""
    out = {}
    for text in job_texts(spec):
        key = artifacts.embedding_key(prompt=text, text_encoder_id=flow.text_encoder_id(spec.model))
        if problem := artifacts.check_embedding(flow.out_dir, artifacts.embedding_relpath(key), key=key,
                                                 proven=flow.proven):
            out[text] = problem
    return out

def read_embedding(flow: BatchFlow, model: str, text: str) -> bytes:
    key = artifacts.embedding_key(prompt=text, text_encoder_id=flow.text_encoder_id(model))
    return (flow.out_dir / artifacts.embedding_relpath(key)).read_bytes()

def record_conditioning(flow: BatchFlow, job_id: str, spec: JobSpec, *, seconds: float) -> None:
    key = artifacts.embedding_key(prompt=spec.prompt, text_encoder_id=flow.text_encoder_id(spec.model))
    rel = artifacts.embedding_relpath(key)
    data = (flow.out_dir / rel).read_bytes()
    flow.ledger.set_stage(job_id, Stage.CONDITIONING, StageEvent.FINISH, artifact=rel,
                          sha256=artifacts.sha256_bytes(data), size=len(data), seconds=seconds)

def upcoming_texts(flow: BatchFlow, model: str) -> list[str]:
    """Prompts of pending jobs of ``model`` with no file in the embedding cache, in queue order,
    leaving out those a call in flight encodes: on many groups, jobs start faster than a call
    answers, and each one's look-ahead encoded the same next prompts again (at 64 GPUs, 0.8 calls
    a job where one in 8 would do).

    Only whether the file exists: reading and checking every cached embedding of a long queue
    on each look-ahead would cost more than it saves. A damaged one is found, and encoded
    again, when its own job reaches conditioning."""
    texts: list[str] = []
    encoder = flow.text_encoder_id(model)
    for job in itertools.islice(flow.upcoming(), CONDITIONING_AHEAD_JOBS):
        if job.model != model:
            continue
        for text in job.prompts:
            key = artifacts.embedding_key(prompt=text, text_encoder_id=encoder)
            if (text not in texts and not flow.being_encoded(text)
                    and not (flow.out_dir / artifacts.embedding_relpath(key)).is_file()):
                texts.append(text)
        if len(texts) >= CONDITIONING_AHEAD_TEXTS:
            break
    return texts
