"""What a LoRA file adapts, read from its safetensors header alone: no torch, no tensor data.

One place, shared by batch validation (``pan2render.jobs``: the driver never imports torch) and the
worker's loader (``pan2render.models.lora``), so that a file the batch accepts is a file the worker
merges, and the reverse.

Layouts accepted, as diffusers' ``WanLoraLoaderMixin.lora_state_dict`` tells them apart (diffusers
0.42.1, ``loaders/lora_conversion_utils.py``):

- diffusers / PEFT: ``[transformer.]blocks.0.attn1.to_q.lora_A.weight`` / ``lora_B.weight`` (+
  ``lora_B.bias``), module names exactly ours (our DiT's state-dict keys are
  ``WanTransformer3DModel``'s). PEFT's own scaling, when the file carries it (its
  ``lora_adapter_metadata``: ``r``, ``lora_alpha``, ``rank_pattern``, ``alpha_pattern``,
  ``use_rslora``), applies as diffusers applies it; without it the scale is 1.
- original Wan (ComfyUI, lightx2v, DiffSynth): any key starting ``diffusion_model.``:
  ``blocks.0.self_attn.q.lora_A.weight`` or ``lora_down`` / ``lora_up``, optional ``.alpha``,
  ``.diff_b`` bias deltas, and ``head.head.diff`` (a whole ``proj_out`` delta);
- kohya / musubi-tuner: any key starting ``lora_unet_``: ``lora_unet_blocks_0_self_attn_q.lora_down.weight``
  + ``.alpha``: the original Wan names with dots flattened to underscores.

An ``.alpha`` scales its module by alpha / rank (diffusers folds that into the factors). The
``.diff`` / ``.diff_b`` keys diffusers leaves unread are dropped likewise (the norms', zeros in
released files; a ``.diff`` of any layer but head.head; those of modules it has no name for), so a
file renders as it does in diffusers. Everything else that does not fit the DiT is an error naming
the file and the first offending keys: a key naming no module of the model (another model's LoRA,
a Wan2.1 image-to-video one, a 40-block 14B one), a shape that does not fit (a 5120-wide 14B LoRA on the 3072-wide 5B),
DoRA, a half of a factor pair, a tensor that is not a LoRA's.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
import stat
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What a LoRA's tensors may be stored as (the float dtypes torch reads; safetensors' names).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# A LoRA's header lists a few thousand tensors; a longer one is a damaged file, not metadata.
MAX_HEADER_BYTES = 100_000_000
# How many offending keys an error names.
KEYS_LISTED = 5
# Formats that can run code when loaded (torch.save / pickle, and zip archives of them).
PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl", ".pickle")
# diffusers' key in a safetensors file's ``__metadata__`` holding PEFT's LoraConfig as JSON.
PEFT_METADATA_KEY = "lora_adapter_metadata"
PEFT_PREFIX = "transformer."  # diffusers' prefix of the transformer's keys (and its metadata keys)


class LoraFileError(ValueError):
    """A LoRA file cannot be applied to this DiT; the message names the file and what is wrong."""


class Layout(enum.Enum):
    """The key layouts a LoRA file may use (see the module docstring)."""

    DIFFUSERS = "diffusers/PEFT"
    WAN = "original Wan (diffusion_model.)"
    KOHYA = "kohya/musubi (lora_unet_)"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header."""

    dtype: str  # safetensors' name: "F32", "BF16", ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Header:
    """A safetensors header: every tensor's dtype and shape, and the file's string metadata."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


@dataclass(frozen=True)
class Target:
    """One linear layer of the DiT a LoRA file adapts, and which of the file's keys do it.

    Times the job's scale, the weight's delta is ``config_scale * alpha / rank * (up @ down)``
    [out, in] (``up`` B [out, rank], ``down`` A [rank, in]; alpha / rank is 1 without an alpha) or
    ``config_scale * diff`` (a whole-weight delta), and the bias's ``config_scale * bias`` [out]:
    diffusers folds alpha / rank into the factors alone, PEFT's scaling multiplies both.
    """

    module: str  # our (= diffusers') module name, e.g. "blocks.0.attn1.to_q"
    down: str | None = None  # key of A
    up: str | None = None  # key of B
    alpha: str | None = None  # key of a scalar alpha (scale alpha / rank)
    diff: str | None = None  # key of a whole-weight delta [out, in]
    bias: str | None = None  # key of a bias delta [out]
    rank: int = 0  # A's rows (0 for a whole-weight delta)
    config_scale: float = 1.0  # PEFT's lora_alpha / r from the file's metadata (1 without it)


@dataclass(frozen=True)
class LoraPlan:
    """What one LoRA file does to the DiT: its layout, the layers it adapts, the keys dropped."""

    file: str  # as named in messages
    layout: Layout
    targets: tuple[Target, ...]
    dropped: tuple[str, ...]  # norm diff keys, dropped as diffusers drops them


# ------------------------------------------------------------------------------------------------
# The DiT's linear layers


def dit_linears(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Every linear layer of the PAN2 DiT (Wan2.2-TI2V-5B transformer) built from ``config`` (a
    ``transformer/config.json`` dict): module name -> weight shape (out, in).

    Torch-free so a batch is checked before any model loads; `pan2render.models.lora.linear_shapes`
    reads the same off a built model, and a test holds the two equal."""
    heads, head_dim = int(config.get("num_attention_heads", 24)), int(config.get("attention_head_dim", 128))
    dim, ffn = heads * head_dim, int(config.get("ffn_dim", 14336))
    patch = config.get("patch_size", (1, 2, 2))
    out_channels = config.get("out_channels") or config.get("in_channels", 48)
    shapes = {
        "condition_embedder.time_embedder.linear_1": (dim, int(config.get("freq_dim", 256))),
        "condition_embedder.time_embedder.linear_2": (dim, dim),
        "condition_embedder.time_proj": (6 * dim, dim),
        "condition_embedder.text_embedder.linear_1": (dim, int(config.get("text_dim", 4096))),
        "condition_embedder.text_embedder.linear_2": (dim, dim),
        "proj_out": (int(out_channels) * math.prod(int(p) for p in patch), dim),
    }
    for i in range(int(config.get("num_layers", 30))):
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                shapes[f"blocks.{i}.{attn}.{proj}"] = (dim, dim)
        shapes[f"blocks.{i}.ffn.net.0.proj"] = (ffn, dim)
        shapes[f"blocks.{i}.ffn.net.2"] = (dim, ffn)
    return shapes


