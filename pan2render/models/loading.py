"""Loading a model folder in the diffusers layout: ``config.json`` + safetensors, sharded or not.

A model folder, or checkpoint (e.g. any Wan2.2-TI2V-5B-Diffusers download) looks like::

    model_index.json
    transformer/config.json + diffusion_pytorch_model[-0000i-of-0000n].safetensors (+ .index.json)
    vae/config.json + diffusion_pytorch_model.safetensors
    text_encoder/  tokenizer/  scheduler/scheduler_config.json

Only safetensors are read: loading never unpickles anything. Every error names the file and the
problem (missing folder or file, missing/unexpected keys listed, key shape mismatch with expected
and found shapes, unsupported config values, a safetensors header that does not fit its file).

Onto a CUDA device each safetensors file is streamed whole (`stream_safetensors`): its header is
parsed and checked here, its data section is read in large chunks by a few threads through pinned
host buffers into one device byte buffer, and every tensor is a view of (or a cast from) that buffer. A per-tensor
read (``safe_open(device="cuda")``) does one small pageable copy per tensor, and pageable copies
serialise in the driver however many threads issue them. Onto the CPU, safetensors' own memory-mapped
reader is used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from safetensors import safe_open
from torch import nn

# The folder layout (torch-free, shared with batch validation); re-exported for the loaders.
from ..model_files import (  # noqa: F401
    WEIGHTS_NAME,
    ModelFolderError,
    read_json,
    resolve_component,
    safetensors_files,
)

log = logging.getLogger(__name__)

MAX_KEYS_LISTED = 12

# Bytes per read and per host->device copy when streaming a file. At 64 MiB a chunk's read takes
# ~10 ms from the page cache and its pinned copy a few ms, so the per-call costs (a syscall, a copy
# launch, an event) are well under 1%; and the pinned buffers (two per reader, kept by PyTorch's
# pinned-memory cache from one file to the next) stay a few hundred MiB.
STREAM_CHUNK_BYTES = 64 << 20
# Threads reading one file's chunks at once (each with two host buffers: one being read into while
# the other's copy runs). One reader was bound by copying out of the page cache (~5 GB/s measured
# on the GPU host; pinned host->device copies ran at ~50 GB/s there); on that 16-core host 20 GB of
# page-cached shards streamed at 9-15 GB/s with 4 readers and 17-22 GB/s with 8.
STREAM_READERS = 8
# A tensor is left as a view of the file's device buffer only where its address is a multiple of
# this, as a fresh allocation's is: vectorised loads, TMA and cuBLAS's fastest kernels want 16-byte
# aligned operands. Anywhere else it is copied out (a view at an offset that is no multiple of the
# element size cannot be made at all). The released checkpoints' tensors all start at multiples.
VIEW_ALIGN_BYTES = 16
# safetensors itself refuses larger headers; a length beyond this is a damaged file, not metadata.
MAX_HEADER_BYTES = 100_000_000

# The safetensors dtype names torch can hold (those of safetensors.torch; the float8 ones where this
# torch has them).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: dtype for name, dtype in {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "C64": torch.complex64,
        "U64": getattr(torch, "uint64", None), "U32": getattr(torch, "uint32", None),
        "U16": getattr(torch, "uint16", None),
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None), "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
    }.items() if dtype is not None
}

M = TypeVar("M", bound=nn.Module)
Cast = Callable[[str, torch.Tensor], torch.Tensor]


def read_state_dict(
    folder: Path, *, prefix: str = WEIGHTS_NAME, device: str | torch.device = "cpu", cast: Cast | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of a component and the file each key came from (for error messages).

    Each tensor is read onto ``device`` and passed through ``cast(key, tensor)`` there (an fp32
    release read for a bf16 model on the GPU is never copied to the host in fp32 and cast there).
    Onto a CUDA device a file is streamed whole (`stream_safetensors`): the device then holds one
    file's bytes beside the tensors cast from them, until the next file; onto the CPU tensors are
    read one at a time from the memory-mapped file. A key found in two files is an error."""
    device = torch.device(device)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for file in safetensors_files(folder, prefix):
        try:
            if device.type == "cuda":
                header = read_safetensors_header(file)
                _check_new_keys(file, header.keys(), origin)
                new = stream_safetensors(file, device, cast=cast, header=header)
            else:
                new = {}
                with safe_open(str(file), framework="pt", device=str(device)) as f:
                    keys = list(f.keys())
                    _check_new_keys(file, keys, origin)
                    for key in keys:
                        t = f.get_tensor(key)
                        new[key] = t if cast is None else cast(key, t)
        except ModelFolderError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated headers etc.
            raise ModelFolderError(f"{file}: cannot read safetensors file ({e})") from e
        tensors.update(new)
        origin.update(dict.fromkeys(new, file))
    return tensors, origin


