"""Faults of the environment and of the artifacts, as a user meets them through the CLI.

Each case asserts what the user sees (exit code, one paragraph, no traceback), that the ledger stays
consistent (no job done without a valid video, no attempt charged for the environment's fault), and
that `resume` finishes once the fault is gone. Jobs run in this process (PAN2_RENDER_EXECUTOR=local,
the fake pipeline), so no case needs Ray; each is bounded by its own timeout.
(Hostile batch files are in tests/jobs/test_hostile_input.py.)
"""

from __future__ import annotations

import errno
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import sqlite_disk_full, write_batch

from pan2render.jobs import disk
from pan2render.jobs.ledger import BACKUP_NAME, LEDGER_NAME, JobState, Ledger, Stage, StageEvent
from pan2render.media.video import encode_mp4, probe_mp4
from pan2render.runner.cli import main as cli
from pan2render.runner.cluster.executor import Call, Group, GroupDied
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.failures import ClusterLostError
from pan2render.runner.protocol.messages import EncodePromptsCall, SampleCall, WorkerCall, WorkerConfig
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver
from pan2render.runner.worker import packing
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

pytestmark = pytest.mark.timeout(60)
N_JOBS = 3


@pytest.fixture(autouse=True)
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")
    monkeypatch.setenv("PAN2_RENDER_PIPELINE", FAKE_FACTORY)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("PAN2_RENDER_FAULTS", raising=False)


def _batch(tmp_path: Path, n: int = N_JOBS) -> Path:
    return write_batch(tmp_path / "b.yaml", [{"name": f"j{i}", "prompt": f"clip {i}"} for i in range(n)],
                       defaults={"steps": 2, "frames": 5, "width": 32, "height": 32})


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main([*args, "--no-progress"] if args[0] in ("run", "resume") else list(args))
    captured = capsys.readouterr()
    err = captured.err + captured.out
    # Past capsys (it would read this back as the next command's output), into pytest's fd capture.
    print(f"$ pan2-render {' '.join(args)} -> {code}\n{err}", file=sys.__stdout__, flush=True)
    assert "Traceback" not in err
    return code, err


def _states(out: Path) -> dict[str, tuple[str, int, int]]:
    led = Ledger.open_readonly(out)
    try:
        return {j.name: (j.state.value, j.attempts, j.retries_left) for j in led.jobs()}
    finally:
        led.close()


def _assert_consistent(out: Path) -> None:
    """Every job the ledger calls done has a video that checks out."""
    led = Ledger.open_readonly(out)
    try:
        for job in led.jobs():
            if job.state is JobState.DONE:
                rec = led.stages(job.id)[Stage.ENCODE]
                assert artifacts.check_video(out, artifacts.Recorded(rec.artifact, rec.sha256, rec.size),
                                          frames=job.spec.frames, width=job.spec.width,
                                          height=job.spec.height) is None, job.id
    finally:
        led.close()


