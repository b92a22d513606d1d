"""How many intra-op threads torch runs a CPU worker's work on.

A CPU worker gets its share of the machine's cores (``WorkerConfig.threads``: the cores over the
logical GPUs), and its sampling runs on that many. Its VAE decode does not: on a CPU the decoder's
convolutions give other bits on another number of threads (the mid-block attention's 1x1 qkv
convolution of a 512x512 decode differs in its 7th digit between 1 and 2 threads, and the uint8
frames in a few hundred pixels), so a video rendered with ``--cpu-gpus 1`` and with ``--cpu-gpus 2``
would differ. The decode runs on `CPU_DECODE_THREADS` whatever the share: the same frames, so the
same mp4 (whose encoder's thread count is a function of the frame size alone:
``media.video.frame_threads``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

CPU_DECODE_THREADS = 1  # the same on every machine, whatever its cores


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the block on ``n`` torch intra-op threads (None: as they are), then put them back."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