def _check_new_keys(file: Path, keys: list[str], origin: dict[str, Path]) -> None:
    for key in keys:
        if key in origin:
            raise ModelFolderError(f"{file}: key '{key}' also appears in {origin[key]}")


# ------------------------------------------------------------------------------------------------
# Streaming a safetensors file: header, bytes, tensors

@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header; ``start``/``end``: byte offsets in the data section."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked safetensors header: ``tensors`` in the order of their data, which fills the data
    section (``data_bytes`` bytes from byte ``data_start`` of the file) without gaps or overlaps."""

    file: Path
    data_start: int
    data_bytes: int
    tensors: tuple[TensorInfo, ...]

    def keys(self) -> list[str]:
        return [t.key for t in self.tensors]


def read_safetensors_header(file: str | Path) -> SafetensorsHeader:
    """Parse and check a safetensors file's header (8-byte little-endian length, then JSON).

    Checked, as safetensors checks them: every dtype is known, each tensor's byte length is its
    element count times its element size, and the tensors' byte ranges tile the data section from
    its first byte to the file's last. Any problem raises ModelFolderError naming the file (and the
    tensor's key where one is at fault)."""
    file = Path(file)

    def bad(problem: str) -> ModelFolderError:
        return ModelFolderError(f"{file}: cannot read safetensors file: {problem}")

    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, too short for the 8-byte header length")
            (header_bytes,) = struct.unpack("<Q", head)
            if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > size:
                raise bad(f"a header length of {header_bytes} bytes does not fit in the file ({size} bytes)")
            raw = f.read(header_bytes)
    except OSError as e:
        raise ModelFolderError(f"{file}: cannot read safetensors file ({e})") from e
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_pairs)
    except ValueError as e:  # bad UTF-8, bad JSON, a key listed twice
        raise bad(f"the header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + header_bytes
    data_bytes = size - data_start
    tensors = sorted((_tensor_info(key, entry, data_bytes, bad) for key, entry in header.items()
                      if key != "__metadata__"), key=lambda t: (t.start, t.end))
    end, previous = 0, None
    for t in tensors:
        if t.start != end:
            where = f"the end of tensor '{previous}'" if previous else "the start of the data"
            raise bad(f"tensor '{t.key}' starts at data byte {t.start}, not at {where} (byte {end}): "
                      f"overlapping or gapped offsets")
        end, previous = t.end, t.key
    if end != data_bytes:
        where = f"tensor '{previous}'" if previous else "the header"
        raise bad(f"{data_bytes - end} bytes of data after {where}, which the header does not list")
    return SafetensorsHeader(file, data_start, data_bytes, tuple(tensors))


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key '{key}' is listed twice")
        out[key] = value
    return out


def _tensor_info(key: str, entry: Any, data_bytes: int, bad: Callable[[str], ModelFolderError]) -> TensorInfo:
    if not isinstance(entry, dict):
        raise bad(f"tensor '{key}': expected an object with dtype, shape and data_offsets, found {entry!r}")
    name = entry.get("dtype")
    dtype = SAFETENSORS_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise bad(f"tensor '{key}': dtype {name!r} is not one of {', '.join(SAFETENSORS_DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"tensor '{key}': shape {shape!r} is not a list of sizes")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"tensor '{key}': data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    start, end = offsets
    need = math.prod(shape) * dtype.itemsize
    if end - start != need:
        raise bad(f"tensor '{key}': data_offsets [{start}, {end}] hold {end - start} bytes, its shape {shape} "
                  f"of {name} takes {need}")
    if end > data_bytes:
        raise bad(f"tensor '{key}': data_offsets [{start}, {end}] run past the end of the file's data "
                  f"({data_bytes} bytes): the file is truncated or its header is wrong")
    return TensorInfo(key, dtype, tuple(shape), start, end)


def stream_file_bytes(file: str | Path, start: int, nbytes: int, device: str | torch.device, *,
                      chunk_bytes: int = STREAM_CHUNK_BYTES, readers: int = STREAM_READERS) -> torch.Tensor:
    """Bytes ``[start, start + nbytes)`` of ``file`` as one ``torch.uint8`` tensor on ``device``.

    ``readers`` threads read the range's chunks of ``chunk_bytes`` (``os.preadv`` at each chunk's
    offset, in no fixed order) into host buffers, two per reader; this thread copies each filled
    buffer into its chunk's slice of the result and hands the buffer back. On CUDA the host buffers
    are pinned, the copies are asynchronous on the current stream, and each copy records an event
    that a reader waits on before it reads into that buffer again. Several readers because one
    thread copying from the page cache reached ~5 GB/s on the GPU host while the pinned copies run
    at ~50 GB/s. On the CPU (tests) the same loop runs with plain buffers and synchronous copies."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    if on_cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if nbytes == 0:
        return out
    chunk = max(1, min(chunk_bytes, nbytes))
    chunks = math.ceil(nbytes / chunk)
    readers = max(1, min(readers, chunks))
    hosts = [torch.empty(chunk, dtype=torch.uint8, pin_memory=on_cuda) for _ in range(min(2 * readers, chunks))]
    views = [memoryview(h.numpy()) for h in hosts]
    events = [torch.cuda.Event() if on_cuda else None for _ in hosts]
    free: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # buffers a reader may fill
    filled: queue.SimpleQueue[tuple[int, int, int] | BaseException] = queue.SimpleQueue()  # (buffer, chunk, bytes)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()  # chunk numbers not yet claimed by a reader
    for i in range(len(hosts)):
        free.put(i)
    for c in range(chunks):
        todo.put(c)
    stop = threading.Event()

    def read(fd: int) -> None:
        try:
            if on_cuda:
                torch.cuda.set_device(device)  # the events belong to this device
            while not stop.is_set():
                try:
                    c = todo.get_nowait()
                except queue.Empty:
                    return
                i = free.get()
                if i is None or stop.is_set():
                    return
                if events[i] is not None:
                    events[i].synchronize()  # its last copy has left the buffer
                n = min(chunk, nbytes - c * chunk)
                _pread_exactly(fd, views[i][:n], file, start + c * chunk)
                filled.put((i, c, n))
        except BaseException as e:  # noqa: BLE001 - handed to the copying thread, which raises it
            filled.put(e)

    fd = os.open(file, os.O_RDONLY)
    with contextlib.suppress(AttributeError, OSError):  # a hint only: not every OS or filesystem takes it
        os.posix_fadvise(fd, start, nbytes, os.POSIX_FADV_WILLNEED)  # a file not in the page cache: read ahead
    threads = [threading.Thread(target=read, args=(fd,), name=f"read {Path(file).name} {k}", daemon=True)
               for k in range(readers)]
    for t in threads:
        t.start()
    try:
        with torch.cuda.device(device) if on_cuda else contextlib.nullcontext():
            stream = torch.cuda.current_stream(device) if on_cuda else None
            for _ in range(chunks):
                item = filled.get()
                if isinstance(item, BaseException):
                    raise item
                i, c, n = item
                out[c * chunk:c * chunk + n].copy_(hosts[i][:n], non_blocking=on_cuda)
                if events[i] is not None:
                    events[i].record(stream)
                free.put(i)
    finally:
        stop.set()
        for _ in threads:
            free.put(None)  # wakes readers still waiting for a buffer after an error here
        for t in threads:
            t.join()
        os.close(fd)
    return out


def _pread_exactly(fd: int, view: memoryview, file: str | Path, at: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], at + got)
        if not n:
            raise ModelFolderError(f"{file}: cannot read safetensors file: it ends at byte {at + got}, before the "
                                   f"data its header lists (was it cut short while being read?)")
        got += n


def stream_safetensors(file: str | Path, device: str | torch.device, *, cast: Cast | None = None,
                       header: SafetensorsHeader | None = None, chunk_bytes: int = STREAM_CHUNK_BYTES,
                       readers: int = STREAM_READERS) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file on ``device``, each passed through ``cast(key, t)``.

    The file's data section is read into one byte buffer on ``device`` (`stream_file_bytes`) and
    each tensor starts as a view of its byte range, or as a copy where that range does not start at
    a multiple of ``VIEW_ALIGN_BYTES``. Memory: when every tensor keeps its dtype the results stay
    views of the buffer, which then holds nothing unused (but the bytes of copied ones); when
    ``cast`` made new tensors of some, the ones still viewing the buffer are cloned, so the buffer
    (the whole file, most of it no longer needed) is freed once the caller drops it rather than kept
    alive by them."""
    file = Path(file)
    header = header or read_safetensors_header(file)
    data = stream_file_bytes(file, header.data_start, header.data_bytes, device,
                             chunk_bytes=chunk_bytes, readers=readers)
    base = data.untyped_storage().data_ptr()
    out: dict[str, torch.Tensor] = {}
    views: list[str] = []  # keys whose tensor still views `data`
    cast_away = False  # `cast` made a new tensor of some: the file's bytes are not all needed
    for info in header.tensors:
        raw = data[info.start:info.end]
        aligned = info.start % VIEW_ALIGN_BYTES == 0  # the buffer itself starts at an allocation's alignment
        t = (raw if aligned else raw.clone()).view(info.dtype).view(info.shape)
        if cast is not None:
            read, t = t, cast(info.key, t)
            if info.end > info.start and t.untyped_storage().data_ptr() != read.untyped_storage().data_ptr():
                cast_away = True
        if t.untyped_storage().data_ptr() == base:
            views.append(info.key)
        out[info.key] = t
    if cast_away:
        for key in views:
            out[key] = out[key].clone()
    return out


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:MAX_KEYS_LISTED])
    more = f" ... and {len(keys) - MAX_KEYS_LISTED} more" if len(keys) > MAX_KEYS_LISTED else ""
    return shown + more