def _video_ids(out: Path) -> dict[str, tuple[int, int]]:
    return {p.parent.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*/video.mp4")}


# ------------------------------------------------------------------------------------------ disk full
@pytest.mark.parametrize("moment", [0, 1, 2, 4, 6])
def test_disk_full_at_an_artifact_write_stops_cleanly_and_resume_finishes(
        tmp_path: Path, moment: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """ENOSPC from the kernel at the `moment`-th artifact write (embeddings, latents, videos)."""
    writes = {"n": 0}
    real = artifacts.write_atomic

    def write_atomic(path: Path, data: bytes) -> None:
        writes["n"] += 1
        if writes["n"] > moment:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(artifacts, "write_atomic", write_atomic)
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", str(_batch(tmp_path)), "--out", str(out))
    assert code == 3 and f"the disk holding {out} is full" in err and "resume" in err
    states = _states(out)
    assert len(states) == N_JOBS  # the batch was recorded before any work
    assert all(retries == 2 for _, _, retries in states.values())  # nobody charged for the disk
    _assert_consistent(out)
    done_before = _video_ids(out)

    monkeypatch.setattr(artifacts, "write_atomic", real)  # space freed
    code, err = _cli(capsys, "resume", str(out))
    assert code == 0 and all(s == "done" for s, _, _ in _states(out).values())
    _assert_consistent(out)
    after = _video_ids(out)
    assert all(after[j] == ident for j, ident in done_before.items())  # finished jobs not redone


def test_free_space_is_checked_before_each_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The pre-write check refuses a write that would not fit: nothing half-written, same outcome."""
    monkeypatch.setattr(disk, "free_bytes", lambda folder: disk.HEADROOM_BYTES)  # a few bytes short
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", str(_batch(tmp_path)), "--out", str(out))
    assert code == 3 and "not enough space in" in err and "MiB needed" in err
    assert "warning:" in err and "GiB is free" in err  # the estimate before starting
    assert not list(out.glob("**/*.tmp*")) and not list(out.glob("*/latents.safetensors"))
    monkeypatch.undo()
    monkeypatch.setenv("PAN2_RENDER_EXECUTOR", "local")
    monkeypatch.setenv("PAN2_RENDER_PIPELINE", FAKE_FACTORY)
    assert _cli(capsys, "resume", str(out))[0] == 0


def test_disk_full_while_recording_the_batch_records_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = Ledger._add_jobs
    added = {"n": 0}

    def add_jobs(self: Ledger, c: sqlite3.Connection, specs: Any, *, retries: int) -> Any:
        real(self, c, list(specs)[:1], retries=retries)  # one job in, then the disk fills
        added["n"] += 1
        raise sqlite_disk_full()

    monkeypatch.setattr(Ledger, "_add_jobs", add_jobs)
    out, batch = tmp_path / "out", _batch(tmp_path)
    code, err = _cli(capsys, "run", str(batch), "--out", str(out))
    assert code == 3 and added["n"] == 1
    assert "is full" in err and "Nothing of the batch was recorded" in err
    code, err = _cli(capsys, "resume", str(out))  # never "all 0 job(s) already done"
    assert code == 2 and "holds no batch" in err and "already done" not in err
    monkeypatch.setattr(Ledger, "_add_jobs", real)
    assert _cli(capsys, "run", str(batch), "--out", str(out))[0] == 0
    assert len(_states(out)) == N_JOBS


# ------------------------------------------------------------------------------------- damaged ledger
def _damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "zero":
        path.write_bytes(b"")
    elif how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(os.urandom(8192))


@pytest.mark.parametrize("how", ["zero", "truncate", "garbage"])
def test_damaged_ledger_gives_one_paragraph_and_never_done(
        tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path)), "--out", str(out))[0] == 0
    _damage(out / LEDGER_NAME, how)
    for command in ("resume", "status"):
        code, err = _cli(capsys, command, str(out))
        assert code in (2, 3) and "already done" not in err and f"pan2-render repair {out}" in err
        assert len(err.strip().splitlines()) <= 2  # the paragraph, and where the details are
    if how != "zero":
        assert list((out / "_logs").glob("error-*.log"))  # the traceback went to the log


def test_read_only_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))[0] == 0
    real = sqlite3.connect
    # A read-only file (the tests may run as root, whom chmod does not stop): SQLite's own ro mode.
    monkeypatch.setattr(sqlite3, "connect", lambda path, **kw: real(f"file:{path}?mode=ro", uri=True, **kw))
    code, err = _cli(capsys, "resume", str(out))
    assert code == 3 and "cannot be written" in err and "write access" in err


# ------------------------------------------------------------------------------------------- repair
@pytest.mark.parametrize("how", ["delete", "zero", "truncate", "garbage"])
@pytest.mark.parametrize("finished", [True, False])
def test_repair_rebuilds_the_ledger_and_resume_redoes_nothing(
        tmp_path: Path, how: str, finished: bool, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    if not finished:  # j1 fails in decode: it keeps valid latents; j2 never runs (no retries)
        monkeypatch.setenv("PAN2_RENDER_FAULTS", '{"fail": {"job": "j1", "stage": "decode"}}')
    code, _ = _cli(capsys, "run", str(_batch(tmp_path)), "--out", str(out), "--retries", "0")
    monkeypatch.delenv("PAN2_RENDER_FAULTS", raising=False)
    before = _states(out)
    videos = _video_ids(out)
    latents = {p.parent.name: p.stat().st_mtime_ns for p in out.glob("*/latents.safetensors")}
    _damage(out / LEDGER_NAME, how)

    code, err = _cli(capsys, "repair", str(out))
    assert code == 0 and "ledger rebuilt" in err
    if how != "delete":
        assert list(out.glob(f"{LEDGER_NAME}.damaged-*"))
    code, err = _cli(capsys, "status", str(out), "--json")
    rebuilt = _states(out)
    assert set(rebuilt) == set(before)
    assert {n for n, (s, _, _) in rebuilt.items() if s == "done"} == {n for n, (s, _, _) in before.items()
                                                                     if s == "done"}
    assert _cli(capsys, "resume", str(out))[0] == 0
    assert all(s == "done" for s, _, _ in _states(out).values())
    assert all(_video_ids(out)[j] == ident for j, ident in videos.items())  # no finished video redone
    for j, mtime in latents.items():  # no valid latents resampled
        assert (out / j / "latents.safetensors").stat().st_mtime_ns == mtime


def test_repair_without_a_backup_rebuilds_from_the_job_folders(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path)), "--out", str(out))[0] == 0
    (out / LEDGER_NAME).unlink()
    (out / BACKUP_NAME).unlink()
    code, err = _cli(capsys, "repair", str(out))
    assert code == 0 and f"{N_JOBS} from the job folders" in err  # specs from the latents' metadata
    assert all(s == "done" for s, _, _ in _states(out).values()) and len(_states(out)) == N_JOBS
    assert _cli(capsys, "repair", str(out))[1].count("healthy") == 1


# --------------------------------------------------------------------------------------- the cluster
class LosesItsGpus(LocalExecutor):
    """The node's GPUs vanish when job `victim` samples (its group dies), and come back after
    `back_after` calls to total_gpus() (None: never)."""

    def __init__(self, *, victim: str, back_after: int | None, **kw: Any):
        super().__init__(**kw)
        self.victim, self.back_after, self.lost, self.asked = victim, back_after, False, 0

    def total_gpus(self) -> int:
        if self.lost:
            self.asked += 1
            if self.back_after is not None and self.asked > self.back_after:
                self.lost = False
        return 0 if self.lost else super().total_gpus()

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        if isinstance(message, SampleCall) and message.spec.name == self.victim and not self.asked:
            self.lost = True
            return Call(group=group, message=message, started=0.0, timeout_s=timeout_s,
                        handle=GroupDied("ActorDiedError: the node running this actor died"))
        return super().call(group, message, timeout_s=timeout_s)


@pytest.mark.parametrize("back", [True, False])
def test_lost_cluster_requeues_without_charging_and_waits_bounded(tmp_path: Path, back: bool) -> None:
    from pan2render.jobs.batch import load_batch

    out = tmp_path / "out"
    out.mkdir()
    specs = load_batch(_batch(tmp_path)).jobs
    led = Ledger.open(out)
    led.add_jobs(specs, retries=2)
    ex = LosesItsGpus(victim="j1", back_after=3 if back else None, gpus=1,
                      config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    driver = Driver(out_dir=out, ledger=led, executor=ex,
                    config=ServingConfig(retries=2, progress=False, poll_s=0.01, cluster_wait_s=0.3))
    ids = [s.job_id for s in specs]
    if back:
        summary = driver.run(ids)
        assert len(summary.done) == N_JOBS
    else:
        with pytest.raises(ClusterLostError) as info:
            driver.run(ids)
        print(info.value)
        assert "did not come back within 0 s" in str(info.value) and "resume" in str(info.value)
        states = {j.name: j.state for j in led.jobs()}
        # j1 was handed to the group behind j0's decode, so j0's encode was still running on the
        # lost node: both go back to pending.
        assert states["j0"] is JobState.PENDING and states["j1"] is JobState.PENDING
    for name in ("j0", "j1"):
        job = next(j for j in led.jobs() if j.name == name)
        assert job.retries_left == 2  # the lost node was not the jobs' fault
    if not back:  # the GPUs are back: resume finishes
        ex2 = LocalExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
        summary = Driver(out_dir=out, ledger=led, executor=ex2,
                         config=ServingConfig(progress=False, poll_s=0.01)).run(ids)
        assert len(summary.done) == N_JOBS
    led.close()


def test_ray_address_in_the_environment_joins_like_address(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("PAN2_RENDER_EXECUTOR")  # the real executor: it must try to JOIN
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    batch, out = _batch(tmp_path, 1), tmp_path / "out"
    code, err = _cli(capsys, "run", str(batch), "--out", str(out))
    assert code == 2 and "could not join the Ray cluster at '127.0.0.1:1'" in err
    code, err = _cli(capsys, "run", str(batch), "--out", str(out), "--cpu-gpus", "1")
    assert code == 2 and "cannot be used with RAY_ADDRESS=127.0.0.1:1" in err


# ------------------------------------------------------------------------------- retries and limits
def test_out_of_memory_is_named_and_not_retried_forever(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PAN2_RENDER_PIPELINE", "pan2render.runner.worker.fake_pipeline:load_oom_pipeline")
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out), "--retries", "5")
    led = Ledger.open_readonly(out)
    (job,) = led.jobs()
    led.close()
    assert code == 1 and job.state is JobState.FAILED and job.attempts == 2  # same OOM twice: stop
    assert "[out-of-memory" in (job.error or "") and "OutOfMemoryError" in (job.error or "")


# ---------------------------------------------------------------------------- artifacts and status
def test_corrupt_cached_embedding_is_not_used(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))[0] == 0
    (emb,) = [p for p in (out / "_cache" / "embeddings").iterdir()
              if artifacts.check_embedding(out, str(p.relative_to(out)), key=p.stem) is None
              and len(p.read_bytes()) > 1000 and p.stem == artifacts.embedding_key(
                  prompt="clip 0", text_encoder_id="fake-text-v1")]
    data = bytearray(emb.read_bytes())
    data[-3] ^= 0x01  # one mantissa bit of the last float: finite, plausible, wrong
    emb.write_bytes(bytes(data))
    calls: list[type[WorkerCall]] = []
    real_call = LocalExecutor.call

    def call(self: LocalExecutor, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        calls.append(type(message))
        return real_call(self, group, message, timeout_s=timeout_s)

    monkeypatch.setattr(LocalExecutor, "call", call)
    batch2 = write_batch(tmp_path / "b2.yaml", [{"name": "again", "prompt": "clip 0", "seed": 9}],
                         defaults={"steps": 2, "frames": 5, "width": 32, "height": 32})
    assert _cli(capsys, "run", str(batch2), "--out", str(out), "--add")[0] == 0
    assert EncodePromptsCall in calls  # re-encoded, not rendered from the corrupt cache
    assert artifacts.check_embedding(out, str(emb.relative_to(out)), key=emb.stem) is None


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_status_flags_a_done_job_whose_video_is_gone(tmp_path: Path, damage: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 2)), "--out", str(out))[0] == 0
    video = next(out.glob("j0-*/video.mp4"))
    if damage == "delete":
        video.unlink()
    else:
        video.write_bytes(video.read_bytes()[:100])
    code, text = _cli(capsys, "status", str(out))
    assert code == 1 and "done!" in text and "1 done job(s) marked ! have a missing or damaged video" in text
    code, text = _cli(capsys, "status", str(out), "--json")
    assert code == 1 and ('is missing' in text or "truncated" in text)


def test_out_that_is_a_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.write_text("not a folder")
    code, err = _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))
    assert code == 2 and "is a file, not a folder" in err and out.read_text() == "not a folder"


def test_a_symlink_planted_at_a_job_folder_is_not_followed(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from pan2render.jobs.batch import load_batch

    batch, out, elsewhere = _batch(tmp_path, 2), tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    victim = load_batch(batch).jobs[0].job_id
    (out / victim).symlink_to(elsewhere)
    code, err = _cli(capsys, "run", str(batch), "--out", str(out))
    assert code == 1 and list(elsewhere.iterdir()) == []
    led = Ledger.open_readonly(out)
    job = led.job(victim)
    led.close()
    assert job.state is JobState.FAILED and "is a symbolic link" in (job.error or "") and job.attempts == 1


# ------------------------------------------------------------------------------ durability rules
def test_a_valid_mp4_with_too_few_frames_never_counts_as_done(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Guards check_video's frame count: a short but valid mp4, recorded with its true sha256 and
    size, must be re-encoded by resume."""
    import numpy as np

    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))[0] == 0
    video = next(out.glob("*/video.mp4"))
    encode_mp4(np.zeros((1, 32, 32, 3), np.uint8), video, fps=8.0, crf=18)  # 1 frame, not 5
    led = Ledger.open(out)
    (job,) = led.jobs()
    data = video.read_bytes()
    led.reset_stages(job.id, Stage.ENCODE, reason="test: the short video recorded as if it were the job's")
    led.set_stage(job.id, Stage.ENCODE, StageEvent.FINISH, artifact=str(video.relative_to(out)),
                  sha256=artifacts.sha256_bytes(data), size=len(data))
    led.close()
    assert _cli(capsys, "resume", str(out))[0] == 0
    assert probe_mp4(video).frames == 5


