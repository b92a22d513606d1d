"""The rules of a long video, torch-free: validation, the scheduler, the workers and the views share
them.

A job of ``segments: N`` renders N clips of ``frames`` frames each, one after the other: segment
k >= 2 is conditioned (its first frame, as a job's ``image`` conditions a TI2V job) on segment
k - 1's last frame, colour-matched to segment 1 (``media/colour.py`` says how and why). Each
segment's first frame repeats the frame it was conditioned on, so the joined video drops it:
N * frames - (N - 1) frames. ``interpolate: F`` then puts F - 1 frames between every two of them
and plays F times as many per second: (n - 1) * F + 1 frames at fps * F.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (jobs/ imports this module: the schema's checks use its rules)
    from pan2render.jobs.spec import JobSpec


def segment_seed(seed: int, k: int) -> int:
    """Segment ``k``'s (1-based) noise seed. The first segment's is the job's own, so a job of one
    segment samples exactly what it did before segments existed; a later one's comes from the job's
    seed and ``k`` through sha256, so no two segments of a job (nor segment 2 of seed s and segment
    1 of seed s + 1) draw the same noise, and a resumed job draws what it drew the first time."""
    from pan2render.jobs.spec import MAX_SEED  # (the range every seed of a job keeps to)

    if k == 1:
        return seed
    digest = hashlib.sha256(f"pan2-render segment {k} of seed {seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & MAX_SEED


def segment_prompts(spec: JobSpec) -> tuple[str, ...]:
    """Each segment's prompt, in order: the job's ``prompts`` (a story), else its one prompt for
    every segment."""
    return spec.prompts if spec.prompts is not None else (spec.prompt,) * spec.segments


def job_texts(spec: JobSpec) -> tuple[str, ...]:
    """The texts a job's samplings are conditioned on: every segment's prompt, the negative prompt."""
    return tuple(dict.fromkeys((*segment_prompts(spec), spec.negative_prompt)))


def joined_frames(*, frames: int, segments: int) -> int:
    """Frames of the segments joined, each join frame once."""
    return segments * frames - (segments - 1)


def video_frames(spec: JobSpec) -> int:
    """Frames of the job's mp4: its segments joined, then interpolated."""
    return (joined_frames(frames=spec.frames, segments=spec.segments) - 1) * spec.interpolate + 1


def video_fps(spec: JobSpec) -> float:
    """The mp4's frame rate: the job's, times the interpolation factor (the same seconds of video)."""
    return spec.fps * spec.interpolate


def is_long(spec: JobSpec) -> bool:
    """Whether the job renders more than one clip of its own frames at its own rate."""
    return spec.segments > 1 or spec.interpolate > 1


@dataclass(frozen=True)
class ColourStats:
    """A segment's colour: the mean and standard deviation of each CIE Lab channel (L, a, b; D65
    white) over every pixel of every frame of the segment, as decoded."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def to_json(self) -> dict[str, Any]:
        return {"space": "CIE Lab (D65)", "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ColourStats:
        mean, std = (tuple(float(x) for x in d[k]) for k in ("mean", "std"))
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"colour statistics need 3 channels, got mean {mean} and std {std}")
        return cls(mean=mean, std=std)  # type: ignore[arg-type]
