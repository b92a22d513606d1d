"""The driver's scheduling, stages, retries and resume, on the in-process executor (no Ray).

The in-process executor implements the same narrow interface as the Ray one, so these tests cover
every decision the driver makes in a fraction of a second each; tests/runner/scenarios/test_ray_*.py run the
same paths through real Ray actors.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from runner_helpers import RecordingExecutor, render, spec

from pan2render.jobs.ledger import JobState, Ledger, Stage, StageState
from pan2render.jobs.spec import JobSpec
from pan2render.media.video import probe_mp4
from pan2render.runner.cluster.executor import Call, Group, GroupStartError
from pan2render.runner.protocol.messages import (
    CollectCall,
    DecodeCall,
    EncodePromptsCall,
    LoadCall,
    SampleCall,
    WorkerCall,
    WorkerConfig,
)
from pan2render.runner.serve.pool import GroupPool
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def file_id(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def test_batch_renders_valid_videos_and_rerun_skips_done(tmp_path: Path) -> None:
    jobs = [spec("a"), spec("b", seed=1), spec("c", prompt="a clip of a")]  # c shares a's prompt
    summary, ex, led = render(tmp_path, jobs)
    assert summary.exit_code == 0 and len(summary.done) == 3
    for j in jobs:
        info = probe_mp4(tmp_path / j.job_id / "video.mp4")
        print(j.job_id, info)
        assert (info.frames, info.width, info.height) == (9, 48, 32)
        st = led.stages(j.job_id)
        assert all(st[s].state is StageState.DONE for s in Stage)
        assert st[Stage.ENCODE].artifact == f"{j.job_id}/video.mp4" and st[Stage.ENCODE].size > 0
    # Embeddings are cached by prompt and computed ahead: the first job's call also encoded the
    # upcoming jobs' prompts, each distinct text once ("a clip of a" serves a and c).
    print("encode calls:", ex.encoded_texts, "groups:", ex.groups_created)
    assert ex.encoded_texts == [["a clip of a", "", "a clip of b"]] and ex.groups_created == 1
    before = {j.job_id: file_id(tmp_path / j.job_id / "video.mp4") for j in jobs}

    summary2, ex2, led2 = render(tmp_path, jobs + [spec("d")])
    print("second run calls:", ex2.calls)
    assert len(summary2.done) == 4
    assert {n for _, n in ex2.calls} <= {None, "d"}  # only the new job did any work
    assert all(led2.job(j.job_id).attempts == 1 for j in jobs)
    assert before == {j.job_id: file_id(tmp_path / j.job_id / "video.mp4") for j in jobs}


def test_look_ahead_skips_cached_embeddings_and_a_damaged_one_is_encoded_again(tmp_path: Path) -> None:
    from pan2render.runner.protocol import artifacts

    render(tmp_path, [spec("a"), spec("b")])
    key = artifacts.embedding_key(prompt="a clip of b", text_encoder_id="fake-text-v1")
    damaged = tmp_path / artifacts.embedding_relpath(key)
    damaged.write_bytes(damaged.read_bytes()[:100])  # present, but cut short
    # d needs its prompt encoded; e reuses b's prompt, whose cached file is damaged. The look-ahead
    # goes by the files present, so e's prompt is encoded when e reaches conditioning, not before.
    jobs = [spec("d"), spec("e", prompt="a clip of b", seed=5)]
    summary, ex, led = render(tmp_path, jobs)
    print("encode calls:", ex.encoded_texts)
    assert summary.exit_code == 0 and len(summary.done) == 2
    assert ex.encoded_texts == [["a clip of d"], ["a clip of b"]]
    assert artifacts.check_embedding(tmp_path, artifacts.embedding_relpath(key), key=key) is None


@pytest.mark.parametrize("stage", [Stage.DECODE, Stage.ENCODE])
def test_always_failing_job_fails_with_stage_and_error_after_budget(tmp_path: Path, stage: Stage) -> None:
    jobs = [spec("good"), spec("bad"), spec("good2")]
    summary, ex, led = render(tmp_path, jobs, retries=2, faults={"fail": {"job": "bad", "stage": stage.value}})
    bad = led.job(jobs[1].job_id)
    print("bad:", bad.state.value, bad.attempts, bad.error_stage, bad.error)
    assert summary.exit_code == 1 and summary.failed == [bad.id] and len(summary.done) == 2
    # The same error twice in a row on the same stage stops retrying, budget left or not.
    assert (bad.state, bad.attempts, bad.error_stage) == (JobState.FAILED, 2, stage.value)
    assert f"injected failure in {stage.value}" in (bad.error or "") and "twice in a row" in (bad.error or "")
    st = led.stages(bad.id)
    print({s.value: r.state.value for s, r in st.items()})
    assert st[stage].state is StageState.FAILED and "Traceback" in (st[stage].traceback or "")
    assert st[Stage.SAMPLING].state is StageState.DONE
    assert not any(r.state is StageState.RUNNING for r in st.values())
    # Each retry started at decode: the latents were sampled once.
    assert [c for c in ex.calls if c == (SampleCall, "bad")] == [(SampleCall, "bad")]


def test_worker_death_requeues_job_on_a_new_group(tmp_path: Path) -> None:
    marker = tmp_path / "crashed"
    jobs = [spec("a"), spec("b"), spec("c")]
    summary, ex, led = render(tmp_path / "out", jobs,
                              faults={"crash": {"job": "b", "step": 2, "marker": str(marker)}})
    b = led.job(jobs[1].job_id)
    print("b attempts:", b.attempts, "groups created:", ex.groups_created, "marker:", marker.read_text())
    assert summary.exit_code == 0 and marker.exists()
    assert b.attempts == 2 and ex.groups_created == 2
    assert any(e.label == "group-died" for e in led.events(b.id))


def test_nonfinite_latents_fail_at_once_with_reason(tmp_path: Path) -> None:
    summary, ex, led = render(tmp_path, [spec("n")], factory="pan2render.runner.worker.fake_pipeline:load_nan_pipeline")
    job = led.job(spec("n").job_id)
    print("nan job:", job.state.value, job.attempts, job.error)
    assert job.state is JobState.FAILED and job.attempts == 1  # deterministic: no retry
    assert job.error_stage == "sampling" and "non-finite latents" in (job.error or "")
    assert not (tmp_path / job.id / "latents.safetensors").exists()


@pytest.mark.timeout(30)  # a check that keeps rejecting must fail the job, never loop
def test_resume_starts_at_decode_when_latents_are_valid(tmp_path: Path) -> None:
    j = spec("x")
    summary, _, led = render(tmp_path, [j], retries=0, faults={"fail": {"job": "x", "stage": "decode"}})
    assert summary.failed == [j.job_id]
    lat = tmp_path / j.job_id / "latents.safetensors"
    before = file_id(lat)
    summary2, ex2, led2 = render(tmp_path, [j])  # no fault now: a resume
    print("resume calls:", ex2.calls)
    assert summary2.done == [j.job_id]
    assert [m for m, _ in ex2.calls] == [LoadCall, DecodeCall, CollectCall]
    assert file_id(lat) == before


@pytest.mark.timeout(30)  # a check that keeps rejecting must fail the job, never loop
@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupt_latents_are_detected_and_resampled(tmp_path: Path, damage: str) -> None:
    j = spec("x")
    render(tmp_path, [j], retries=0, faults={"fail": {"job": "x", "stage": "decode"}})
    lat = tmp_path / j.job_id / "latents.safetensors"
    _damage(lat, damage)
    summary, ex, led = render(tmp_path, [j])
    events = [e.detail for e in led.events(j.job_id) if e.label == "reset:sampling"]
    print(damage, "->", events)
    assert summary.done == [j.job_id] and (SampleCall, "x") in ex.calls and events


@pytest.mark.timeout(30)  # a check that keeps rejecting must fail the job, never loop
@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupt_video_is_reencoded_from_latents(tmp_path: Path, damage: str) -> None:
    j = spec("v")
    render(tmp_path, [j])
    video = tmp_path / j.job_id / "video.mp4"
    _damage(video, damage)
    summary, ex, led = render(tmp_path, [j])
    print(damage, "calls:", ex.calls, "events:", [e.detail for e in led.events(j.job_id) if "->" in e.label][-3:])
    assert summary.done == [j.job_id] and [m for m, _ in ex.calls] == [LoadCall, DecodeCall, CollectCall]
    assert probe_mp4(video).frames == 9 and led.job(j.job_id).attempts == 2


def test_groups_of_different_sizes_share_the_gpus(tmp_path: Path) -> None:
    jobs = [spec("one", gpus=1), spec("two", gpus=2), spec("one-b", gpus=1), spec("four", gpus=4)]
    summary, ex, led = render(tmp_path, jobs, gpus=2)
    four = led.job(jobs[3].job_id)
    print("four:", four.error, "| groups created:", ex.groups_created)
    assert sorted(summary.done) == sorted(j.job_id for j in jobs[:3])
    assert four.state is JobState.FAILED and "needs a group of 4 GPUs but the cluster has 2" in four.error
    assert four.attempts == 0


def test_first_frame_image_travels_as_bytes_and_a_changed_image_fails_clearly(tmp_path: Path) -> None:
    import numpy as np

    from pan2render.media.video import png_bytes

    img = tmp_path / "first.png"
    img.write_bytes(png_bytes(np.full((20, 30, 3), 200, np.uint8)))
    ok, changed = spec("ti2v", image=img), spec("other", image=img, seed=5)
    img2 = tmp_path / "gone.png"
    img2.write_bytes(img.read_bytes())
    gone = spec("gone", image=img2)
    img2.unlink()
    # Change the image after "validation" for `changed` only: give it a stale hash.
    changed = JobSpec.from_dict({**changed.to_dict(), "image_sha256": "0" * 64})
    summary, ex, led = render(tmp_path / "out", [ok, changed, gone])
    errors = {led.job(j.job_id).name: led.job(j.job_id).error for j in (changed, gone)}
    print("image job done:", summary.done, "| errors:", errors)
    assert summary.done == [ok.job_id]
    assert "changed since the batch was validated" in errors["other"] and led.job(changed.job_id).attempts == 1
    assert "FileNotFoundError" in errors["gone"] and led.job(gone.job_id).attempts == 1


def test_a_job_whose_lora_is_gone_or_changed_fails_at_once_with_the_reason(tmp_path: Path) -> None:
    """The adapter files are read where the job id was made; a file gone or changed since is the
    job's input (deterministic: not retried), never a render without its adapters."""
    import dataclasses

    from pan2render.jobs.spec import LoraRef

    style = tmp_path / "style.safetensors"
    style.write_bytes(b"not these bytes")
    plain = spec("plain")
    gone = dataclasses.replace(spec("gone"), loras=(LoraRef(str(tmp_path / "nowhere.safetensors"), 0.5),),
                               lora_digests=(("0" * 64, 0.5),))
    changed = dataclasses.replace(spec("changed"), loras=(LoraRef(str(style), 0.5),), lora_digests=(("0" * 64, 0.5),))
    summary, _, led = render(tmp_path / "out", [plain, gone, changed])
    errors = {j.name: led.job(j.job_id).error or "" for j in (gone, changed)}
    print("done:", summary.done, "| errors:", errors)
    assert summary.done == [plain.job_id]
    assert "cannot be read" in errors["gone"] and "changed since the batch was validated" in errors["changed"]
    assert all(led.job(j.job_id).attempts == 1 for j in (gone, changed))


