"""The streamed safetensors reader (what a CUDA load uses), run on the CPU with tiny chunks.

Files are written by hand here (safetensors' own writer orders tensors by element size, which keeps
every tensor aligned) so that some tensors start at offsets that are no multiple of their element
size, and chunks of a few bytes put chunk boundaries inside tensors.
"""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pan2render.models import loading
from pan2render.models.loading import ModelFolderError, read_safetensors_header, read_state_dict, stream_safetensors

NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], *,
                      edit=None) -> dict[str, dict]:
    """Write ``tensors`` in this order, with no padding between them; ``edit(header)`` may change
    the header before it is written. Returns the header."""
    header: dict[str, dict] = {}
    blobs = []
    offset = 0
    for key, t in tensors:
        blob = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[key] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if edit is not None:
        edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return header


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    """fp32, bf16, fp16 and int64 with odd element counts: after the first, most start misaligned.
    Byte sizes 10, 28, 24, 18, 0, 4, 12: none a multiple of the 11-byte chunks used below."""
    gen = torch.Generator().manual_seed(0)
    return [
        ("embed.bf16", torch.randn(5, generator=gen).to(torch.bfloat16)),  # 10 bytes: what follows is off by 2
        ("block.0.weight", torch.randn(7, generator=gen)),  # fp32 at byte 10
        ("block.0.index", torch.arange(-1, 2, dtype=torch.int64) * 123456789012),  # int64 at byte 38
        ("block.0.half", torch.randn(3, 3, generator=gen).to(torch.float16)),  # fp16 at byte 62
        ("empty", torch.zeros(0, 3)),  # no bytes, at byte 80
        ("scale", torch.tensor(2.5)),  # 0-dim fp32 at byte 80
        ("block.1.bias", torch.randn(3, generator=gen)),  # fp32 at byte 84
    ]


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        g = got[key]
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), key
        assert torch.equal(g, w), key


@pytest.fixture
def mixed_file(tmp_path: Path) -> Path:
    path = tmp_path / "mixed.safetensors"
    write_safetensors(path, mixed_tensors())
    return path


def test_the_mixed_file_has_misaligned_tensors(mixed_file: Path) -> None:
    infos = read_safetensors_header(mixed_file).tensors
    misaligned = [t.key for t in infos if t.start % t.dtype.itemsize]
    assert misaligned == ["block.0.weight", "block.0.index"]
    assert [t.end - t.start for t in infos] == [10, 28, 24, 18, 0, 4, 12]


@pytest.mark.parametrize("chunk_bytes, readers", [(11, 1), (11, 2), (11, 4), (1, 3), (64, 2), (1 << 20, 4)])
def test_streamed_file_equals_safetensors(mixed_file: Path, chunk_bytes: int, readers: int) -> None:
    got = stream_safetensors(mixed_file, "cpu", chunk_bytes=chunk_bytes, readers=readers)
    assert_same(got, load_file(str(mixed_file)))


def test_file_written_by_safetensors_streams_too(tmp_path: Path) -> None:
    path = tmp_path / "st.safetensors"
    gen = torch.Generator().manual_seed(1)
    save_file({"w": torch.randn(33, 5, generator=gen), "b": torch.randn(3, generator=gen).to(torch.bfloat16),
               "i": torch.arange(5)}, str(path), metadata={"format": "pt"})
    assert_same(stream_safetensors(path, "cpu", chunk_bytes=13), load_file(str(path)))


