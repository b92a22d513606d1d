"""The tiny model's sampling requests the step-checkpoint and preview tests both run: one per
sampler, UniPC also with a first frame (per-token timesteps, the frame re-imposed), at 64x64x17."""

from __future__ import annotations

import numpy as np

SIZE = dict(height=64, width=64, frames=17)  # latent 48 x 5 x 4 x 4
IMAGE = np.random.default_rng(5).integers(0, 256, (40, 48, 3), dtype=np.uint8)
REQUESTS = {
    "unipc": dict(prompt="a fox in the snow", steps=6, guidance=2.5, seed=3, sampler="unipc"),
    "unipc-i2v": dict(prompt="a fox in the snow", steps=5, guidance=2.0, seed=4, sampler="unipc", image=IMAGE),
    "euler": dict(prompt="a kite", steps=5, guidance=3.0, seed=5, sampler="euler"),
    "dmd": dict(prompt="a kite", guidance=1.0, seed=6, sampler="dmd", timesteps=[1000, 757, 522, 261]),
}