# The original Wan code's module names -> ours (diffusers' convert_wan_transformer_to_diffusers
# renames, as its LoRA converter applies them).
_WAN_BLOCK_NAMES = {
    **{f"self_attn.{o}": f"attn1.{c}" for o, c in zip("qkvo", ("to_q", "to_k", "to_v", "to_out.0"))},
    **{f"cross_attn.{o}": f"attn2.{c}" for o, c in zip("qkvo", ("to_q", "to_k", "to_v", "to_out.0"))},
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_WAN_TOP_NAMES = {
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
}


def wan_module_names(num_layers: int) -> dict[str, str]:
    """Original Wan module name -> ours, for a DiT of ``num_layers`` blocks."""
    names = dict(_WAN_TOP_NAMES)
    for i in range(num_layers):
        names.update({f"blocks.{i}.{w}": f"blocks.{i}.{d}" for w, d in _WAN_BLOCK_NAMES.items()})
    return names


# ------------------------------------------------------------------------------------------------
# Reading a header


def read_header(path: str | Path, *, display: str | None = None, limit: int | None = None,
                read_first: Callable[[int], bytes] | None = None) -> Header:
    """The safetensors header of ``path``: LoraFileError for a pickle, anything not safetensors, a
    file that is no regular file (a FIFO would block) or is over ``limit`` bytes.

    ``read_first(n)`` gives the file's first ``n`` bytes (fewer where it is shorter) in place of this
    module's own reads: batch validation passes ``jobs.inputs``' reader, which also gives up on a
    read that stalls; what it raises passes through."""
    path = Path(path)
    name = display or str(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise LoraFileError(f"LoRA {name!r}: {path.suffix} files are pickles, which can run code when loaded and "
                            f"are never read; allowed: a .safetensors file (convert it with safetensors' "
                            f"save_file)")
    return _header_from(read_first or (lambda n: _read_first(path, n, name=name, limit=limit)), name)


def _read_first(path: Path, n: int, *, name: str, limit: int | None) -> bytes:
    """The first ``n`` bytes of ``path``, opened without waiting and only if it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise LoraFileError(f"LoRA {name!r} is not a regular file; allowed: a .safetensors file")
            if limit is not None and st.st_size > limit:
                raise LoraFileError(f"LoRA {name!r} is {st.st_size:,} bytes; allowed: at most {limit:,} bytes")
            return os.pread(fd, n, 0)
        finally:
            os.close(fd)
    except FileNotFoundError as e:
        raise LoraFileError(f"LoRA {name!r} does not exist") from e
    except OSError as e:
        raise LoraFileError(f"LoRA {name!r} cannot be read: {e.strerror or e}") from e


def header_of_bytes(data: bytes, *, display: str) -> Header:
    """`read_header` for a file's bytes (what a worker receives)."""
    return _header_from(lambda n: data[:n], display)


def _header_from(read_first: Callable[[int], bytes], name: str) -> Header:
    """The header of the file whose first ``n`` bytes ``read_first(n)`` gives: an 8-byte size, then
    that many bytes of JSON."""
    head = read_first(8)
    if head[:2] == b"PK" or head[:1] == b"\x80":
        raise LoraFileError(f"LoRA {name!r} is a pickle (torch.save) file, which can run code when loaded and is "
                            f"never read; allowed: a .safetensors file")
    if len(head) < 8:
        raise LoraFileError(f"LoRA {name!r} is {len(head)} bytes, too short to be a safetensors file")
    (size,) = struct.unpack("<Q", head)
    if size > MAX_HEADER_BYTES:
        raise LoraFileError(f"LoRA {name!r} is not a safetensors file (its first 8 bytes give a header of {size} "
                            f"bytes, past {MAX_HEADER_BYTES:,}); allowed: a .safetensors file")
    raw = read_first(8 + size)[8:]
    if len(raw) < size:
        raise LoraFileError(f"LoRA {name!r} is not a safetensors file (its first 8 bytes give a header of {size} "
                            f"bytes in a file of {8 + len(raw)}); allowed: a .safetensors file")
    return _parse_header(raw, name)


def _parse_header(raw: bytes, name: str) -> Header:
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        raise LoraFileError(f"LoRA {name!r} is not a safetensors file (its header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise LoraFileError(f"LoRA {name!r} is not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorEntry] = {}
    for key, entry in header.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise LoraFileError(f"LoRA {name!r} is not a valid safetensors file: tensor {key!r} has no shape")
        tensors[key] = TensorEntry(str(entry.get("dtype")), tuple(shape))
    if not isinstance(metadata, dict):
        raise LoraFileError(f"LoRA {name!r} is not a valid safetensors file: __metadata__ is not an object")
    return Header(tensors, {str(k): str(v) for k, v in metadata.items()})


# ------------------------------------------------------------------------------------------------
# Keys -> targets

# A key's last part: what the tensor is to its module, in every layout (longest first).
_PARTS = {
    "lora_A.weight": "down", "lora_down.weight": "down",
    "lora_B.weight": "up", "lora_up.weight": "up",
    "lora_B.bias": "bias", "diff_b": "bias",
    "alpha": "alpha", "diff": "diff",
}
_DORA_PARTS = ("dora_scale", "lora_magnitude_vector")


def _listed(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:KEYS_LISTED])
    return shown + (f" and {len(keys) - KEYS_LISTED} more" if len(keys) > KEYS_LISTED else "")


def detect_layout(keys: list[str], name: str) -> tuple[Layout, dict[str, str]]:
    """The file's layout, as diffusers decides it, and each key without its layout's prefix."""
    if any(k.startswith("diffusion_model.") for k in keys):
        layout, prefix = Layout.WAN, "diffusion_model."
    elif any(k.startswith("lora_unet_") for k in keys):
        layout, prefix = Layout.KOHYA, "lora_unet_"
    else:
        layout = Layout.DIFFUSERS
        prefix = next((p for p in (PEFT_PREFIX, "base_model.model.") if any(k.startswith(p) for k in keys)), "")
    others = [k for k in keys if not k.startswith(prefix)]
    if others:
        hint = (" (they adapt a text encoder, which pan2-render does not)"
                if any(k.startswith(("text_encoder", "lora_te")) for k in others) else "")
        raise LoraFileError(f"LoRA {name!r}: its keys are in the {layout.value} layout, but {len(others)} are not: "
                            f"{_listed(others)}{hint}; allowed: one layout per file, adapting the transformer")
    return layout, {k: k[len(prefix):] for k in keys}


def _split(key: str) -> tuple[str, str | None]:
    """(module, part) of a key without its layout prefix; part None when it is no LoRA tensor."""
    for suffix, part in _PARTS.items():
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], part
    return key, None