@pytest.mark.parametrize("what", ["image", "lora"])
def test_a_job_whose_input_became_a_fifo_fails_at_once_and_the_driver_goes_on(tmp_path: Path, what: str) -> None:
    """Validated as a regular file, the path names a FIFO by the time the job samples. Nobody ever
    writes to it: a driver that read it as a file would wait forever, and every job with it."""
    import dataclasses

    import numpy as np

    from pan2render.jobs.spec import LoraRef
    from pan2render.media.video import png_bytes

    fifo = tmp_path / ("first.png" if what == "image" else "style.safetensors")
    if what == "image":
        fifo.write_bytes(png_bytes(np.full((20, 30, 3), 200, np.uint8)))
        job = spec("swapped", image=fifo)  # its id made with the image's digest
        fifo.unlink()
    else:
        job = dataclasses.replace(spec("swapped"), loras=(LoraRef(str(fifo), 1.0),), lora_digests=(("0" * 64, 1.0),))
    os.mkfifo(fifo)
    plain = spec("plain")
    rendered: list[Any] = []

    def run() -> None:
        summary, _, led = render(tmp_path / "out", [job, plain])
        rendered.append((summary.done, led.job(job.job_id)))  # read here: the ledger is this thread's

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    blocked = thread.is_alive()
    if blocked:  # let the stuck read go (a writer that opens and closes gives it end-of-file)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not blocked, "the driver is blocked reading the FIFO"
    done, failed = rendered[0]
    print("done:", done, "| error:", failed.error)
    assert done == [plain.job_id]
    assert f"{fifo} is a FIFO (named pipe); allowed: a regular file" in (failed.error or "")
    assert failed.attempts == 1  # an input error: not retried


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:])
    else:
        os.unlink(path)


