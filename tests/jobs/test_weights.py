"""The weights' digest behind a checkpoint's job ids: every byte counts, and an unchanged folder
is not hashed again (cached by file identity in the pan2-render cache)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pan2render.jobs import load_batch, weights
from pan2render.jobs.weights import folder_fingerprint

SHARD = "transformer/diffusion_pytorch_model-00001-of-00002.safetensors"


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAN2_RENDER_CACHE", str(cache))
    return cache


def _checkpoint(root: Path, *, size: int = 8 << 20) -> Path:
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    (root / SHARD).write_bytes(bytes(range(256)) * (size // 256))
    return root


def _batch(tmp_path: Path, ckpt: Path) -> Path:
    path = tmp_path / "b.yaml"
    path.write_text(f"model: {ckpt}\npreset: tiny-preview\njobs: [a fox]\n")
    return path


def _flip(path: Path, offset: int) -> None:
    """One byte changed in place, the file's size kept (a fine-tune touching a few tensors)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("where", [0.3, 0.77])
def test_a_byte_changed_anywhere_in_a_shard_makes_new_job_ids(tmp_path: Path, where: float) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    batch = _batch(tmp_path, ckpt)
    (before,) = load_batch(batch).jobs
    shard = ckpt / SHARD
    _flip(shard, int(shard.stat().st_size * where))
    (after,) = load_batch(batch).jobs
    print(before.job_id, after.job_id)
    assert after.weights != before.weights and after.job_id != before.job_id
    _flip(shard, int(shard.stat().st_size * where))  # negative control: the same bytes again, the same id
    assert load_batch(batch).jobs[0].job_id == before.job_id


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files count as last changed long before they are hashed, as a download's are: their ctime,
    unlike their mtime, cannot be set back, so the racy window is closed instead."""
    monkeypatch.setattr(weights, "RACY_S", 0.0)


def test_an_unchanged_folder_is_not_hashed_again_and_a_rewritten_file_is(tmp_path: Path, own_cache: Path,
                                                                         settled: None) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    for path in (ckpt / "model_index.json", ckpt / SHARD):  # written a while ago, as a download is
        os.utime(path, (1.7e9, 1.7e9))
    said: list[str] = []
    digest, files = folder_fingerprint(ckpt, say=said.append)
    print(said)
    assert len(said) == 1 and str(ckpt) in said[0] and "8.0 MiB" in said[0] and "2 file(s)" in said[0]
    assert set(files) == {"model_index.json", SHARD}
    assert list(own_cache.glob("weights*"))  # kept for other processes (the next run)

    again: list[str] = []
    assert folder_fingerprint(ckpt, say=again.append)[0] == digest and again == []
    os.utime(ckpt / SHARD, (1.8e9, 1.8e9))  # rewritten (the same bytes): another mtime
    third: list[str] = []
    assert folder_fingerprint(ckpt, say=third.append)[0] == digest
    assert len(third) == 1 and "1 file(s)" in third[0] and "8.0 MiB" in third[0]


def test_a_file_changed_within_the_clocks_tick_of_its_hash_is_hashed_again(tmp_path: Path) -> None:
    """A write in the same filesystem timestamp tick as the hash keeps size and mtime: a digest of
    a file modified that recently is never kept, so the next look hashes it again."""
    ckpt = _checkpoint(tmp_path / "ckpt")
    first = folder_fingerprint(ckpt)[0]
    stamp = (ckpt / SHARD).stat()
    _flip(ckpt / SHARD, 12345)
    os.utime(ckpt / SHARD, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # the same mtime as when hashed
    assert folder_fingerprint(ckpt)[0] != first


def test_a_file_edited_in_place_with_its_mtime_put_back_is_hashed_again(tmp_path: Path, settled: None) -> None:
    """Same inode, same size, the old mtime restored (os.utime, touch -d, rsync -t): only the
    ctime, which no call can set back, tells the file changed."""
    ckpt = _checkpoint(tmp_path / "ckpt")
    shard = ckpt / SHARD
    os.utime(shard, (1.7e9, 1.7e9))
    first = folder_fingerprint(ckpt)[0]
    said: list[str] = []
    assert folder_fingerprint(ckpt, say=said.append)[0] == first and said == []  # kept: not hashed again
    time.sleep(0.05)  # past a tick of the filesystem's clock
    _flip(shard, 12345)
    os.utime(shard, (1.7e9, 1.7e9))
    assert folder_fingerprint(ckpt)[0] != first
    _flip(shard, 12345)  # negative control: the old bytes again, the old digest
    os.utime(shard, (1.7e9, 1.7e9))
    assert folder_fingerprint(ckpt)[0] == first


def test_a_cache_entry_written_without_ctime_is_a_miss(tmp_path: Path, own_cache: Path) -> None:
    """A cache file of the earlier key (dev:inode:size:mtime_ns) is still read; its entries match no
    file, so a stale digest in one is never used. A fresh process, reading the cache file alone."""
    ckpt = _checkpoint(tmp_path / "ckpt")
    shard = ckpt / SHARD
    st = shard.stat()
    stale = {f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}": "0" * 64}
    own_cache.mkdir()
    (own_cache / weights.CACHE_NAME).write_text(json.dumps({"format": 1, "files": stale}))
    code = ("import sys; from pathlib import Path; from pan2render.jobs.weights import folder_fingerprint; "
            f"print(folder_fingerprint(Path(sys.argv[1]))[1][{SHARD!r}].sha256)")
    out = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout.strip()
    assert out == hashlib.sha256(shard.read_bytes()).hexdigest()