def _kohya_names(num_layers: int) -> dict[str, str]:
    return {wan.replace(".", "_"): ours for wan, ours in wan_module_names(num_layers).items()}


def _other_model_hint(modules: list[str]) -> str:
    text = " ".join(modules)
    if any(m.startswith(("text_encoder", "te_", "lora_te")) for m in modules):
        return " (text encoder modules: pan2-render adapts the transformer only)"
    if any(s in text for s in ("k_img", "v_img", "img_emb")):
        return (" (image keys k_img / v_img / img_emb: a Wan2.1 image-to-video LoRA; this DiT is Wan2.2-TI2V-5B "
                "and has no image branch)")
    if any(s in text for s in ("down_blocks", "input_blocks", "double_blocks", "single_transformer_blocks",
                               "transformer_blocks", "single_blocks")):
        return " (these are another model's module names: a LoRA for a different architecture)"
    if "blocks" in text:
        return " (a LoRA for another Wan size, with more blocks than this DiT has?)"
    return " (a LoRA for another model?)"


def _ignored_by_diffusers(part: str, module: str, ours: str | None) -> bool:
    """Whole-weight and bias diffs diffusers' converter leaves unread: the norms' (zeros in released
    files), a ``.diff`` of any layer but head.head, and any diff of a module it has no name for
    (``modulation``, ``patch_embedding``). Applying them would render otherwise than diffusers."""
    if part not in ("diff", "bias"):
        return False
    return "norm" in module or ours is None or (part == "diff" and ours != "proj_out")


