"""What a RIFE IFNet weights file must hold, and its check, torch-free for safetensors files.

One place, shared by batch validation (which runs in a driver that never imports torch) and the
worker's loader (``pan2render.models.ifnet``), so that a file the check accepts is a file the loader
loads, and the reverse.

Files are the user's: a ``.safetensors`` file, or a plain torch state dict (``torch.save`` of a
dict of tensors, whatever its suffix: Practical-RIFE's ``flownet.pkl``, ComfyUI's ``rife426.pth``).
The format is told by the file's first bytes, not its name. A torch file is read by
``torch.load(weights_only=True)`` only, which refuses any pickle that would build anything but
tensors and plain containers: no code in a weights file ever runs.

Keys are matched as RIFE's own loader matches them, stricter: a ``module.`` prefix (Practical-RIFE
saves its flownet from a DistributedDataParallel wrapper) is taken off; the training-only modules
published 4.2x files still carry (``teacher.*``, the distillation block, and ``caltime.*``) are
dropped, as RIFE's ``load_state_dict(..., strict=False)`` ignores them. Anything else that does not
fit the network is an error naming the file: a missing key, a key no variant has, a shape that does
not fit, a tensor that is not floating point.

Which variant a file is comes from its shapes (the frame encoder's output channels and each flow
block's width); `VARIANTS` lists the ones accepted. They all run the same forward.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Published RIFE weights are tens of MB; a header past this is a damaged file, not metadata.
MAX_HEADER_BYTES = 10_000_000
# How many offending keys a message names.
KEYS_LISTED = 4
# Prefixes taken off every key that has one: DistributedDataParallel's, in Practical-RIFE's files.
KEY_PREFIXES = ("module.",)
# Modules published files carry for training only; RIFE's own loader leaves them unread.
TRAINING_ONLY = ("teacher.", "caltime.")
# The float dtypes a weight may be stored as (safetensors' names; torch files: any floating dtype).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Bytes per element of each dtype a safetensors header may name.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}

SAFETENSORS = "safetensors"
TORCH = "torch state dict"


class IFNetWeightsError(ValueError):
    """A file cannot be loaded as IFNet weights; the message names the file and what is wrong."""


@dataclass(frozen=True)
class IFNetConfig:
    """The widths that tell RIFE v4.25 / v4.26 variants apart; everything else is fixed (a 3 -> 16
    -> 16 -> 16 frame encoder, five flow blocks of eight residual convolutions at 1/16 .. 1/1 of
    the frame, 13 output channels each: 4 flow, 1 mask, 8 features)."""

    encoder_channels: int = 16  # the frame encoder's output channels: 16 in v4.26.heavy, 4 in v4.25/4.26
    block_channels: tuple[int, ...] = (192, 128, 96, 64, 32)  # each flow block's width, coarse to fine

    def __post_init__(self) -> None:
        if self.encoder_channels < 1:
            raise ValueError(f"encoder_channels must be >= 1, got {self.encoder_channels}")
        if len(self.block_channels) != BLOCKS or any(c < 2 or c % 2 for c in self.block_channels):
            raise ValueError(f"block_channels must be {BLOCKS} even widths >= 2, got {self.block_channels}")


BLOCKS = 5  # flow blocks, one per scale of RIFE's scale list (16, 8, 4, 2, 1)
RESIDUAL_CONVS = 8  # residual convolutions per flow block
ENCODER_WIDTH = 16  # the frame encoder's hidden channels
BLOCK_OUTPUTS = 13  # per flow block: 4 flow (two 2-D flows), 1 mask logit, 8 features carried on

# The variants accepted (Practical-RIFE's names), all with the same forward. The default is the
# one ccvfi ships (RIFE_IFNet_v426_heavy), which the parity tests run against.
VARIANTS: dict[str, IFNetConfig] = {
    "v4.26.heavy": IFNetConfig(encoder_channels=16, block_channels=(192, 128, 96, 64, 32)),
    "v4.25 / v4.26": IFNetConfig(encoder_channels=4, block_channels=(192, 128, 96, 64, 32)),
    "v4.25.heavy": IFNetConfig(encoder_channels=4, block_channels=(384, 256, 192, 128, 64)),
}
DEFAULT_VARIANT = "v4.26.heavy"


def variant_name(config: IFNetConfig) -> str | None:
    return next((name for name, c in VARIANTS.items() if c == config), None)


def block_inputs(config: IFNetConfig, index: int) -> int:
    """Input channels of flow block ``index``. Block 0 sees both frames, both encodings and the
    timestep; the others the two warped frames, both warped encodings, the timestep, the mask logit
    and the 8 features carried from the block before, then the 4 flow channels so far."""
    both = 3 + 3 + 2 * config.encoder_channels + 1
    return both if index == 0 else both + 1 + 8 + 4


def ifnet_shapes(config: IFNetConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an IFNet built from ``config``: state-dict key -> shape.

    Torch-free so a file is checked before any model is built; `pan2render.models.ifnet.IFNet`'s
    state dict has exactly these (a test holds the two equal)."""
    e, w = config.encoder_channels, ENCODER_WIDTH
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(key: str, out: int, inp: int, k: int = 3) -> None:
        shapes[f"{key}.weight"], shapes[f"{key}.bias"] = (out, inp, k, k), (out,)

    def transposed(key: str, inp: int, out: int) -> None:  # ConvTranspose2d stores [in, out, k, k]
        shapes[f"{key}.weight"], shapes[f"{key}.bias"] = (inp, out, 4, 4), (out,)

    conv("encode.cnn0", w, 3)
    conv("encode.cnn1", w, w)
    conv("encode.cnn2", w, w)
    transposed("encode.cnn3", w, e)
    for i, c in enumerate(config.block_channels):
        conv(f"block{i}.conv0.0.0", c // 2, block_inputs(config, i))
        conv(f"block{i}.conv0.1.0", c, c // 2)
        for j in range(RESIDUAL_CONVS):
            conv(f"block{i}.convblock.{j}.conv", c, c)
            shapes[f"block{i}.convblock.{j}.beta"] = (1, c, 1, 1)
        transposed(f"block{i}.lastconv.0", c, 4 * BLOCK_OUTPUTS)  # then a pixel shuffle by 2
    return shapes


# ------------------------------------------------------------------------------------------------
# Matching a file's tensors to the network


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its dtype (safetensors' name, or torch's) and shape."""

    dtype: str
    shape: tuple[int, ...]
    is_float: bool


@dataclass(frozen=True)
class IFNetPlan:
    """What a weights file loads as: its variant, and for each of the network's keys the file's key."""

    file: str
    variant: str
    config: IFNetConfig
    keys: dict[str, str]  # our key -> the file's key
    dropped: tuple[str, ...] = field(default=())  # training-only keys left unread


def _listed(keys: list[str]) -> str:
    more = f" and {len(keys) - KEYS_LISTED} more" if len(keys) > KEYS_LISTED else ""
    return ", ".join(repr(k) for k in keys[:KEYS_LISTED]) + more


def _accepted() -> str:
    return "; ".join(f"{name}: encoder {c.encoder_channels} channels, blocks {'/'.join(map(str, c.block_channels))}"
                     for name, c in VARIANTS.items())


def _strip(key: str) -> str:
    for prefix in KEY_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _infer_config(shapes: Mapping[str, tuple[int, ...]]) -> IFNetConfig | None:
    """The config the file's shapes say, or None where the keys that tell it are absent or odd."""
    encoder = shapes.get("encode.cnn3.weight")
    widths = [shapes.get(f"block{i}.conv0.1.0.weight") for i in range(BLOCKS)]
    if encoder is None or len(encoder) != 4 or any(s is None or len(s) != 4 for s in widths):
        return None
    try:
        return IFNetConfig(encoder_channels=encoder[1], block_channels=tuple(s[0] for s in widths))  # type: ignore[index]
    except ValueError:
        return None


def plan_ifnet(entries: Mapping[str, TensorEntry], *, name: str) -> IFNetPlan:
    """Match a file's tensors (key -> entry) to the IFNet they fit, or IFNetWeightsError naming
    ``name`` and every kind of problem found (the first few keys of each)."""
    if not entries:
        raise IFNetWeightsError(f"IFNet weights file {name!r} holds no tensors")
    ours: dict[str, str] = {}
    dropped: list[str] = []
    for key in entries:
        stripped = _strip(key)
        if stripped.startswith(TRAINING_ONLY):
            dropped.append(key)
        elif stripped in ours:
            raise IFNetWeightsError(f"IFNet weights file {name!r}: key {stripped!r} appears twice "
                                    f"({ours[stripped]!r} and {key!r}); allowed: each key once, with or without "
                                    f"a {KEY_PREFIXES[0]!r} prefix")
        else:
            ours[stripped] = key
    shapes = {k: entries[v].shape for k, v in ours.items()}
    inferred = _infer_config(shapes)
    variant = variant_name(inferred) if inferred is not None else None
    if inferred is not None and variant is None:
        raise IFNetWeightsError(
            f"IFNet weights file {name!r}: a frame encoder of {inferred.encoder_channels} channels and flow blocks "
            f"{'/'.join(map(str, inferred.block_channels))} wide are no RIFE variant this IFNet runs; accepted: "
            f"{_accepted()}")
    if variant is None:
        variant = DEFAULT_VARIANT  # the keys that tell the variant are missing: report against the default
    config = VARIANTS[variant]
    want = ifnet_shapes(config)
    problems = []
    missing = [k for k in want if k not in ours]
    if missing:
        hint = ""
        if not any(k.startswith("encode.") for k in ours):
            hint = " (the file has no frame encoder, 'encode.*': RIFE before v4.7, or not RIFE at all)"
        problems.append(f"missing {len(missing)} key(s) {_listed(missing)}{hint}")
    unexpected = [ours[k] for k in ours if k not in want]
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s) {_listed(unexpected)}")
    wrong = [f"{ours[k]!r} is {list(shapes[k])}, expected {list(want[k])}" for k in want
             if k in ours and shapes[k] != want[k]]
    if wrong:
        more = f" and {len(wrong) - KEYS_LISTED} more" if len(wrong) > KEYS_LISTED else ""
        problems.append("shape mismatch: " + "; ".join(wrong[:KEYS_LISTED]) + more)
    not_float = [ours[k] for k in want if k in ours and not entries[ours[k]].is_float]
    if not_float:
        problems.append(f"not floating point: {_listed(not_float)} ({entries[not_float[0]].dtype})")
    if problems:
        raise IFNetWeightsError(f"IFNet weights file {name!r} does not fit RIFE {variant}: " + "; ".join(problems)
                                + f". Accepted: {_accepted()}")
    return IFNetPlan(file=name, variant=variant, config=config, keys={k: ours[k] for k in want},
                     dropped=tuple(dropped))


# ------------------------------------------------------------------------------------------------
# Reading a file


def weights_format(path: Path, *, name: str | None = None) -> str:
    """`SAFETENSORS` or `TORCH`, from the first bytes of ``path`` (a regular file, opened without
    waiting: a FIFO would block), or IFNetWeightsError saying what it is instead."""
    name = name or str(path)
    head = _read_first(path, 9, name=name)
    if not head:
        raise IFNetWeightsError(f"IFNet weights file {name!r} is empty")
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":  # torch.save: a zip archive, or a legacy bare pickle
        return TORCH
    if len(head) == 9 and head[8:9] == b"{":  # an 8-byte header length, then the JSON header
        return SAFETENSORS
    raise IFNetWeightsError(f"IFNet weights file {name!r} is neither a safetensors file nor a torch state dict "
                            f"(it starts {head!r}); allowed: .safetensors, or torch.save of a state dict "
                            f"(.pth / .pkl / .ckpt)")


def _read_first(path: Path, n: int, *, name: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IFNetWeightsError(f"IFNet weights file {name!r} is a directory; allowed: a weights file")
            if not stat.S_ISREG(mode):
                raise IFNetWeightsError(f"IFNet weights file {name!r} is not a regular file; allowed: a weights file")
            return os.pread(fd, n, 0)
        finally:
            os.close(fd)
    except FileNotFoundError as e:
        raise IFNetWeightsError(f"IFNet weights file {name!r} does not exist") from e
    except OSError as e:
        raise IFNetWeightsError(f"IFNet weights file {name!r} cannot be read: {e.strerror or e}") from e


def safetensors_entries(path: Path, *, name: str | None = None) -> dict[str, TensorEntry]:
    """The tensors a safetensors file's header lists, without reading their data; their byte
    ranges are checked to fill the data section exactly, as safetensors checks them when it loads,
    so that a truncated download fails the check, not only the load."""
    name = name or str(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise IFNetWeightsError(f"IFNet weights file {name!r}: a safetensors header of {size:,} bytes is past "
                                        f"{MAX_HEADER_BYTES:,}: a damaged file")
            raw = f.read(size)
    except OSError as e:
        raise IFNetWeightsError(f"IFNet weights file {name!r} cannot be read: {e.strerror or e}") from e
    if len(raw) < size:
        raise IFNetWeightsError(f"IFNet weights file {name!r}: its safetensors header says {size:,} bytes, the file "
                                f"holds {len(raw):,} after the first 8: a truncated file")
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        raise IFNetWeightsError(f"IFNet weights file {name!r}: its safetensors header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise IFNetWeightsError(f"IFNet weights file {name!r}: its safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    entries, ranges = {}, []
    for key, entry in header.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        dtype = str(entry.get("dtype")) if isinstance(entry, dict) else ""
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and dtype in DTYPE_BYTES):
            raise IFNetWeightsError(f"IFNet weights file {name!r}: tensor {key!r} has no valid dtype, shape and "
                                    f"data_offsets in the header")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise IFNetWeightsError(f"IFNet weights file {name!r}: tensor {key!r} spans {offsets[1] - offsets[0]} "
                                    f"bytes, its {dtype} {shape} needs {math.prod(shape) * DTYPE_BYTES[dtype]}")
        entries[key] = TensorEntry(dtype, tuple(shape), dtype in FLOAT_DTYPES)
        ranges.append((offsets[0], offsets[1]))
    data = file_size - 8 - size
    end = 0
    for start, stop in sorted(ranges):
        if start != end:
            break
        end = stop
    if end != data:
        raise IFNetWeightsError(f"IFNet weights file {name!r}: its tensors' byte ranges do not fill its "
                                f"{data:,} bytes of data (they reach {end:,}): a truncated or damaged file")
    return entries


def load_torch_state(path: Path, *, name: str | None = None, mmap: bool = False) -> dict[str, Any]:
    """A torch file's state dict (key -> tensor, on the CPU) through ``torch.load(weights_only=True)``,
    or IFNetWeightsError: a pickle that would build anything else, a damaged file, an object that
    is not a dict of tensors. ``mmap``: map a zip-format file's tensors rather than read them (the
    check reads only their shapes). Imports torch, unlike the rest of this module."""
    import pickle

    import torch

    name = name or str(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and _is_zip(path))
    except pickle.UnpicklingError as e:
        raise IFNetWeightsError(f"IFNet weights file {name!r} is not a plain state dict: torch.load(weights_only=True) "
                                f"refused it ({_first_reason(e)}); allowed: a dict of tensors saved with "
                                f"torch.save, or a .safetensors file") from e
    except Exception as e:  # torch's own errors for a damaged archive: RuntimeError, EOFError, zip errors
        raise IFNetWeightsError(f"IFNet weights file {name!r} cannot be read as a torch file "
                                f"({type(e).__name__}: {_first_reason(e)})") from e
    if not isinstance(obj, dict):
        raise IFNetWeightsError(f"IFNet weights file {name!r} holds a {type(obj).__name__}, not a state dict (a dict "
                                f"of tensors)")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        first = bad[0]
        raise IFNetWeightsError(f"IFNet weights file {name!r} is not a state dict: entry {first!r} holds a "
                                f"{type(obj[first]).__name__}, not a tensor ({len(bad)} such entries)")
    return obj


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _first_reason(e: BaseException) -> str:
    """The line of a torch error that says what was wrong (its messages run to paragraphs of advice)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    said = next((line for line in lines if "Unsupported global" in line or "Unsupported operand" in line),
                lines[0] if lines else "no reason given")
    return said[:300]


def torch_entries(state: Mapping[str, Any]) -> dict[str, TensorEntry]:
    return {k: TensorEntry(str(v.dtype).removeprefix("torch."), tuple(v.shape), v.is_floating_point())
            for k, v in state.items()}


def plan_ifnet_file(path: Path, *, name: str | None = None) -> IFNetPlan:
    """`weights_format`, the file's tensors (a safetensors header alone; a torch file mapped, not
    read), then `plan_ifnet`."""
    name = name or str(path)
    if weights_format(path, name=name) == SAFETENSORS:
        entries = safetensors_entries(path, name=name)
    else:
        entries = torch_entries(load_torch_state(path, name=name, mmap=True))
    return plan_ifnet(entries, name=name)


def check_ifnet_weights(path: Path) -> str | None:
    """None if ``path`` loads as IFNet weights, else why not (naming the file), without building the
    model: a safetensors file from its header alone, torch-free; a torch file through
    ``torch.load(weights_only=True)`` with its tensors mapped (that imports torch)."""
    try:
        plan_ifnet_file(Path(path))
    except IFNetWeightsError as e:
        return str(e)
    return None
