"""What a worker keeps of the samplings it runs, for the calls beside them on its I/O lane: a stop
asked per job (``StopSamplingCall``; set before the sampling starts, it stops at the first step
boundary), the newest step checkpoint a sampling handed over (``FetchCheckpointCall``) and its
newest preview's latents (``FetchPreviewCall``). The GPU lane only hands them over (on the host
already); packing a checkpoint and making a preview's picture run here, on the I/O lane that asks
for them. Rank 0 keeps them; every rank holds the same state."""

from __future__ import annotations

import threading
import time
from typing import Any

from pan2render.jobs.spec import JobSpec
from pan2render.models.sampler_state import pack_sampler_state, unpack_sampler_state
from pan2render.runner.protocol.messages import CheckpointReply, PreviewReply
from pan2render.runner.worker.previews import make_preview
from pan2render.step_checkpoint import StepCheckpointError


class SamplingControl:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._stops: dict[str, threading.Event] = {}
        self._checkpoints: dict[str, Any] = {}  # job id -> its newest SamplerState
        self._previews: dict[str, tuple[Any, Any]] = {}  # job id -> its newest (PreviewLatents, RgbMap)
        self._sampling: set[str] = set()

    def begin(self, job_id: str) -> threading.Event:
        """A sampling of the job starts: the event its ``should_stop`` reads."""
        with self._lock:
            self._sampling.add(job_id)
            return self._stops.setdefault(job_id, threading.Event())

    def end(self, job_id: str) -> None:
        with self._lock:
            self._stops.pop(job_id, None)
            self._sampling.discard(job_id)
            self._checkpoints.pop(job_id, None)
            self._previews.pop(job_id, None)
            self._lock.notify_all()

    def stop(self, job_id: str) -> None:
        with self._lock:
            self._stops.setdefault(job_id, threading.Event()).set()

    def keep(self, job_id: str, state: Any) -> None:
        """A sampling's newest state (already on the host), for the next fetch."""
        with self._lock:
            self._checkpoints[job_id] = state
            self._lock.notify_all()

    def keep_preview(self, job_id: str, latents: Any, rgb_map: Any) -> None:
        """A sampling's newest predicted latents (`PreviewLatents`, on the host) and the map that
        makes their picture, for the next preview fetch."""
        with self._lock:
            self._previews[job_id] = (latents, rgb_map)
            self._lock.notify_all()

    def fetch(self, job_id: str, *, after_step: int, wait_s: float, spec_hash: str) -> CheckpointReply | None:
        """The job's newest step checkpoint after ``after_step``, packed here on the I/O lane (the GPU
        lane only handed the state over); None once its sampling ended or when none came in time."""
        state = self._newest(self._checkpoints, job_id, lambda s: s.step > after_step, wait_s)
        if state is None:
            return None
        data = pack_sampler_state(state, spec_hash=spec_hash)
        return CheckpointReply(step=state.step, total_steps=state.key.total_steps, data=data)

    def fetch_preview(self, job_id: str, *, after_step: int, wait_s: float) -> PreviewReply | None:
        """The job's newest preview after ``after_step``: its picture made here (the map, the resize,
        the WebP encode), off the GPU lane; None once its sampling ended or when none came in time."""
        found = self._newest(self._previews, job_id, lambda p: p[0].step > after_step, wait_s)
        if found is None:
            return None
        latents, rgb_map = found
        return PreviewReply(step=latents.step, total_steps=latents.total_steps,
                            image=make_preview(latents, rgb_map))

    def _newest(self, kept: dict[str, Any], job_id: str, new: Any, wait_s: float) -> Any:
        """What ``kept`` holds for the job once ``new`` of it; None once its sampling ended or after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                value = kept.get(job_id)
                if value is not None and new(value):
                    return value
                left = deadline - time.monotonic()
                if job_id not in self._sampling or left <= 0:
                    return None
                self._lock.wait(left)


def resume_state(js: JobSpec, pipe: Any, data: bytes | None, *, cached: bool) -> tuple[Any, str | None]:
    """The state a step checkpoint continues from, or (None, why it is not used): every rank
    decides alike (the check reads the same bytes), so a group samples from 0 together."""
    if data is None:
        return None, None
    if cached:
        return None, "a step cache's kept residuals are not in a step checkpoint: sampled from step 0"
    try:
        return unpack_sampler_state(data, spec_hash=js.spec_hash, model_id=pipe.model_id), None
    except StepCheckpointError as e:
        return None, f"the step checkpoint was refused ({e}): sampled from step 0"