def plan_lora(header: Header, linears: Mapping[str, tuple[int, int]], *, name: str) -> LoraPlan:
    """Check a LoRA header against the DiT's linear layers (`dit_linears`) and say what it adapts.

    Raises LoraFileError naming ``name`` and the first offending keys."""
    keys = list(header.tensors)
    if not keys:
        raise LoraFileError(f"LoRA {name!r} holds no tensors")
    layout, bare = detect_layout(keys, name)
    num_layers = sum(1 for m in linears if m.endswith(".attn1.to_q"))
    rename = ({} if layout is Layout.DIFFUSERS else wan_module_names(num_layers) if layout is Layout.WAN
              else _kohya_names(num_layers))
    parts: dict[str, dict[str, str]] = {}  # our module -> part -> file key
    dropped: list[str] = []
    not_lora: list[str] = []
    dora: list[str] = []
    unmatched: dict[str, str] = {}  # file module name -> first key
    for key in keys:
        module, part = _split(bare[key])
        if any(d in bare[key] for d in _DORA_PARTS):
            dora.append(key)
            continue
        if part is None:
            not_lora.append(key)
            continue
        ours = module if layout is Layout.DIFFUSERS else rename.get(module)
        if layout is not Layout.DIFFUSERS and _ignored_by_diffusers(part, module, ours):
            dropped.append(key)
            continue
        if ours is None or ours not in linears:
            unmatched.setdefault(module, key)
            continue
        parts.setdefault(ours, {})
        if part in parts[ours]:
            raise LoraFileError(f"LoRA {name!r}: keys {parts[ours][part]!r} and {key!r} both give the {part} of "
                                f"{ours!r}; allowed: one per module")
        parts[ours][part] = key
    time_proj = "condition_embedder.time_proj"
    if layout is Layout.WAN and time_proj in parts and "down" not in parts[time_proj]:
        # diffusers drops time_projection bias deltas that come without its factors (AccVideo's)
        dropped += parts.pop(time_proj).values()
    if dora:
        raise LoraFileError(f"LoRA {name!r} is a DoRA adapter ({_listed(dora)}); only plain LoRA is supported")
    if not_lora:
        raise LoraFileError(f"LoRA {name!r}: {len(not_lora)} tensor(s) are not LoRA factors: {_listed(not_lora)}; "
                            f"allowed: <module>.lora_A.weight / lora_B.weight (or lora_down / lora_up), .alpha, "
                            f"lora_B.bias / .diff_b")
    if unmatched:
        first = list(unmatched.values())
        hint = _other_model_hint(list(unmatched))
        raise LoraFileError(f"LoRA {name!r}: {len(first)} module(s) it adapts are not in this DiT{hint}: first "
                            f"keys {_listed(first)}")
    config = _peft_config(header.metadata, name)
    targets = tuple(_target(module, p, header, linears[module], config, name) for module, p in parts.items())
    return LoraPlan(file=name, layout=layout, targets=targets, dropped=tuple(dropped))


def _shape_problem(key: str, got: tuple[int, ...], want: tuple[int, ...], module: str,
                   module_shape: tuple[int, int]) -> str:
    out, inp = module_shape
    return (f"key {key!r} has shape {list(got)} where {module!r} (a linear of {inp} inputs, {out} outputs) needs "
            f"{list(want)}: a LoRA for a model of another width")


