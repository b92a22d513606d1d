"""Test-wide settings.

Without CUDA, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before any
kernel module is imported (``triton.jit`` reads it at decoration time), so it is set here.
GPU-marked tests skip without CUDA.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `run` hands its batch to a farm that runs at the default farm folder: a farm the person running
# the tests keeps up must never get the tests' batches. Tests that want a farm start their own.
os.environ["PAN2_RENDER_FARM"] = tempfile.mkdtemp(prefix="pan2-tests-no-farm-")

# Tests are small; two cores are shared by the suite. One intra-op thread keeps timings stable and
# avoids oversubscription when Ray workers run beside the test process.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
