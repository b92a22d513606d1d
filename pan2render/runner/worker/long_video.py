"""A long video on the worker (``pan2render.long_video``): a chained segment's last frame and
colour; a job's video decoded whole: its segments decoded, colour-matched to the first and joined
without each join's repeated frame; and those frames interpolated (RIFE's IFNet).

Every rank decodes (a group's decode is split over its ranks, frames on rank 0); rank 0 alone
matches, joins and answers, the other ranks return None. Frames stay on the device until they are
converted for the encode: uint8 ``[F, H, W, 3]``.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from pan2render.jobs.spec import JobSpec
from pan2render.long_video import ColourStats
from pan2render.media.colour import colour_stats, match_colour
from pan2render.media.video import png_bytes
from pan2render.runner.protocol.failures import JobInputError
from pan2render.runner.protocol.messages import DecodeCall, InterpolateCall, SegmentFrameCall, SegmentFrameReply
from pan2render.runner.worker import scratch
from pan2render.runner.worker.packing import unpack_latents
from pan2render.runner.worker.threads import CPU_DECODE_THREADS, intra_op_threads


def segment_frame(pipe: Any, call: SegmentFrameCall, js: JobSpec, *, rank: int, device: str,
                  kept: SegmentFrames) -> SegmentFrameReply | None:
    """The segment's frames decoded; their colour statistics; the last frame matched to the first
    segment's colour (the first segment's as it is), as a PNG: the next segment's first frame. The
    frames as the video joins them are kept for its decode (`SegmentFrames`)."""
    t0 = time.perf_counter()
    frames = _decoded(pipe, call.latents, js, rank=rank, device=device)
    digest = hashlib.sha256(call.latents).hexdigest()
    if frames is None:
        kept.keep(call.job_id, call.segment.index, digest, None)
        return None
    stats = colour_stats(frames)
    last = frames[-1:] if call.reference is None else match_colour(frames[-1:], stats, call.reference)
    kept.keep(call.job_id, call.segment.index, digest, _joined_part(frames, stats, call.reference))
    return SegmentFrameReply(segment=call.segment, last_frame=png_bytes(last[0].cpu().numpy()), stats=stats,
                             decode_s=time.perf_counter() - t0)


def video_frames_on_device(pipe: Any, call: DecodeCall, js: JobSpec, *, rank: int, device: str,
                           kept: SegmentFrames) -> torch.Tensor | None:
    """The job's frames, uint8 ``[F, H, W, 3]`` on the device (rank 0; None on the others): its one
    clip, or its segments each matched to the first one's colour with the statistics their own
    decode measured, and joined, every segment after the first without its first frame. A segment
    this worker decoded for its last frame is not decoded again."""
    if not call.segments:
        return _decoded(pipe, call.latents, js, rank=rank, device=device)
    reference = call.segments[0].stats
    parts: list[torch.Tensor] = []
    for k, segment in enumerate(call.segments, 1):
        found, part = kept.take(call.job_id, k, hashlib.sha256(segment.latents).hexdigest())
        if not found:
            frames = _decoded(pipe, segment.latents, js, rank=rank, device=device)
            part = None if frames is None else _joined_part(frames, segment.stats, None if k == 1 else reference)
            del frames
        if part is not None:
            parts.append(part)
    kept.forget()
    return torch.cat(parts) if parts else None


def _joined_part(frames: torch.Tensor, stats: ColourStats, reference: ColourStats | None) -> torch.Tensor:
    """A segment's frames as its video shows them: the first segment's as decoded; a later one's
    matched to the first's colour, without its first frame (the previous segment's last)."""
    return frames if reference is None else match_colour(frames, stats, reference)[1:]


class SegmentFrames:
    """A chained job's segments as its video joins them, kept on rank 0's device from each
    segment's decode (for the next segment's first frame) to the video's decode, so that a video
    whose segments were all decoded here decodes none of them twice (a 720p segment's decode is
    ~3 s; its frames 318 MB of device memory, held until the video's decode). A segment is known
    by its latents' digest: one sampled again by a later attempt is not the one kept, and a video
    decoded elsewhere (after a crash) decodes its segments anew, to the same frames. Every rank of
    a group keeps the keys (rank 0 alone the frames): a group's decode is split over its ranks,
    so they all skip a segment's decode or none does. One job at a time."""

    def __init__(self) -> None:
        self._job: str | None = None
        self._parts: dict[int, tuple[str, torch.Tensor | None]] = {}

    def keep(self, job_id: str, index: int, digest: str, part: torch.Tensor | None) -> None:
        if job_id != self._job:
            self.forget()
            self._job = job_id
        self._parts[index] = (digest, part)

    def take(self, job_id: str, index: int, digest: str) -> tuple[bool, torch.Tensor | None]:
        """(found, frames: None on ranks other than 0) of segment ``index`` with these latents."""
        held = self._parts.pop(index, None) if job_id == self._job else None
        if held is None or held[0] != digest:
            return False, None
        return True, held[1]

    def forget_unless(self, job_id: str) -> None:
        """A sampling of ``job_id`` starts: another job's kept segments are an ended attempt's."""
        if job_id != self._job:
            self.forget()

    def forget(self) -> None:
        self._job, self._parts = None, {}


def _decoded(pipe: Any, latents: bytes, js: JobSpec, *, rank: int, device: str) -> torch.Tensor | None:
    # On a CPU on one thread count whatever the worker's share, as a clip's decode (threads.py: why).
    with intra_op_threads(CPU_DECODE_THREADS if device == "cpu" else None):
        frames = pipe.decode(unpack_latents(latents), on_device=True)  # uint8 [F, H, W, 3]
    if rank != 0:
        return None
    want = (js.frames, js.height, js.width, 3)
    if tuple(frames.shape) != want:
        raise ValueError(f"decode returned frames of shape {tuple(frames.shape)}, expected {want}")
    return frames


class Interpolation:
    """What a worker holds for a job's interpolation: its decoded frames, kept on rank 0's device
    from its decode to its InterpolateCall (the next call of its GPU lane: the scheduler queues no
    other job's call behind a decode that an interpolation follows), one job at a time; and the
    IFNet last loaded, by its weights' digest, so a batch loads its weights once per worker."""

    def __init__(self) -> None:
        self._frames: tuple[str, torch.Tensor] | None = None
        self._model: tuple[str, Any] | None = None

    def keep(self, job_id: str, frames: torch.Tensor) -> None:
        self._frames = (job_id, frames)  # (another job's, never interpolated: its attempt ended)

    def forget(self) -> None:
        """A sampling starts: no interpolation is pending (nothing is queued between a decode and
        its interpolation), so frames still kept are an ended attempt's; their memory goes back."""
        self._frames = None

    def run(self, call: InterpolateCall, js: JobSpec) -> torch.Tensor:
        """The kept frames interpolated: uint8 ``[(n - 1) * factor + 1, H, W, 3]`` on their device."""
        from pan2render.models.ifnet import interpolate_uint8

        if self._frames is None or self._frames[0] != call.job_id:
            raise RuntimeError(f"no decoded frames of job {call.job_id} on this worker (its decode did not run here)")
        frames = self._frames[1]
        self._frames = None
        return interpolate_uint8(self._load(call, frames.device), frames, js.interpolate)

    def _load(self, call: InterpolateCall, device: torch.device) -> Any:
        from pan2render.models.ifnet import IFNetWeightsError, load_ifnet

        if self._model is None or self._model[0] != call.weights_sha256:
            self._model = None  # (its memory back before the next is loaded)
            with scratch.encode_folder() as tmp:
                path = tmp / "ifnet-weights"
                path.write_bytes(call.weights)
                try:
                    model = load_ifnet(path, device=device)
                except IFNetWeightsError as e:  # the same file on any worker: the job's input
                    raise JobInputError(str(e)) from e
            self._model = (call.weights_sha256, model)
        return self._model[1]
