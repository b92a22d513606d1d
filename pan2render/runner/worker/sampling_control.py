"""What a worker keeps of the samplings it runs, for the calls beside them on its I/O lane: a stop
asked per job (``StopSamplingCall``; set before the sampling starts, it stops at the first step
boundary) and the newest step checkpoint a sampling handed over (``FetchCheckpointCall``). Rank 0
keeps the checkpoints; every rank holds the same state."""

from __future__ import annotations

import threading
import time
from typing import Any

from pan2render.models.sampler_state import pack_sampler_state
from pan2render.runner.protocol.messages import CheckpointReply


class SamplingControl:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._stops: dict[str, threading.Event] = {}
        self._checkpoints: dict[str, Any] = {}  # job id -> its newest SamplerState
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
            self._lock.notify_all()

    def stop(self, job_id: str) -> None:
        with self._lock:
            self._stops.setdefault(job_id, threading.Event()).set()

    def keep(self, job_id: str, state: Any) -> None:
        """A sampling's newest state (already on the host), for the next fetch."""
        with self._lock:
            self._checkpoints[job_id] = state
            self._lock.notify_all()

    def fetch(self, job_id: str, *, after_step: int, wait_s: float, spec_hash: str) -> CheckpointReply | None:
        """The job's newest step checkpoint after ``after_step``, packed here on the I/O lane (the GPU
        lane only handed the state over); None once its sampling ended or when none came in time."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                state = self._checkpoints.get(job_id)
                if state is not None and state.step > after_step:
                    break
                left = deadline - time.monotonic()
                if job_id not in self._sampling or left <= 0:
                    return None
                self._lock.wait(left)
        data = pack_sampler_state(state, spec_hash=spec_hash)
        return CheckpointReply(step=state.step, total_steps=state.key.total_steps, data=data)