def _target(module: str, parts: dict[str, str], header: Header, shape: tuple[int, int],
            config: "_PeftConfig | None", name: str) -> Target:
    out, inp = shape
    t = header.tensors
    problems: list[str] = []
    for key in parts.values():
        if t[key].dtype not in FLOAT_DTYPES:
            problems.append(f"key {key!r} is {t[key].dtype}; allowed: one of {', '.join(FLOAT_DTYPES)}")
    down, up = parts.get("down"), parts.get("up")
    if (down is None) != (up is None):
        have = down or up
        partner = "lora_B / lora_up" if up is None else "lora_A / lora_down"
        raise LoraFileError(f"LoRA {name!r}: {have!r} has no {partner} partner; allowed: both factors of every module")
    if "diff" in parts and down is not None:
        raise LoraFileError(f"LoRA {name!r}: {parts['diff']!r} and {down!r} both adapt {module!r}; allowed: factors "
                            f"or a whole-weight diff, not both")
    rank = 0
    if down is not None and up is not None:
        rank = t[down].shape[0] if len(t[down].shape) == 2 else 0
        if t[down].shape != (rank, inp) or rank == 0:
            problems.append(_shape_problem(down, t[down].shape, (rank or 1, inp), module, shape))
        if t[up].shape != (out, rank):
            problems.append(_shape_problem(up, t[up].shape, (out, rank), module, shape))
    if "diff" in parts and t[parts["diff"]].shape != (out, inp):
        problems.append(_shape_problem(parts["diff"], t[parts["diff"]].shape, (out, inp), module, shape))
    if "bias" in parts and t[parts["bias"]].shape != (out,):
        problems.append(_shape_problem(parts["bias"], t[parts["bias"]].shape, (out,), module, shape))
    if "alpha" in parts and math.prod(t[parts["alpha"]].shape) != 1:
        problems.append(f"key {parts['alpha']!r} has shape {list(t[parts['alpha']].shape)}; an alpha is one number")
    if "alpha" in parts and down is None:
        problems.append(f"key {parts['alpha']!r}: an alpha scales lora_A/lora_B factors, and {module!r} has none")
    if problems:
        raise LoraFileError(f"LoRA {name!r} does not fit this DiT: " + "; ".join(problems[:KEYS_LISTED]))
    # A bias delta alone is applied as diffusers applies it (PEFT's lora_B.bias, factors at zero).
    scale = 1.0 if config is None or "diff" in parts else config.scale(module, rank or None, name)
    return Target(module=module, down=down, up=up, alpha=parts.get("alpha"), diff=parts.get("diff"),
                  bias=parts.get("bias"), rank=rank, config_scale=scale)


# ------------------------------------------------------------------------------------------------
# PEFT's config in the file's metadata


@dataclass(frozen=True)
class _PeftConfig:
    """The part of PEFT's LoraConfig that sets a module's scale: lora_alpha / r (or / sqrt(r))."""

    r: int
    lora_alpha: float
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    use_rslora: bool

    def scale(self, module: str, rank: int | None, name: str) -> float:
        """``module``'s scale; ``rank``: its factors' (None for a bias delta alone)."""
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        if rank is not None and r != rank:
            raise LoraFileError(f"LoRA {name!r}: its metadata gives {module!r} rank {r}, its tensors rank {rank}")
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str:
    """PEFT's ``get_pattern_key``: the first pattern that matches the end of the module name."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def _peft_config(metadata: dict[str, str], name: str) -> _PeftConfig | None:
    raw = metadata.get(PEFT_METADATA_KEY)
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise LoraFileError(f"LoRA {name!r}: its {PEFT_METADATA_KEY} metadata is not JSON ({e})") from e
    if not isinstance(data, dict):
        raise LoraFileError(f"LoRA {name!r}: its {PEFT_METADATA_KEY} metadata is not a JSON object")
    config = {k[len(PEFT_PREFIX):]: v for k, v in data.items() if k.startswith(PEFT_PREFIX)}
    if not config:
        return None
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "transposed (fan_in_fan_out) factors")):
        if config.get(flag):
            raise LoraFileError(f"LoRA {name!r}: its metadata asks for {why}, which is not supported")
    try:
        r = int(config["r"])
        return _PeftConfig(r=r, lora_alpha=float(config.get("lora_alpha", r)),
                           rank_pattern={str(k): int(v) for k, v in (config.get("rank_pattern") or {}).items()},
                           alpha_pattern={str(k): float(v) for k, v in (config.get("alpha_pattern") or {}).items()},
                           use_rslora=bool(config.get("use_rslora", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise LoraFileError(f"LoRA {name!r}: its {PEFT_METADATA_KEY} metadata has no usable r / lora_alpha "
                            f"({e})") from e


def plan_lora_file(path: str | Path, linears: Mapping[str, tuple[int, int]], *, display: str | None = None,
                   limit: int | None = None) -> LoraPlan:
    """`read_header` then `plan_lora`."""
    name = display or str(path)
    return plan_lora(read_header(path, display=name, limit=limit), linears, name=name)
