"""Artifacts checked once: a proof holds while the file's stat is unchanged, for the claim it was
made for; any change to the file (same size included) or another claim checks it again; and the
scheduler's loop reads each embedding and latents file once per job flow, not at every call."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pan2render.jobs.ledger import Ledger
from pan2render.runner.cluster.sim_model import TEXT_ENCODER_ID, embedding_bytes, latents_bytes
from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.artifacts import Proven, Recorded
from tests.runner.views.test_report import job, render


def test_a_proof_holds_while_the_file_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = artifacts.embedding_key(prompt="a fox", text_encoder_id=TEXT_ENCODER_ID)
    rel = artifacts.embedding_relpath(key)
    artifacts.write_artifact(tmp_path, rel, embedding_bytes("a fox"))
    proven = Proven()
    reads: Counter[str] = Counter()
    check = artifacts._check_embedding
    monkeypatch.setattr(artifacts, "_check_embedding", lambda *a: reads.update(["read"]) or check(*a))

    assert artifacts.check_embedding(tmp_path, rel, key=key, proven=proven) is None
    assert artifacts.check_embedding(tmp_path, rel, key=key, proven=proven) is None
    assert reads["read"] == 1 and len(proven) == 1
    # Another claim on the same file is checked (and refused) on its own.
    assert "another prompt" in (artifacts.check_embedding(tmp_path, rel, key="other", proven=proven) or "")
    assert reads["read"] == 2

    # The same size, one value changed, the old mtime put back: the ctime and the inode still
    # tell, so the file is read again and the damage found.
    path = tmp_path / rel
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-4:] = np.float32(1.5).tobytes()
    tmp = path.with_name("replacement")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
    assert "sha256" in (artifacts.check_embedding(tmp_path, rel, key=key, proven=proven) or "")
    assert reads["read"] == 3
    # A refused file is never taken as proven: read each time until it checks out.
    assert artifacts.check_embedding(tmp_path, rel, key=key, proven=proven) is not None
    assert reads["read"] == 4

    # Gone: no proof survives the file.
    path.unlink()
    assert "missing" in (artifacts.check_embedding(tmp_path, rel, key=key, proven=proven) or "")


def test_latents_proofs_name_the_spec_and_the_recorded_bytes(tmp_path: Path) -> None:
    spec = job("a", seed=0)
    rel = artifacts.latents_relpath(spec.job_id)
    data = latents_bytes(spec, model_id="sim")
    artifacts.write_artifact(tmp_path, rel, data)
    rec = Recorded(rel, artifacts.sha256_bytes(data), len(data))
    proven = Proven()
    assert artifacts.check_latents(tmp_path, rec, spec=spec, proven=proven) is None
    assert proven.holds(tmp_path / rel, f"latents {rec.sha256} {rec.size} {spec.spec_hash} False")
    # Another job's spec, or another recorded sha256, is not what was proven.
    other = job("a", seed=1)
    assert "rendered for spec" in (artifacts.check_latents(tmp_path, rec, spec=other, proven=proven) or "")
    wrong = Recorded(rel, "0" * 64, len(data))
    assert "sha256 differs" in (artifacts.check_latents(tmp_path, wrong, spec=spec, proven=proven) or "")


def test_the_loop_reads_each_embedding_and_latents_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the driver (the fake pipeline, 3 jobs of 2 prompts each): before, every call of a
    job re-read and re-hashed its embeddings (3 checks of each), and the video was read back."""
    reads: Counter[str] = Counter()
    emb, lat, rec = artifacts._check_embedding, artifacts._check_latents, artifacts.check_recorded
    monkeypatch.setattr(artifacts, "_check_embedding",  # (a file not there yet costs a stat: not counted)
                        lambda path, *a: reads.update([str(path)] if path.exists() else []) or emb(path, *a))
    monkeypatch.setattr(artifacts, "_check_latents",
                        lambda out, r, **kw: reads.update(["latents " + str(r.relpath)]) or lat(out, r, **kw))
    monkeypatch.setattr(artifacts, "check_recorded",
                        lambda out, r: reads.update(["hashed " + str(r.relpath)]) or rec(out, r))
    jobs = [job("a", seed=s) for s in range(3)]
    render(tmp_path, jobs)
    ledger = Ledger.open_readonly(tmp_path)
    assert {j.state.value for j in ledger.jobs()} == {"done"}
    ledger.close()
    embeddings = {k: n for k, n in reads.items() if "embeddings" in k}
    print(dict(reads))
    # Two texts (the prompt, the empty negative) shared by the three jobs: each read once.
    assert len(embeddings) == 2 and all(n == 1 for n in embeddings.values())
    assert sorted(k for k in reads if k.startswith("latents")) == sorted(
        f"latents {artifacts.latents_relpath(j.job_id)}" for j in jobs)
    assert all(reads[f"latents {artifacts.latents_relpath(j.job_id)}"] == 1 for j in jobs)
    assert not [k for k in reads if k.startswith("hashed") and k.endswith("video.mp4")]