# --------------------------------------------------------------------------------------------------
# Groups that start on a background thread (as RayExecutor's do)


class BackgroundStarts(RecordingExecutor):
    """Group starts run on the pool's thread, as with Ray; ``before_start(size)`` runs first there."""

    starts_in_background = True

    def before_start(self, size: int) -> None:
        pass

    def create_group(self, size: int, *, timeout_s: float, on_wait: Any = None) -> Group:
        self.before_start(size)
        return super().create_group(size, timeout_s=timeout_s)


def test_a_group_waiting_for_gpus_says_so_while_the_running_jobs_go_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The 2-GPU group's start waits (as a placement group does while others hold the GPUs) and
    says so through on_wait from its thread; the scheduler's loop prints each note as a run line."""

    class WaitingPairStart(BackgroundStarts):
        def create_group(self, size: int, *, timeout_s: float, on_wait: Any = None) -> Group:
            n = 0
            while size == 2 and (DecodeCall, "a") not in self.calls:
                n += 1
                on_wait(f"waiting for 2 GPU(s) on one node: note {n}")
                time.sleep(0.05)
            return super().create_group(size, timeout_s=timeout_s)

    summary, ex, led = render(tmp_path, [spec("a", steps=8), spec("b", gpus=2)], gpus=3, retries=0,
                              executor=WaitingPairStart)
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("waiting for 2 GPU(s) on one node: note")]
    print("\n".join(notes))
    assert summary.failed == [] and len(summary.done) == 2
    assert notes and len(notes) == len(set(notes))  # each note said once