def test_a_crash_inside_invalidation_leaves_a_state_that_resume_fixes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Guards the order in prepare_jobs: a crash between its two ledger writes (reset the stages,
    invalidate the job) must never leave a job that resume finishes without a valid video."""
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))[0] == 0
    video = next(out.glob("*/video.mp4"))
    video.write_bytes(video.read_bytes()[:200])  # corrupt: resume must invalidate the job
    writes = {"n": 0}
    real_reset, real_transition = Ledger.reset_stages, Ledger.transition

    def crash_on_second(real: Any) -> Any:
        def wrapped(self: Ledger, *a: Any, **kw: Any) -> Any:
            writes["n"] += 1
            if writes["n"] == 2:
                raise KeyboardInterrupt  # the driver dies between the two writes
            return real(self, *a, **kw)
        return wrapped

    monkeypatch.setattr(Ledger, "reset_stages", crash_on_second(real_reset))
    monkeypatch.setattr(Ledger, "transition", crash_on_second(real_transition))
    assert cli.main(["resume", str(out), "--no-progress"]) == 130
    monkeypatch.setattr(Ledger, "reset_stages", real_reset)
    monkeypatch.setattr(Ledger, "transition", real_transition)
    capsys.readouterr()
    assert _cli(capsys, "resume", str(out))[0] == 0
    assert probe_mp4(video).frames == 5  # a video that checks out, not the corrupt one marked done


# ------------------------------------------------------------------------------------ no endless loops
@pytest.mark.timeout(20)
@pytest.mark.parametrize("check", ["check_latents", "check_embedding"])
def test_an_artifact_that_always_fails_its_check_fails_the_job(
        tmp_path: Path, check: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(artifacts, check, lambda *a, **kw: "rejected by the test's check")
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))
    led = Ledger.open_readonly(out)
    (job,) = led.jobs()
    led.close()
    assert code == 1 and job.state is JobState.FAILED
    assert "failed its check 3 times" in (job.error or "") and "rejected by the test's check" in job.error


# ------------------------------------------------------------------------------- weights identity
def _checkpoint(folder: Path, fill: int) -> Path:
    """A checkpoint folder with every file `run` checks before it starts (the fake pipeline reads
    none of them)."""
    for component, weights in (("transformer", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"),
                               ("text_encoder", "model")):
        (folder / component).mkdir(parents=True, exist_ok=True)
        (folder / component / "config.json").write_text("{}")
        (folder / component / f"{weights}.safetensors").write_bytes(b"\0" * 8)
    (folder / "tokenizer").mkdir(exist_ok=True)
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    (folder / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    # 3 MiB of one byte value: a rewrite with another value keeps every size.
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(
        bytes([fill]) * (3 << 20))
    return folder


def test_weights_replaced_in_place_make_new_jobs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt", 1)
    batch = write_batch(tmp_path / "b.yaml", [{"name": "w", "prompt": "weights"}], model=str(ckpt),
                        defaults={"steps": 2, "frames": 5, "width": 32, "height": 32})
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(batch), "--out", str(out))[0] == 0
    (old,) = _video_ids(out)
    _checkpoint(ckpt, 2)  # same path, same sizes, other weights
    code, err = _cli(capsys, "run", str(batch), "--out", str(out))
    videos = _video_ids(out)
    assert code == 0 and len(videos) == 2 and old in videos  # rendered again under a new id
    (new,) = set(videos) - {old}
    assert f"{old} is superseded by {new}: the weights in {ckpt} changed " \
           f"(transformer/diffusion_pytorch_model.safetensors)" in err
    led = Ledger.open_readonly(out)
    assert any(e.label == "superseded" for e in led.events(old))
    led.close()


def test_weights_changed_after_validation_fail_the_job_not_mislabel_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pan2render.jobs.batch import load_batch

    ckpt = _checkpoint(tmp_path / "ckpt", 1)
    batch = write_batch(tmp_path / "b.yaml", [{"name": "w", "prompt": "weights"}], model=str(ckpt),
                        defaults={"steps": 2, "frames": 5, "width": 32, "height": 32})
    (spec,) = load_batch(batch).jobs
    _checkpoint(ckpt, 3)
    out = tmp_path / "out"
    out.mkdir()
    led = Ledger.open(out)
    led.add_jobs([spec], retries=2)
    ex = LocalExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    summary = Driver(out_dir=out, ledger=led, executor=ex, config=ServingConfig(progress=False)).run([spec.job_id])
    job = led.job(spec.job_id)
    led.close()
    assert summary.failed == [spec.job_id] and job.attempts == 1
    assert "weights in" in (job.error or "") and "changed since the batch was validated" in job.error
    assert not (out / spec.job_id / "latents.safetensors").exists()


def test_run_says_when_it_hashes_weights_and_a_rerun_does_not_hash_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PAN2_RENDER_CACHE", str(tmp_path / "cache"))
    ckpt = _checkpoint(tmp_path / "ckpt", 1)
    for path in ckpt.rglob("*"):
        os.utime(path, (1.7e9, 1.7e9))  # written a while ago, as a download is
    # ... its ctime too, which cannot be set back: the window in which a digest is not kept is closed.
    monkeypatch.setattr("pan2render.jobs.weights.RACY_S", 0.0)
    batch = write_batch(tmp_path / "b.yaml", [{"name": "w", "prompt": "weights"}], model=str(ckpt),
                        defaults={"steps": 2, "frames": 5, "width": 32, "height": 32})
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", str(batch), "--out", str(out))
    assert code == 0 and f"computing the weights digest of {ckpt}: " in err
    assert " file(s), 3.0 MiB not hashed before" in err
    code, err = _cli(capsys, "run", str(batch), "--out", str(out))
    assert code == 0 and "computing the weights digest" not in err and "already done" in err


def test_jobs_recorded_with_a_sampled_fingerprint_are_named_superseded_by_the_full_digest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder rendered before the digest covered every byte: its jobs get new ids once, and `run`
    says why (not that the weights changed)."""
    import dataclasses

    from pan2render.jobs.batch import load_batch

    ckpt = _checkpoint(tmp_path / "ckpt", 1)
    batch = write_batch(tmp_path / "b.yaml", [{"name": "w", "prompt": "weights"}], model=str(ckpt),
                        defaults={"steps": 2, "frames": 5, "width": 32, "height": 32})
    (spec,) = load_batch(batch).jobs
    out = tmp_path / "out"
    out.mkdir()
    led = Ledger.open(out)  # what an earlier version recorded: another digest, sampled fingerprints
    old = dataclasses.replace(spec, weights="0123456789abcdef")
    led.record_batch({"path": str(batch), "model": str(ckpt), "preset": "tiny-preview", "weights_files": {
        rel: {"size": fp["size"], "sampled_sha256": "0" * 64} for rel, fp in load_batch(batch).weights_files.items()}},
        [old], retries=2)
    led.close()
    code, err = _cli(capsys, "run", str(batch), "--out", str(out))
    assert code == 0 and f"{old.job_id} is superseded by {spec.job_id}: the weights' digest of {ckpt} now " \
                         "covers every byte" in err and "changed" not in err


