"""A random-weight RIFE IFNet file, to try frame interpolation without real RIFE weights (and for
the tests):

    python scripts/make_random_ifnet.py weights/ifnet-random.safetensors            # v4.26.heavy, seed 0
    python scripts/make_random_ifnet.py weights/flownet.pkl --variant "v4.25 / v4.26" --prefix module.

It writes every tensor of the variant's network (`pan2render.ifnet_files.ifnet_shapes`): a
``.safetensors`` file, or for any other suffix a plain torch state dict (``torch.save`` of a dict
of tensors, as Practical-RIFE publishes its ``flownet.pkl``; ``--prefix module.`` names the keys
as that file does). The weights are scaled so that the flows stay within a few pixels and the mask
away from 0 and 1: the in-betweens are a plausible blur of the two frames, not a copy of either,
and every weight moves them. Real weights come from Practical-RIFE's releases (docs/architecture.md,
"Frame interpolation").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's pan2render, not whichever one is installed

from pan2render.ifnet_files import DEFAULT_VARIANT, VARIANTS, ifnet_shapes

# Residual gains and output scale that keep 8 residual convolutions per block from blowing up and
# the flows small (each block's output is multiplied by its downscale, up to 16, to give pixels).
BETA = 0.3
OUTPUT_GAIN = 0.3


def random_ifnet_state(*, seed: int, variant: str = DEFAULT_VARIANT) -> dict[str, torch.Tensor]:
    """The variant's tensors, float32, from ``seed``: convolutions ~ N(0, 2 / fan_in) (He, for the
    leaky ReLUs), the blocks' output convolutions and biases small, residual gains ``BETA``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in ifnet_shapes(VARIANTS[variant]).items():
        if key.endswith(".beta"):
            value = torch.full(shape, BETA)
        elif key.endswith(".bias"):
            value = torch.randn(shape, generator=gen) * 0.01
        else:
            transposed = key.startswith("encode.cnn3") or ".lastconv." in key  # [in, out, 4, 4], stride 2
            fan_in = shape[0] * 4 if transposed else shape[1] * shape[2] * shape[3]
            gain = OUTPUT_GAIN if ".lastconv." in key else 2.0 ** 0.5
            value = torch.randn(shape, generator=gen) * (gain / fan_in ** 0.5)
        state[key] = value
    return state


def save_random_ifnet(path: Path, *, seed: int = 0, variant: str = DEFAULT_VARIANT, prefix: str = "") -> Path:
    """Write `random_ifnet_state` to ``path`` (safetensors for a ``.safetensors`` name, else
    ``torch.save``), each key preceded by ``prefix``. Returns the path."""
    state = {prefix + k: v for k, v in random_ifnet_state(seed=seed, variant=variant).items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path), metadata={"format": "pt", "rife_variant": variant})
    else:
        torch.save(state, path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the file to write: .safetensors, or .pth / .pkl for a torch state dict")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", default=DEFAULT_VARIANT, choices=sorted(VARIANTS))
    p.add_argument("--prefix", default="", help="put before every key (Practical-RIFE's files: 'module.')")
    args = p.parse_args(argv)
    path = save_random_ifnet(args.out, seed=args.seed, variant=args.variant, prefix=args.prefix)
    print(f"{path}: random RIFE {args.variant} IFNet weights (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