def _capture_buffers(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The device byte buffers stream_safetensors reads files into."""
    seen: list[torch.Tensor] = []
    real = loading.stream_file_bytes

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(loading, "stream_file_bytes", spy)
    return seen


def test_uncast_tensors_stay_views_of_the_file_buffer(mixed_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    buffers = _capture_buffers(monkeypatch)
    got = stream_safetensors(mixed_file, "cpu", chunk_bytes=11)
    (buf,) = buffers
    shares = {key: t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for key, t in got.items()}
    # Nothing was cast away, so the views waste nothing. The tensors that do not start at a multiple
    # of 16 bytes are copied: block.0.weight and block.0.index could not be viewed at all (their
    # offsets are no multiple of their element size), block.0.half and block.1.bias would be views
    # at addresses a fresh tensor never has.
    assert shares == {"embed.bf16": True, "block.0.weight": False, "block.0.index": False, "block.0.half": False,
                      "empty": True, "scale": True, "block.1.bias": False}
    assert all(t.data_ptr() % 16 == 0 for t in got.values() if t.numel())
    # A cast of a tensor of no bytes leaves no unused bytes in the buffer: the views stay.
    got = stream_safetensors(mixed_file, "cpu", cast=lambda k, t: t.half() if k == "empty" else t)
    assert got["empty"].dtype == torch.float16
    assert got["scale"].untyped_storage().data_ptr() == buffers[-1].untyped_storage().data_ptr()


def test_a_cast_file_leaves_nothing_viewing_its_buffer(mixed_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    buffers = _capture_buffers(monkeypatch)

    def cast(key: str, t: torch.Tensor) -> torch.Tensor:  # as a bf16 load: fp32 -> bf16 except "scale"
        return t.to(torch.bfloat16) if t.dtype == torch.float32 and key != "scale" else t

    got = stream_safetensors(mixed_file, "cpu", cast=cast, chunk_bytes=11)
    (buf,) = buffers
    want = {k: cast(k, v) for k, v in load_file(str(mixed_file)).items()}
    assert_same(got, want)
    assert got["scale"].dtype == torch.float32 and got["embed.bf16"].dtype == torch.bfloat16  # kept dtypes
    buf_ptr = buf.untyped_storage().data_ptr()
    assert [k for k, t in got.items() if t.numel() and t.untyped_storage().data_ptr() == buf_ptr] == []


def test_truncated_file_names_file_and_tensor(mixed_file: Path) -> None:
    mixed_file.write_bytes(mixed_file.read_bytes()[:-5])
    with pytest.raises(ModelFolderError) as err:
        stream_safetensors(mixed_file, "cpu", chunk_bytes=11)
    msg = str(err.value)
    assert str(mixed_file) in msg and "'block.1.bias'" in msg and "run past the end" in msg


def test_file_cut_inside_its_header(mixed_file: Path) -> None:
    mixed_file.write_bytes(mixed_file.read_bytes()[:40])
    with pytest.raises(ModelFolderError, match=r"mixed\.safetensors: .*header length of \d+ bytes does not fit"):
        read_safetensors_header(mixed_file)


def test_header_pointing_past_the_end(tmp_path: Path) -> None:
    path = tmp_path / "past.safetensors"

    def shift(header: dict) -> None:  # the right length, but 8 bytes further than the data goes
        header["block.0.half"]["data_offsets"] = [o + 8 for o in header["block.0.half"]["data_offsets"]]

    write_safetensors(path, mixed_tensors()[:4], edit=shift)
    with pytest.raises(ModelFolderError) as err:
        stream_safetensors(path, "cpu")
    assert str(path) in str(err.value) and "'block.0.half'" in str(err.value) and "run past the end" in str(err.value)


W = "'block.0.weight'"


@pytest.mark.parametrize("edit, message", [
    (lambda h: h["block.0.weight"].update(dtype="F7"), rf"{W}: dtype 'F7' is not one of"),
    (lambda h: h["block.0.weight"].update(shape=[8]),
     rf"{W}: data_offsets \[10, 38\] hold 28 bytes, its shape \[8\] of F32 takes 32"),
    (lambda h: h["block.0.weight"].update(shape=[7, -1]), rf"{W}: shape \[7, -1\] is not a list of sizes"),
    (lambda h: h["block.0.weight"].update(data_offsets=[38, 10]), rf"{W}: data_offsets \[38, 10\] are not"),
    (lambda h: h["block.0.index"].update(data_offsets=[36, 60]),
     rf"'block.0.index' starts at data byte 36, not at the end of tensor {W} \(byte 38\)"),
    (lambda h: h.pop("embed.bf16"), rf"{W} starts at data byte 10, not at the start of the data \(byte 0\)"),
    (lambda h: h.pop("block.0.half"), r"18 bytes of data after tensor 'block.0.index'"),
])
def test_header_problems_name_file_and_tensor(tmp_path: Path, edit, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, mixed_tensors()[:4], edit=edit)
    with pytest.raises(ModelFolderError, match=rf"bad\.safetensors: cannot read safetensors file: .*{message}"):
        read_safetensors_header(path)


def test_a_key_twice_in_one_header(tmp_path: Path) -> None:
    path = tmp_path / "twice.safetensors"
    write_safetensors(path, [("a", torch.zeros(2))])
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    entry = json.dumps({"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})
    raw = ('{"a": ' + entry + ', "a": ' + entry + "}").encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    with pytest.raises(ModelFolderError, match=r"twice\.safetensors: .*key 'a' is listed twice"):
        read_safetensors_header(path)


def test_a_read_error_on_the_reader_thread_reaches_the_caller(mixed_file: Path) -> None:
    header = read_safetensors_header(mixed_file)
    mixed_file.write_bytes(mixed_file.read_bytes()[:-30])  # shrinks after its header was read
    threads = threading.active_count()
    with pytest.raises(ModelFolderError, match=r"mixed\.safetensors: .*it ends at byte \d+, before the data"):
        stream_safetensors(mixed_file, "cpu", header=header, chunk_bytes=11, readers=2)
    assert threading.active_count() == threads  # the reader thread has ended


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_bytes", [11, loading.STREAM_CHUNK_BYTES])
def test_streamed_file_on_cuda_equals_safetensors(mixed_file: Path, chunk_bytes: int) -> None:
    got = stream_safetensors(mixed_file, "cuda", chunk_bytes=chunk_bytes)
    assert all(t.device.type == "cuda" for t in got.values())
    assert_same({k: v.cpu() for k, v in got.items()}, load_file(str(mixed_file)))


@pytest.mark.gpu
def test_cuda_state_dict_equals_cpu_state_dict_over_shards(tmp_path: Path) -> None:
    """Several files, each more than one 64 MiB chunk (pinned buffers reused across chunks and
    files), cast as a bf16 load casts; and a key in two files is refused as on the CPU."""
    gen = torch.Generator().manual_seed(2)
    for i in range(3):
        save_file({f"s{i}.w": torch.randn(5000, 4001, generator=gen), f"s{i}.norm": torch.randn(4001, generator=gen)},
                  str(tmp_path / f"diffusion_pytorch_model-0000{i + 1}-of-00003.safetensors"))
    weight_map = {k: f.name for f in tmp_path.glob("*.safetensors") for k in load_file(str(f))}
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    def cast(key: str, t: torch.Tensor) -> torch.Tensor:
        return t.float() if "norm" in key else t.to(torch.bfloat16)

    cpu, _ = read_state_dict(tmp_path, cast=cast)
    gpu, origin = read_state_dict(tmp_path, device="cuda", cast=cast)
    assert_same({k: v.cpu() for k, v in gpu.items()}, cpu)
    assert origin["s1.w"].name.startswith("diffusion_pytorch_model-00002")
    second = tmp_path / "diffusion_pytorch_model-00002-of-00003.safetensors"
    save_file({**load_file(str(second)), "s0.norm": torch.zeros(1)}, str(second))
    with pytest.raises(ModelFolderError, match=r"00002-of-00003.safetensors: key 's0.norm' also appears in .*00001"):
        read_state_dict(tmp_path, device="cuda", cast=cast)