# ------------------------------------------------------------------------- links at fixed names
# name -> what the run does with a symlink there: refuse (exit 3, naming it) or go on without
# writing through it (exit 0).
FIXED_NAMES = {".lock": "refuse", "run.log": "refuse", LEDGER_NAME: "refuse", f"{LEDGER_NAME}-journal": "refuse",
               BACKUP_NAME: "go on", "index.html": "go on", "_report": "go on", "_logs": "go on",
               f".{BACKUP_NAME}.tmp-PID": "go on", ".index.html.tmp-PID": "go on"}


@pytest.mark.parametrize("name", sorted(FIXED_NAMES))
def test_a_symlink_at_a_fixed_name_is_never_written_through(tmp_path: Path, name: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    folder = name.startswith("_")
    target = outside / "target"
    if folder:
        target.mkdir()
    else:
        target.write_text("precious\n")
    (out / name.replace("PID", str(os.getpid()))).symlink_to(target)
    if name == "_logs":  # something for the run to log: a ledger that is garbage
        (out / LEDGER_NAME).write_bytes(os.urandom(8192))
    code, err = _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))
    assert (list(target.iterdir()) == []) if folder else (target.read_text() == "precious\n")
    if FIXED_NAMES[name] == "refuse":
        assert code == 3 and f"{out / name} is a symbolic link" in err and "remove it" in err
        assert len(err.strip().splitlines()) <= 2
    elif name == "_logs":
        assert code == 3 and "details: " in err and str(outside) not in err
    else:
        assert code == 0 and _states(out)["j0"][0] == "done"
        if name == BACKUP_NAME:
            assert f"{out / BACKUP_NAME} is a symbolic link" in err  # the run says the copy is not kept
        if name in ("index.html", "_report"):
            assert "report: could not write" in err and "is a symbolic link" in err


