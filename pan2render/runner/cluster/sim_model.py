"""What the simulated cluster (``simulated.py``) is made of, apart from its executor: how long each
call takes (:class:`CostModel`), which faults it injects (:class:`FaultPlan`), the clock its
calls run on (virtual, or real time with the idle waits skipped, or real time), and the small
valid artifacts its workers answer with (embeddings, latents, an mp4) so that the stage flow
records and checks them as it does a real worker's.

No torch and no Ray: it measures the scheduler, the ledgers, the farm's queue, its API and its
snapshot, which are the real ones, on as many virtual GPUs as asked.
"""

from __future__ import annotations

import functools
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from safetensors.numpy import save

from pan2render.jobs.spec import JobSpec
from pan2render.runner.protocol.artifacts import array_digest, embedding_key, latent_grid
from pan2render.runner.protocol.messages import (
    DecodeCall,
    EncodePromptsCall,
    LoadCall,
    SampleCall,
    WorkerCall,
)

TEXT_ENCODER_ID = "sim-text-v1"  # the simulated workers' text encoder (embedding cache keys)


# ---------------------------------------------------------------------- how long a call takes
@dataclass(frozen=True)
class CostModel:
    """Seconds of each call on one group, from the stage times measured on one H200
    (docs/performance.md, "Batch throughput" and "The farm"): a 3-step DMD job 5.6 s of GPU work
    (sampling 2.5, decode 3.0; conditioning 0.3 for a call that encodes prompts, most jobs' come
    ahead with an earlier job's), a 20-step guided job about 35 s (31.2 + 3.0), the encode 1.5 s off
    the GPU lane, a load 14.7 s. Each duration is drawn around its mean (``spread``: the standard
    deviation, as a fraction of it)."""

    load_s: float = 14.7
    conditioning_s: float = 0.3  # one EncodePromptsCall, whatever its texts
    step_s: float = 2.5 / 3  # an unguided step (guidance <= 1: DMD's)
    guided_step_s: float = 31.2 / 20  # a guided step: two forwards
    decode_s: float = 3.0
    encode_s: float = 1.5  # on the worker's encode thread, after the decode
    spread: float = 0.05

    def __post_init__(self) -> None:
        if min(self.load_s, self.conditioning_s, self.step_s, self.guided_step_s, self.decode_s, self.encode_s) < 0:
            raise ValueError(f"{self}: every duration must be >= 0")
        if not 0 <= self.spread < 0.5:
            raise ValueError(f"spread={self.spread} must be in [0, 0.5)")

    def mean_s(self, message: WorkerCall, spec: JobSpec | None) -> float:
        """The mean seconds of ``message`` (``spec``: its job's, for a sampling); 0 for the calls
        that only wait (a collect waits for its encode, a stop and a checkpoint fetch answer)."""
        if isinstance(message, LoadCall):
            return self.load_s
        if isinstance(message, EncodePromptsCall):
            return self.conditioning_s
        if isinstance(message, SampleCall):
            assert spec is not None, "a sampling carries its spec, or the group keeps it"
            steps = spec.steps if spec.steps is not None else len(spec.timesteps or ())
            return steps * (self.guided_step_s if spec.guidance > 1.0 else self.step_s)
        if isinstance(message, DecodeCall):
            return self.decode_s
        return 0.0

    def draw(self, mean_s: float, rng: random.Random) -> float:
        return mean_s * max(0.5, rng.gauss(1.0, self.spread)) if self.spread else mean_s


# ---------------------------------------------------------------------- what goes wrong
@dataclass(frozen=True)
class NodeLoss:
    """Node ``node`` leaves the cluster at ``at_s`` (its groups die, cluster-lost), and comes back
    ``back_after_s`` later (None: never), with every GPU free."""

    at_s: float
    node: int
    back_after_s: float | None = None


@dataclass(frozen=True)
class FaultPlan:
    """Faults injected into a job's calls (sampling, decode, collect), each call drawn once:
    ``call_failure_rate`` answers a failure of the unknown class (the worker raised; the group stays),
    ``worker_death_rate`` kills the group's worker during the call (every call in flight on the
    group fails with it)."""

    call_failure_rate: float = 0.0
    worker_death_rate: float = 0.0
    node_losses: tuple[NodeLoss, ...] = ()

    def __post_init__(self) -> None:
        if not (0 <= self.call_failure_rate and 0 <= self.worker_death_rate
                and self.call_failure_rate + self.worker_death_rate <= 1):
            raise ValueError(f"{self}: rates in [0, 1], their sum at most 1")