def test_running_jobs_advance_while_a_group_starts(tmp_path: Path) -> None:
    """Job a runs on one GPU while the 2-GPU group for job b starts; that start only completes once
    a is finished, so a driver that waited for the start (in its own thread) would never get there."""

    class SlowPairStart(BackgroundStarts):
        def before_start(self, size: int) -> None:
            if size != 2:
                return
            deadline = time.monotonic() + 10
            while (DecodeCall, "a") not in self.calls:
                if time.monotonic() > deadline:
                    raise GroupStartError("the driver did not serve job a while this group was starting")
                time.sleep(0.005)

    summary, ex, led = render(tmp_path, [spec("a"), spec("b", gpus=2)], gpus=3, retries=0, executor=SlowPairStart)
    print("calls:", ex.calls, "| groups created:", ex.groups_created)
    assert sorted(summary.done) == sorted([spec("a").job_id, spec("b", gpus=2).job_id]) and not summary.failed
    assert ex.calls.index((DecodeCall, "a")) < ex.calls.index((SampleCall, "b"))
    assert summary.groups_created == ex.groups_created == 2


def test_a_group_that_cannot_start_is_charged_to_its_job_and_later_jobs_run(tmp_path: Path) -> None:
    class NoPairs(BackgroundStarts):
        def before_start(self, size: int) -> None:
            if size == 2:
                raise GroupStartError("placement group of 2 GPUs on one node was not ready after 3 s (test)")

    pair, single = spec("pair", gpus=2), spec("single")
    summary, ex, led = render(tmp_path, [pair, single], gpus=2, retries=1, executor=NoPairs)
    job = led.job(pair.job_id)
    print("pair:", job.state, job.attempts, job.error, "| done:", summary.done)
    assert summary.done == [single.job_id] and summary.failed == [pair.job_id]
    assert job.attempts == 2 and "placement group of 2 GPUs" in job.error
    assert led.stages(pair.job_id)[Stage.CONDITIONING].state is StageState.FAILED


def test_closing_the_pool_during_a_start_tears_the_late_group_down() -> None:
    release = threading.Event()
    destroyed: list[str] = []

    class Held(BackgroundStarts):
        def before_start(self, size: int) -> None:
            release.wait(10)

        def destroy_group(self, group: Group) -> None:
            destroyed.append(group.id)
            super().destroy_group(group)

    pool = GroupPool(Held(gpus=2, config=WorkerConfig(pipeline_factory=FAKE_FACTORY)), total_gpus=2,
                     start_timeout_s=10)
    assert pool.try_acquire(2) is None and pool.starting
    assert pool.try_acquire(1) is None  # the GPUs of the group in flight are not handed out twice
    pool.close()  # e.g. Ctrl-C while the placement group waits
    release.set()
    deadline = time.monotonic() + 10
    while not destroyed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(destroyed) == 1 and not pool.starting