def test_a_users_own_index_html_is_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    mine = "<!doctype html><title>my notes on these renders</title>\n"
    (out / "index.html").write_text(mine)
    code, err = _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))
    assert code == 0 and (out / "index.html").read_text() == mine
    assert f"{out / 'index.html'} is not a pan2-render report: it is left as it is" in err
    assert err.count("is not a pan2-render report") == 1  # said once, not at every rewrite
    assert "j0" in (out / "pan2-render-report.html").read_text()
    code, text = _cli(capsys, "report", str(out))
    assert code == 0 and text.strip() == str(out / "pan2-render-report.html")
    (out / "index.html").unlink()  # the user moved theirs away: the report takes its usual name
    assert _cli(capsys, "report", str(out))[1].strip() == str(out / "index.html")


def test_write_atomic_never_leaves_a_half_written_file_at_its_name(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The write fails before its rename (here the fsync: a full disk, an I/O error): the path
    still holds the old file, whole, and no temp file is left."""
    path = tmp_path / "video.mp4"
    path.write_bytes(b"the old video, whole")

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError):
        artifacts.write_atomic(path, b"the new video" * 1000)
    assert path.read_bytes() == b"the old video, whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["video.mp4"]


# ----------------------------------------------------------------------------- status and hints
def _add_running_job(out: Path, tmp_path: Path, name: str = "late") -> str:
    """A job the ledger says is running: recorded and started by a driver (that may since have died)."""
    from pan2render.jobs.batch import load_batch
    from pan2render.jobs.ledger import JobEvent

    batch = write_batch(tmp_path / f"{name}.yaml", [{"name": name, "prompt": "later"}],
                        defaults={"steps": 2, "frames": 5, "width": 32, "height": 32})
    (spec,) = load_batch(batch).jobs
    led = Ledger.open(out)
    led.add_jobs([spec], retries=2)
    led.transition(spec.job_id, JobEvent.START, reason="on group g0")
    led.close()
    return spec.job_id


def test_status_exit_codes_are_the_readmes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """0 every job done, 1 some job failed (or a done job's video is missing), 4 not finished."""
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 2)), "--out", str(out))[0] == 0
    assert _cli(capsys, "status", str(out))[0] == 0 and _cli(capsys, "status", str(out), "--json")[0] == 0
    jid = _add_running_job(out, tmp_path)
    for args in (("status", str(out)), ("status", str(out), "--json")):
        code, text = _cli(capsys, *args)
        assert code == 4, text
    monkeypatch.setenv("PAN2_RENDER_FAULTS", '{"fail": {"job": "late", "stage": "sampling", "raise": "JobInputError"}}')
    assert _cli(capsys, "resume", str(out))[0] == 1
    assert _cli(capsys, "status", str(out))[0] == 1 and jid
    # The failed job's batch is edited and run again: its new version is done, the old one is
    # superseded and no longer counts.
    monkeypatch.delenv("PAN2_RENDER_FAULTS")
    batch = write_batch(tmp_path / "late2.yaml", [{"name": "late", "prompt": "later, fixed"}],
                        defaults={"steps": 2, "frames": 5, "width": 32, "height": 32})
    assert _cli(capsys, "run", str(batch), "--out", str(out), "--add")[0] == 0
    code, text = _cli(capsys, "status", str(out))
    assert code == 0 and "superseded by" in text