# ---------------------------------------------------------------------- clocks
class Clock(Protocol):
    def now(self) -> float: ...  # seconds since the cluster started
    # Called when nothing the scheduler waits for is done: let time pass until ``t`` (at most
    # ``timeout_s`` of real time, where time is real).
    def wait_until(self, t: float, *, timeout_s: float) -> None: ...


class VirtualClock:
    """Time passes only while the scheduler waits, straight to the next call's end: a run is
    deterministic, and the scheduler's own work takes no time (the GPUs' busy fraction then says
    what its decisions cost, never how fast it makes them)."""

    def __init__(self) -> None:
        self._t = 0.0

    def now(self) -> float:
        return self._t

    def wait_until(self, t: float, *, timeout_s: float) -> None:
        self._t = max(self._t, t)


class ChargedClock:
    """Real time, with the waits skipped: the scheduler's own work (its loop, its ledgers' fsyncs,
    the API on its threads) takes the time it takes, while the GPUs' calls run on, and when it waits
    for a call time jumps to that call's end. The busy fraction then counts the scheduler's speed
    too, and a run takes the scheduler's time, not the GPUs'."""

    def __init__(self) -> None:
        self._offset = -time.monotonic()

    def now(self) -> float:
        return time.monotonic() + self._offset

    def wait_until(self, t: float, *, timeout_s: float) -> None:
        self._offset += max(0.0, t - self.now())


class WallClock:
    """Real time, ``speed`` times faster than the cost model's (2: a 5.6 s job in 2.8 s)."""

    def __init__(self, *, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError(f"speed={speed} must be > 0")
        self.speed = speed
        self._t0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._t0) * self.speed

    def wait_until(self, t: float, *, timeout_s: float) -> None:
        time.sleep(max(0.0, min(timeout_s, (t - self.now()) / self.speed)))


# ---------------------------------------------------------------------- what the workers answer
_EMBEDDING = np.zeros((1, 4), dtype=np.float32)  # a stand-in embedding: the checks read key and digest


def embedding_bytes(text: str) -> bytes:
    """An embedding file of ``text`` that ``artifacts.check_embedding`` accepts."""
    key = embedding_key(prompt=text, text_encoder_id=TEXT_ENCODER_ID)
    return save({"prompt_embeds": _EMBEDDING}, metadata={"key": key, "text_encoder_id": TEXT_ENCODER_ID,
                                                          "sha256": _digest(_EMBEDDING.shape)})


def latents_bytes(spec: JobSpec, *, model_id: str) -> bytes:
    """Latents of one channel on the job's latent grid that ``artifacts.check_latents`` accepts."""
    lat = np.zeros((1, *latent_grid(spec)), dtype=np.float32)  # [1, T, h, w]
    return save({"latents": lat}, metadata={"spec_hash": spec.spec_hash, "seed": str(spec.seed),
                                             "steps": str(spec.steps), "model_id": model_id,
                                             "sha256": _digest(lat.shape)})


@functools.cache
def _digest(shape: tuple[int, ...]) -> str:
    return array_digest(np.zeros(shape, dtype=np.float32))


@functools.cache
def mp4_bytes(frames: int, width: int, height: int, fps: float) -> bytes:
    """A real mp4 of grey frames at this size (PyAV, once per size): the report makes its posters
    from it as from a rendered video. Given as yuv420p planes (Y 126, U and V 128: RGB 128 in BT.709
    limited range), so no RGB conversion, which would import torch into the scheduler's process."""
    from pan2render.media.video import Yuv420Video, encode_mp4  # PyAV: only once a video is asked for

    planes = np.concatenate([np.full((frames, height, width), 126, dtype=np.uint8),
                             np.full((frames, height // 2, width), 128, dtype=np.uint8)], axis=1)
    with tempfile.TemporaryDirectory(prefix="pan2-sim-") as folder:
        path = Path(folder) / "video.mp4"
        encode_mp4(Yuv420Video(planes), path, fps=fps, crf=30)
        return path.read_bytes()