# --------------------------------------------------------------------------------------------------
# The overlapped worker: encode off the GPU lane, the next job handed over early


class TimedExecutor(RecordingExecutor):
    """Also records when each call finished: GPU-lane calls at once (they run in ``call``),
    collects when their background encode is done."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.finished: dict[tuple[type[WorkerCall], str | None], float] = {}

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        c = super().call(group, message, timeout_s=timeout_s)
        key = self.calls[-1]
        if hasattr(c.handle, "add_done_callback"):
            c.handle.add_done_callback(lambda _f: self.finished.setdefault(key, time.monotonic()))
        else:
            self.finished.setdefault(key, time.monotonic())
        return c


def test_next_job_samples_while_the_previous_one_encodes(tmp_path: Path) -> None:
    jobs = [spec("a"), spec("b", seed=1)]
    # a's encode takes a second on the worker's encode thread; b's whole GPU work far less.
    summary, ex, led = render(tmp_path, jobs, retries=0, executor=TimedExecutor,
                              faults={"slow": {"job": "a", "stage": "encode", "seconds": 1.0}})
    print("calls:", ex.calls)
    print({k: round(v - min(ex.finished.values()), 3) for k, v in ex.finished.items()})
    assert sorted(summary.done) == sorted(j.job_id for j in jobs) and ex.groups_created == 1
    # b's first GPU call was handed over right behind a's decode, before a's decode reply was handled
    # (and so before a's collect was even issued).
    assert ex.calls.index((SampleCall, "b")) < ex.calls.index((CollectCall, "a"))
    # b sampled and decoded on the group while a's encode still ran.
    assert ex.finished[(DecodeCall, "b")] < ex.finished[(CollectCall, "a")]
    a = led.stages(jobs[0].job_id)
    assert a[Stage.DECODE].state is a[Stage.ENCODE].state is StageState.DONE and a[Stage.ENCODE].seconds > 0


def test_an_encode_failure_fails_that_jobs_encode_only_and_the_group_stays(tmp_path: Path) -> None:
    jobs = [spec("good"), spec("bad", seed=1), spec("good2", seed=2)]
    summary, ex, led = render(tmp_path, jobs, retries=1, faults={"fail": {"job": "bad", "stage": "encode"}})
    bad = led.job(jobs[1].job_id)
    st = led.stages(bad.id)
    print("bad:", bad.state.value, bad.attempts, bad.error_stage, bad.error, "| calls:", ex.calls)
    assert sorted(summary.done) == sorted([jobs[0].job_id, jobs[2].job_id]) and ex.groups_created == 1
    assert (bad.state, bad.attempts, bad.error_stage) == (JobState.FAILED, 2, "encode")
    assert st[Stage.ENCODE].state is StageState.FAILED and "injected failure in encode" in st[Stage.ENCODE].error
    # The retry started from the latents: sampled once, decoded (and encoded) twice.
    assert ex.calls.count((SampleCall, "bad")) == 1 and ex.calls.count((DecodeCall, "bad")) == 2
    assert not (tmp_path / bad.id / "video.mp4").exists()


_DRIVER_SCRIPT = """
import json, sys
from pathlib import Path
from pan2render.jobs.ledger import Ledger
from pan2render.jobs.spec import JobSpec
from pan2render.runner.serve.driver import Driver
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.protocol.messages import WorkerConfig
out, specs, faults = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
jobs = [JobSpec.from_dict(d) for d in specs]
ledger = Ledger.open(out)
ledger.add_jobs(jobs, retries=2)
ex = LocalExecutor(gpus=1, config=WorkerConfig(pipeline_factory=sys.argv[4], faults=faults))
Driver(out_dir=out, ledger=ledger, executor=ex, config=ServingConfig(progress=False, poll_s=0.01)).run(
    [j.job_id for j in jobs])
