"""A worker's background encodes: once a job's frames are on the host, its mp4 is encoded on a
thread of this table's while the GPU lane takes the next call; the I/O lane's collect waits for
it (``RenderWorker``'s docstring tells the lanes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pan2render.jobs.spec import JobSpec
from pan2render.long_video import video_fps
from pan2render.runner.protocol import artifacts, outputs
from pan2render.runner.protocol.messages import MAX_ENCODES_IN_FLIGHT, CollectReply
from pan2render.runner.worker import scratch


class Encodes:
    """Job id -> its encode in flight, one per job; the GPU lane hands them over, the I/O lane
    collects them (the lock guards the table between the two)."""

    def __init__(self) -> None:
        # As many encodes at once as the driver keeps in flight: one at a time made the encode the
        # batch's bottleneck once sampling took a few steps (docs/performance.md, the few-step
        # batch): half of an encode is its decode-back check, which does not fill the cores that
        # libx264 does, so two videos overlap well.
        self._pool = ThreadPoolExecutor(max_workers=MAX_ENCODES_IN_FLIGHT, thread_name_prefix="encode")
        self._lock = threading.Lock()
        self._futures: dict[str, Future[CollectReply]] = {}

    def submit(self, job_id: str, encode: Callable[[], CollectReply]) -> None:
        with self._lock:
            stale = self._futures.pop(job_id, None)
            self._futures[job_id] = self._pool.submit(encode)
        if stale is not None:
            stale.cancel()  # a retry's decode replaces an encode nobody collected

    def collect(self, job_id: str) -> CollectReply:
        """Wait for the job's encode and return its checked mp4."""
        with self._lock:
            future = self._futures.get(job_id)
        if future is None:
            raise RuntimeError(f"no encode of job {job_id} on this worker (its decode did not run here)")
        try:
            return future.result()
        finally:
            with self._lock:
                if self._futures.get(job_id) is future:
                    del self._futures[job_id]


def encode_job(js: JobSpec, planes: Any, *, model_id: str) -> CollectReply:
    """Planes uint8 [F, H*3/2, W] -> the job's mp4 bytes (at its video's rate: an interpolated
    video plays more frames a second), decoded back and counted."""
    from pan2render.media.video import Yuv420Video, encode_mp4

    t0 = time.perf_counter()
    with scratch.encode_folder() as tmp:
        path = tmp / artifacts.VIDEO_NAME
        encode_s = encode_mp4(Yuv420Video(planes), path, **{**js.encode_args(), "fps": video_fps(js)},
                              metadata=outputs.video_tags(js, model_id=model_id))
        mp4 = path.read_bytes()
    return CollectReply(mp4=mp4, encode_s=encode_s, check_s=time.perf_counter() - t0 - encode_s)