def check_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, where: Path,
                     origin: dict[str, Path] | None = None) -> None:
    """Raise ModelFolderError listing missing / unexpected keys and shape mismatches."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s): {_listed(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s): {_listed(unexpected)}")
    for key in sorted(set(expected) & set(state_dict)):
        want, got = tuple(expected[key].shape), tuple(state_dict[key].shape)
        if want != got:
            src = origin.get(key, where) if origin else where
            problems.append(f"shape mismatch for '{key}' in {src}: expected {list(want)}, found {list(got)}")
    if problems:
        raise ModelFolderError(f"{where}: weights do not fit the model config:\n  " + "\n  ".join(problems))


def instantiate(
    build: Callable[[], M],
    folder: Path,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    keep_in_fp32: tuple[str, ...] = (),
    prefix: str = WEIGHTS_NAME,
) -> M:
    """Build a model without random init and load a component's safetensors (``prefix.safetensors``
    or its shards) into it.

    The module is constructed on the meta device (no memory, no random init: a 5B model builds in
    milliseconds) and the checkpoint tensors are assigned in place of its parameters, read onto
    ``device`` and cast there (no host copy of the weights in another dtype). Floating-point
    tensors whose name has one of ``keep_in_fp32`` as a component stay fp32 (as diffusers' and
    transformers' ``_keep_in_fp32_modules``); the others are cast to ``dtype``.

    Weights the model ties (one tensor under several names, as built) may be held under any of
    their names: one name fills them all; several with equal values are tied as one; several with
    different values are kept apart, with a warning (as transformers does).

    Our models keep no buffers outside the checkpoint (RoPE tables are computed per call), which is
    checked here: a module that grew one would be left on the meta device. A missing or unexpected
    key, or a shape that does not fit, is a ModelFolderError naming the folder.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = build()
    keep = set(keep_in_fp32)

    def cast(key: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        return t.to(torch.float32 if keep.intersection(key.split(".")) else dtype)

    state_dict, origin = read_state_dict(folder, prefix=prefix, device=device, cast=cast)
    tied = _tie(model, state_dict, folder)
    check_state_dict(model, state_dict, where=folder, origin=origin)
    model.load_state_dict(state_dict, strict=True, assign=True)
    for names in tied:  # assign=True gave each name its own Parameter: one again, as built
        owner, _, attr = names[0].rpartition(".")
        shared = getattr(model.get_submodule(owner), attr)
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)
    stale = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if stale:
        raise ModelFolderError(f"{folder}: the model has tensors its checkpoint does not fill "
                               f"(non-persistent buffers?): {', '.join(stale)}")
    return model.eval().requires_grad_(False)


def _tie(model: nn.Module, state_dict: dict[str, torch.Tensor], folder: Path) -> list[list[str]]:
    """Fill every name of a tied weight from the ones ``state_dict`` holds, where they agree;
    return the name groups filled so (missing ones are left for `check_state_dict` to report)."""
    by_tensor: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(t), []).append(name)
    tied = []
    for names in (n for n in by_tensor.values() if len(n) > 1):
        present = [n for n in names if n in state_dict]
        if not present:
            continue
        first = state_dict[present[0]]
        if all(torch.equal(state_dict[n], first) for n in present[1:]):
            state_dict.update(dict.fromkeys(names, first))
            tied.append(names)
        else:
            log.warning("%s: tied weights %s hold different values in the checkpoint; kept apart",
                        folder, ", ".join(present))
    return tied