"""


def test_sigkill_while_an_encode_runs_in_the_background_then_resume(tmp_path: Path) -> None:
    """The driver process dies (SIGKILL) while job `slow` encodes on the worker's thread: nothing
    of it is recorded, no half-written mp4 is left under its name; the resume re-encodes it from
    its latents (no sampling, no conditioning) and redoes nothing done."""
    import json
    import signal
    import subprocess
    import sys

    jobs = [spec("first"), spec("slow", seed=1), spec("last", seed=2)]
    out = tmp_path / "out"
    out.mkdir()
    faults = {"slow": {"job": "slow", "stage": "encode", "seconds": 60}}
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER_SCRIPT, str(out), json.dumps([j.to_dict() for j in jobs]),
                             json.dumps(faults), FAKE_FACTORY], stderr=subprocess.PIPE, text=True)
    slow = jobs[1].job_id
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "job slow never reached its background encode"
            if (out / "ledger.sqlite").exists():
                led = Ledger.open_readonly(out)
                try:
                    if led.stages(slow)[Stage.ENCODE].state is StageState.RUNNING:
                        break
                except Exception:  # the writer holds the journal this instant
                    pass
                finally:
                    led.close()
            time.sleep(0.02)
        time.sleep(0.2)  # let the driver go on (job last samples meanwhile)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    led = Ledger.open_readonly(out)
    killed = {j.name: (j.state.value, {s.value: r.state.value for s, r in led.stages(j.id).items()})
              for j in led.jobs()}
    done = [j.id for j in led.jobs() if j.state is JobState.DONE]
    before = {jid: (led.job(jid).attempts, file_id(out / jid / "video.mp4")) for jid in done}
    latents_before = file_id(out / slow / "latents.safetensors")
    led.close()
    print("at the kill:", killed)
    assert killed["first"][0] == "done" and killed["slow"][0] == "running"
    assert killed["slow"][1]["encode"] == "running" and killed["slow"][1]["sampling"] == "done"
    assert not (out / slow / "video.mp4").exists()  # nothing written under the final name

    summary, ex, led = render(out, jobs)  # the resume: no faults now
    print("resume calls:", ex.calls)
    assert sorted(summary.done) == sorted(j.job_id for j in jobs)
    assert [m for m, n in ex.calls if n == "slow"] == [DecodeCall, CollectCall]  # from its latents
    assert (SampleCall, "first") not in ex.calls and (DecodeCall, "first") not in ex.calls
    assert not [m for m, n in ex.calls if m == EncodePromptsCall]
    assert file_id(out / slow / "latents.safetensors") == latents_before
    for jid, (attempts, fid) in before.items():
        assert led.job(jid).attempts == attempts and file_id(out / jid / "video.mp4") == fid
    assert probe_mp4(out / slow / "video.mp4").frames == 9
    assert sorted(p.name for p in (out / slow).iterdir()) == ["latents.safetensors", "params.json", "video.mp4"]


_SHARED: dict[str, Any] = {}


def shared_tiny_pipeline(model: str, device: str) -> Any:
    """A pipeline factory for the worker that loads the tiny model once per test process, so the
    test compares against the very pipeline the worker used."""
    from pan2render.runner.worker.inputs import load_pan2_pipeline

    if model not in _SHARED:
        _SHARED[model] = load_pan2_pipeline(model, device)
    return _SHARED[model]


def test_a_dmd_job_reaches_the_real_pipeline_with_its_timesteps(tmp_path: Path) -> None:
    """The worker hand-over carries sampler dmd and the timesteps: the ledger's latents are exactly
    what the tiny pipeline samples for them (and differ from another timesteps list)."""
    import dataclasses

    from pan2render.runner.worker.packing import unpack_latents

    # The embedded tiny model from the default cache, as the Ray runner tests use it (built once).
    base = dataclasses.replace(spec("dmd"), sampler="dmd", guidance=1.0, height=32, width=32, frames=5)
    jobs = [dataclasses.replace(base, timesteps=(1000, 757, 522), steps=3),
            dataclasses.replace(base, name="dmd-2", timesteps=(1000, 500), steps=2)]
    summary, _, led = render(tmp_path / "out", jobs, factory=f"{__name__}:shared_tiny_pipeline", retries=0)
    assert len(summary.done) == 2, [j.error for j in led.jobs()]
    pipe = _SHARED["tiny"]
    latents = [unpack_latents((tmp_path / "out" / j.job_id / "latents.safetensors").read_bytes()) for j in jobs]
    for job, got in zip(jobs, latents):
        want = pipe.sample(prompt=job.prompt, height=32, width=32, frames=5, guidance=1.0, seed=job.seed,
                           flow_shift=job.flow_shift, sampler="dmd", timesteps=job.timesteps)
        assert torch.equal(got, want), job.name
    assert not torch.equal(latents[0], latents[1])