def test_status_of_a_held_folder_says_running_whatever_its_holder_line_says(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The kernel's lock is the truth: a holder line with a pid from another PID namespace (a run in
    a container), or none yet (the instant between truncate and write), still means running."""
    import json
    import socket

    from pan2render.jobs.ledger import FolderLock

    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))[0] == 0
    _add_running_job(out, tmp_path)
    with FolderLock(out):
        for line in (json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname(), "started": "x"}), ""):
            (out / ".lock").write_text(line)
            code, text = _cli(capsys, "status", str(out))
            assert code == 4 and "\nrunning" in text and "not running" not in text
            assert "interrupted" not in text


def test_status_shows_the_running_jobs_of_a_dead_run_as_interrupted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))[0] == 0
    jid = _add_running_job(out, tmp_path)
    code, text = _cli(capsys, "status", str(out))
    row = next(line for line in text.splitlines() if jid in line)
    assert code == 4 and "not running" in text and row.startswith("interrupted")
    assert f"`pan2-render resume {out}` continues" in text
    code, text = _cli(capsys, "status", str(out), "--json")
    assert '"state": "interrupted"' in text


@pytest.mark.parametrize("how", ["delete", "zero"])
def test_run_into_a_folder_whose_ledger_is_gone_refuses_before_overwriting(
        tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    out, batch = tmp_path / "out", _batch(tmp_path)
    assert _cli(capsys, "run", str(batch), "--out", str(out))[0] == 0
    videos = _video_ids(out)
    _damage(out / LEDGER_NAME, how)
    before = sorted(p.name for p in out.iterdir())
    code, err = _cli(capsys, "run", str(batch), "--out", str(out))
    assert code == 3 and f"pan2-render repair {out}" in err and "nothing was written" in err.lower()
    assert f"{N_JOBS} job folder(s)" in err
    assert _video_ids(out) == videos and sorted(p.name for p in out.iterdir()) == before
    assert _cli(capsys, "repair", str(out))[0] == 0
    code, err = _cli(capsys, "run", str(batch), "--out", str(out))
    assert code == 0 and f"all {N_JOBS} job(s) already done" in err and _video_ids(out) == videos


def test_an_emptied_ledger_is_explained_with_repair_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))[0] == 0
    led = Ledger.open(out)
    led._conn.execute("DELETE FROM stages")
    led._conn.execute("DELETE FROM jobs")  # a ledger with its tables and no batch
    led.close()
    for command in ("resume", "status", "report"):
        code, err = _cli(capsys, command, str(out))
        assert code == 2 and "holds no batch" in err, command
        assert err.index(f"pan2-render repair {out}") < err.index("pan2-render run BATCH"), err


def test_hints_are_commands_that_can_be_pasted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import re
    import shlex

    out = tmp_path / "Dan's renders" / "sweep 1"
    monkeypatch.setenv("PAN2_RENDER_FAULTS", '{"fail": {"job": "j0", "stage": "sampling", "raise": "JobInputError"}}')
    code, err = _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))
    _damage(out / LEDGER_NAME, "garbage")
    err += _cli(capsys, "status", str(out))[1]
    hints = re.findall(r"`(pan2-render [^`]*)`", err)
    print(hints)
    assert {"status", "show", "repair"} <= {h.split()[1] for h in hints}
    for hint in hints:
        assert str(out) in shlex.split(hint), hint


def test_a_bad_ray_address_is_refused_before_anything_is_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("PAN2_RENDER_EXECUTOR")
    out = tmp_path / "out"
    for address in ("garbage", "http://head:8265", "head:port"):
        monkeypatch.setenv("RAY_ADDRESS", address)
        code, err = _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))
        assert code == 2 and f"RAY_ADDRESS={address}" in err and "allowed: auto, local, HOST:PORT" in err
        assert "likely a bug" not in err and not out.exists()


def test_sigterm_while_ray_starts_is_an_interruption(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """ray.init installs a SIGTERM handler of its own that calls sys.exit(15) while it starts."""
    def init(self: LocalExecutor, **kw: Any) -> None:
        sys.exit(15)

    monkeypatch.setattr(LocalExecutor, "__init__", init)
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))
    assert code == 130 and "interrupted by SIGTERM" in err and f"pan2-render resume {out}` continues" in err
    assert _states(out)["j0"][0] == "pending"


def test_no_resume_hint_where_nothing_was_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from pan2render.jobs import ledger

    def interrupted(*a: Any, **kw: Any) -> None:
        raise KeyboardInterrupt

    out = tmp_path / "out"
    monkeypatch.setattr(ledger.Ledger, "record_batch", interrupted)
    code, err = _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))
    assert code == 130 and "pan2-render resume" not in err and "run the same command again" in err

    def broken(*a: Any, **kw: Any) -> None:
        raise ValueError("something unexpected")

    monkeypatch.setattr(ledger.Ledger, "record_batch", broken)
    code, err = _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))
    assert code == 3 and "pan2-render resume" not in err and "run the same command again" in err


def test_a_clock_stepped_back_never_shows_a_negative_elapsed(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import time

    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))[0] == 0
    led = Ledger.open(out)
    runs = led.get_meta("runs")
    led.set_meta("runs", [{**runs[-1], "started": time.time() + 3600}])  # recorded by a clock an hour ahead
    led.close()
    code, text = _cli(capsys, "status", str(out))
    assert "elapsed 0s" in text and "elapsed -" not in text


# ------------------------------------------------------------------------------- the ledger's copy
def test_repair_keeps_what_the_backup_recorded_of_each_finished_job(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The backup is brought up to date after every job done: a ledger lost afterwards is rebuilt
    with each job's attempts and its params.json as recorded (not rewritten from less)."""
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path)), "--out", str(out))[0] == 0
    params = {p.parent.name: p.read_bytes() for p in out.glob("*/params.json")}
    before = _states(out)
    (out / LEDGER_NAME).unlink()
    assert _cli(capsys, "repair", str(out))[0] == 0
    code, err = _cli(capsys, "resume", str(out))
    assert code == 0 and "params.json" not in err  # nothing rewritten
    assert _states(out) == before and len(params) == N_JOBS
    assert {p.parent.name: p.read_bytes() for p in out.glob("*/params.json")} == params


