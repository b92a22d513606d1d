"""The worker's test hooks (``WorkerConfig.faults``, JSON, e.g. from ``PAN2_RENDER_FAULTS``): a
crash, a failure of a given class, a slow stage or a broken GPU, where a test asks for one, so
every failure path can be met on demand. Unused in production (the dict is empty)."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pan2render.jobs.spec import JobSpec
from pan2render.runner.protocol.failures import DeviceError, JobInputError

# What a "fail" fault may raise, by name (faults travel as JSON): one type per failure class.
FAULT_TYPES: dict[str, type[Exception]] = {
    "RuntimeError": RuntimeError,  # unknown
    "ValueError": ValueError,  # unknown too: a library's ValueError is not a bad input
    "JobInputError": JobInputError,  # input
    "DeviceError": DeviceError,  # worker death (the device)
    "OutOfMemoryError": torch.cuda.OutOfMemoryError,  # out of memory, as torch raises it
}
if hasattr(torch, "AcceleratorError"):  # a device fault by torch's own type (recent torch)
    FAULT_TYPES["AcceleratorError"] = torch.AcceleratorError


class FaultHooks:
    """faults = {"crash": {"job": NAME, "step": K, "marker": PATH, "after": GLOB, "segment": S}}: exit
                   the process at sampling step K of job NAME, once (the marker file records that it
                   happened); with "after", only once a file matches GLOB (the driver has written a step
                   checkpoint: waited for, up to 120 s, so a loaded machine cannot reorder them); with
                   "segment", only in the sampling of that segment of a chained job (default: any);
                 {"fail": {"job": NAME, "stage": "sampling"|"decode"|"interpolate"|"encode", "raise": TYPE}}: raise
                   there, always; TYPE (default RuntimeError) names one of FAULT_TYPES, so a test can
                   meet each failure class;
                 {"slow": {"job": NAME, "stage": ..., "seconds": S}}: sleep S seconds there first;
                 {"slow_steps": {"job": NAME, "seconds": S}}: sleep S seconds at every sampling step
                   of job NAME (a sampling long enough to meet its previews and checkpoints);
                 {"broken_gpu": {"gpu": N}}: every sampling on GPU N (the cluster's number) raises a
                   device fault;
                 {"hang": {"job": NAME, "step": K, "marker": PATH}}: at step K of job NAME, once,
                   the worker stops answering (sleeps) without dying: what the watchdog is for."""

    def __init__(self, faults: dict[str, Any], *, rank: int, gpu_ids: tuple[int, ...], die: Callable[[], None]):
        self.faults = faults
        self.rank = rank
        self.gpu_ids = gpu_ids
        self._die = die

    def at_step(self, js: JobSpec, step: int, *, segment: int = 1) -> None:
        slow = self.faults.get("slow_steps")
        if slow and slow["job"] == js.name:
            time.sleep(float(slow["seconds"]))
        hang = self.faults.get("hang")
        if hang and hang["job"] == js.name and step == int(hang["step"]) and _first_time(Path(hang["marker"]), step):
            while True:
                time.sleep(3600)
        crash = self.faults.get("crash")
        if not crash or crash["job"] != js.name or step != int(crash["step"]) or self.rank != 0 \
                or int(crash.get("segment", segment)) != segment:
            return
        if _first_time(Path(crash["marker"]), step):
            deadline = time.monotonic() + 120
            while crash.get("after") and not glob.glob(crash["after"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._die()

    def at_stage(self, js: JobSpec, stage: str) -> None:
        broken = self.faults.get("broken_gpu")
        if broken and stage == "sampling" and int(broken["gpu"]) in self.gpu_ids:
            raise DeviceError(f"injected device fault on GPU {broken['gpu']} (test hook)")
        slow = self.faults.get("slow")
        if slow and slow["job"] == js.name and slow.get("stage", "sampling") == stage:
            time.sleep(float(slow["seconds"]))
        fail = self.faults.get("fail")
        if fail and fail["job"] == js.name and fail.get("stage", "sampling") == stage:
            raise FAULT_TYPES[fail.get("raise", "RuntimeError")](
                f"injected failure in {stage} of job {js.name} (test hook)")


def _first_time(marker: Path, step: int) -> bool:
    """Whether this fault happens now: the first time only (the marker file records it)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, f"pid {os.getpid()} step {step}\n".encode())
    os.close(fd)
    return True
