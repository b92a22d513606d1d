"""A random LoRA adapter that fits the tiny model, to try `loras` (sweeps over scales, stacking)
without a trained adapter:

    python scripts/make_tiny_lora.py loras/tiny-style.safetensors              # rank 4, seed 0
    python scripts/make_tiny_lora.py loras/tiny-grain.safetensors --rank 2 --seed 1 --strength 1.0

It writes diffusers' / PEFT's layout (``transformer.blocks.0.attn1.to_q.lora_A.weight`` [rank, in]
and ``...lora_B.weight`` [out, rank]) for every attention and feed-forward linear of the tiny DiT,
its shapes read from the tiny model's config (``pan2render.tiny_dit``); ``B @ A`` is about
``--strength`` times a weight's own size, so the adapter visibly changes the (noise) video, as a
real one changes a real model's. Then, in a batch of ``model: tiny``::

    defaults:
      loras: [{path: loras/tiny-style.safetensors, scale: 0.5}]

An adapter for a full-size checkpoint is trained (diffusers, musubi-tuner, DiffSynth): the README's
"LoRA" lists the layouts read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's pan2render, not whichever one is installed

from pan2render.lora_plan import dit_linears
from pan2render.tiny_dit import TINY_DIT_CONFIG


def tiny_lora(*, rank: int, seed: int, strength: float) -> dict[str, np.ndarray]:
    """The adapter's tensors: A ~ N(0, 1/in), B ~ N(0, strength^2/rank), float32."""
    rng = np.random.default_rng(seed)
    shapes = dit_linears(TINY_DIT_CONFIG)
    out: dict[str, np.ndarray] = {}
    for name, (rows, cols) in shapes.items():
        if not name.startswith("blocks."):
            continue  # the attention and feed-forward linears, what LoRA trainers adapt
        out[f"transformer.{name}.lora_A.weight"] = (rng.standard_normal((rank, cols)) / cols ** 0.5).astype(np.float32)
        out[f"transformer.{name}.lora_B.weight"] = (rng.standard_normal((rows, rank)) * strength
                                                    / rank ** 0.5).astype(np.float32)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the .safetensors file to write")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strength", type=float, default=0.5, help="B @ A against a weight's size (default 0.5)")
    args = p.parse_args(argv)
    if args.rank < 1 or args.out.suffix != ".safetensors":
        p.error("--rank must be >= 1 and OUT must end in .safetensors")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tensors = tiny_lora(rank=args.rank, seed=args.seed, strength=args.strength)
    save_file(tensors, str(args.out), metadata={"format": "pt"})
    print(f"{args.out}: a rank-{args.rank} LoRA of {len(tensors) // 2} linears of the tiny DiT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