def test_the_backup_is_not_copied_whole_after_every_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A whole copy after each job made a batch's backups quadratic in its length: one copy per run
    (once the batch is recorded), then each job's own rows."""
    whole = {"n": 0}
    real = Ledger.backup

    def backup(self: Ledger) -> Path:
        whole["n"] += 1
        return real(self)

    monkeypatch.setattr(Ledger, "backup", backup)
    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 4)), "--out", str(out))[0] == 0
    assert whole["n"] == 1
    copy = Ledger.open_file_readonly(out / BACKUP_NAME)
    try:
        assert [j.state for j in copy.jobs()] == [JobState.DONE] * 4
    finally:
        copy.close()


# ---------------------------------------------------------------------------- latents on disk
def _run_with_j1_failing_at_decode(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> Path:
    """j0, j2 done; j1 failed at decode, its latents valid on disk (no retries)."""
    out = tmp_path / "out"
    monkeypatch.setenv("PAN2_RENDER_FAULTS", '{"fail": {"job": "j1", "stage": "decode", "raise": "JobInputError"}}')
    _cli(capsys, "run", str(_batch(tmp_path)), "--out", str(out), "--retries", "0")
    monkeypatch.delenv("PAN2_RENDER_FAULTS")
    return out


def _latents_of(out: Path, name: str) -> Path:
    return next(out.glob(f"{name}-*/latents.safetensors"))


def _latents_spec_hash(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return (f.metadata() or {})["spec_hash"]


def test_repair_does_not_take_latents_recorded_for_another_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_with_j1_failing_at_decode(tmp_path, capsys, monkeypatch)
    j1 = _latents_of(out, "j1")
    own = _latents_spec_hash(j1)
    j1.write_bytes(_latents_of(out, "j0").read_bytes())  # whole and finite, but j0's
    (out / LEDGER_NAME).unlink()
    code, err = _cli(capsys, "repair", str(out))
    assert code == 0 and "0 with valid latents" in err
    assert _cli(capsys, "resume", str(out))[0] == 0
    assert _latents_spec_hash(j1) == own  # sampled again for j1, not decoded from j0's
    _assert_consistent(out)


def test_repair_decodes_a_video_before_counting_it_done(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A valid mp4 of the wrong length: its size and sha256 are its own (repair has no ledger record
    to compare them with), only decoding it shows that it is not the job's video."""
    import numpy as np

    out = tmp_path / "out"
    assert _cli(capsys, "run", str(_batch(tmp_path, 1)), "--out", str(out))[0] == 0
    video = next(out.glob("*/video.mp4"))
    encode_mp4(np.zeros((1, 32, 32, 3), np.uint8), video, fps=8.0, crf=18)
    (out / LEDGER_NAME).unlink()
    code, err = _cli(capsys, "repair", str(out))
    assert code == 0 and "0 done" in err and "1 with valid latents" in err
    assert _cli(capsys, "resume", str(out))[0] == 0 and probe_mp4(video).frames == 5


def test_repair_checks_the_latents_data_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A flipped byte in the latents (a finite, plausible value) decoded into a wrong video marked done."""
    out = _run_with_j1_failing_at_decode(tmp_path, capsys, monkeypatch)
    j1 = _latents_of(out, "j1")
    data = bytearray(j1.read_bytes())
    data[-3] ^= 0x01  # one mantissa bit of the last float
    j1.write_bytes(bytes(data))
    (out / LEDGER_NAME).unlink()
    code, err = _cli(capsys, "repair", str(out))
    assert code == 0 and "0 with valid latents" in err
    assert _cli(capsys, "resume", str(out))[0] == 0
    assert j1.read_bytes() != bytes(data)  # sampled again
    _assert_consistent(out)


def test_latents_of_the_wrong_shape_are_sampled_again_not_failed_at_decode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import torch

    out = _run_with_j1_failing_at_decode(tmp_path, capsys, monkeypatch)
    j1 = _latents_of(out, "j1")
    led = Ledger.open(out)
    job = next(j for j in led.jobs() if j.name == "j1")
    data = packing.pack_latents(torch.zeros(48, 1, 1, 1), spec_hash=job.spec_hash, seed=job.spec.seed,
                               steps=job.spec.steps, model_id="fake", spec=json.loads(json.dumps(job.spec.to_dict())))
    j1.write_bytes(data)  # this job's hash, whole, finite: only its shape is wrong
    led.reset_stages(job.id, Stage.SAMPLING, reason="test: other latents recorded as the job's")
    led.set_stage(job.id, Stage.SAMPLING, StageEvent.FINISH, artifact=str(j1.relative_to(out)),
                  sha256=artifacts.sha256_bytes(data), size=len(data))
    led.close()
    assert _cli(capsys, "resume", str(out))[0] == 0
    assert _states(out)["j1"][0] == "done" and j1.read_bytes() != data
    _assert_consistent(out)
