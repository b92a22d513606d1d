"""Random LoRA files in each layout a user brings (for the LoRA tests).

Factors are made per module of OUR naming; each writer renames them to its layout with a table of
its own (written out here, not taken from pan2render), so a wrong mapping on our side shows up as a
mismatch against diffusers, which renames with its own converter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

ATTN = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}
FFN = {"ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}
TOP = {"condition_embedder.time_proj": "time_projection.1", "proj_out": "head.head",
       "condition_embedder.text_embedder.linear_1": "text_embedding.0",
       "condition_embedder.text_embedder.linear_2": "text_embedding.2",
       "condition_embedder.time_embedder.linear_1": "time_embedding.0",
       "condition_embedder.time_embedder.linear_2": "time_embedding.2"}


def wan_name(module: str) -> str:
    """Our module name -> the original Wan code's."""
    if module in TOP:
        return TOP[module]
    _, i, rest = module.split(".", 2)
    for ours, wan in FFN.items():
        if rest == ours:
            return f"blocks.{i}.{wan}"
    attn, proj = rest.split(".", 1)
    return f"blocks.{i}.{'self_attn' if attn == 'attn1' else 'cross_attn'}.{ATTN[proj]}"


def block_modules(num_layers: int) -> list[str]:
    """Every attention and feed-forward linear of every block (what musubi-tuner trains)."""
    return [f"blocks.{i}.{a}.{p}" for i in range(num_layers) for a in ("attn1", "attn2") for p in ATTN] + \
           [f"blocks.{i}.{f}" for i in range(num_layers) for f in FFN]


@dataclass
class Factors:
    """A random LoRA: per module A [rank, in], B [out, rank], an optional alpha and bias delta."""

    down: dict[str, torch.Tensor]
    up: dict[str, torch.Tensor]
    alpha: float | None = None
    bias: dict[str, torch.Tensor] | None = None


def random_factors(shapes: dict[str, tuple[int, int]], modules: list[str], *, rank: int, seed: int,
                   alpha: float | None = None, bias: bool = False, strength: float = 0.5) -> Factors:
    """B @ A ~ strength x a weight's own size (weights ~ 1/sqrt(in)): a LoRA that visibly moves the
    output, as a real one does."""
    g = torch.Generator().manual_seed(seed)
    down, up, biases = {}, {}, {}
    for m in modules:
        out, inp = shapes[m]
        down[m] = torch.randn(rank, inp, generator=g) / inp ** 0.5
        up[m] = torch.randn(out, rank, generator=g) * strength / rank ** 0.5
        if bias:
            biases[m] = torch.randn(out, generator=g) * 0.1
    return Factors(down, up, alpha, biases if bias else None)


def diffusers_dict(f: Factors, *, prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    sd = {}
    for m in f.down:
        sd[f"{prefix}{m}.lora_A.weight"] = f.down[m]
        sd[f"{prefix}{m}.lora_B.weight"] = f.up[m]
        if f.bias:
            sd[f"{prefix}{m}.lora_B.bias"] = f.bias[m]
    return sd


def wan_dict(f: Factors, *, names: tuple[str, str] = ("lora_down", "lora_up")) -> dict[str, torch.Tensor]:
    sd = {}
    for m in f.down:
        base = f"diffusion_model.{wan_name(m)}"
        sd[f"{base}.{names[0]}.weight"] = f.down[m]
        sd[f"{base}.{names[1]}.weight"] = f.up[m]
        if f.alpha is not None:
            sd[f"{base}.alpha"] = torch.tensor(f.alpha)
        if f.bias:
            sd[f"{base}.diff_b"] = f.bias[m]
    return sd


def kohya_dict(f: Factors) -> dict[str, torch.Tensor]:
    assert f.alpha is not None, "musubi-tuner always writes an alpha"
    sd = {}
    for m in f.down:
        base = "lora_unet_" + wan_name(m).replace(".", "_")
        sd[f"{base}.lora_down.weight"] = f.down[m]
        sd[f"{base}.lora_up.weight"] = f.up[m]
        sd[f"{base}.alpha"] = torch.tensor(f.alpha)
    return sd


def write(path: Path, sd: dict[str, torch.Tensor], *, peft_config: dict | None = None) -> Path:
    """A safetensors file; ``peft_config`` as diffusers writes it (``lora_adapter_metadata``)."""
    metadata = {"format": "pt"}
    if peft_config is not None:
        metadata["lora_adapter_metadata"] = json.dumps({f"transformer.{k}": v for k, v in peft_config.items()})
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
    return path
