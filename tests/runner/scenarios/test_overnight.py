"""The command line for overnight runs, without Ray: the in-process executor stands in for the Ray
one (same interface), so each test runs whole ``pan2-render`` commands in about a second.

Overrides recorded and repeated by ``resume``; a dry run that plans without the checkpoint from an
earlier run's ledger; ``show`` with every attempt's traceback; plain output off a terminal that
``run.log`` repeats; ``ray://`` refused before anything is written; ``presets`` and ``--version``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from runner_helpers import write_batch

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import EventKind, JobEvent, JobState, Ledger, Stage, StageEvent
from pan2render.jobs.overrides import Overrides
from pan2render.runner.cli import common as cli_common
from pan2render.runner.cli import main as cli
from pan2render.runner.cluster import choose
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.protocol.messages import WorkerConfig
from pan2render.runner.serve.progress import RUN_LOG_NAME
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


@pytest.fixture
def local_executor(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """`run`/`resume` get an in-process executor with the fake pipeline; ``faults`` is read at
    each executor's creation, so a test can change it between commands."""
    settings: dict[str, Any] = {"faults": {}}

    def make(*, address: str | None, cpu_gpus: int | None, max_gpus: int, say: Any, note: Any = None) -> LocalExecutor:
        return LocalExecutor(gpus=max(max_gpus, 1),
                             config=WorkerConfig(pipeline_factory=FAKE_FACTORY, faults=dict(settings["faults"])))

    monkeypatch.setattr(choose, "make_executor", make)
    return settings


def test_overrides_are_recorded_and_resume_repeats_them(
        tmp_path: Path, local_executor: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "x"}, {"name": "b", "prompt": "y"}])
    out = tmp_path / "out"
    local_executor["faults"] = {"fail": {"job": "b", "stage": "sampling"}}
    flags = ["--set", "steps=3", "--set", "guidance=1.0", "--sweep", "seed=5,6"]
    assert cli.main(["run", str(batch), "--out", str(out), "--retries", "0", *flags]) == 1
    capsys.readouterr()
    led = Ledger.open_readonly(out)
    assert led.get_meta("batch")["overrides"] == {"set": ["steps=3", "guidance=1.0"], "sweep": ["seed=5,6"]}
    assert led.get_meta("runs")[-1]["flags"] == flags
    states = {j.id: j.state for j in led.jobs()}
    led.close()
    assert sorted(states) == sorted(s.job_id for s in load_batch(
        batch, overrides=Overrides(sets=("steps=3", "guidance=1.0"), sweeps=("seed=5,6",))).jobs)
    assert sum(s is JobState.FAILED for s in states.values()) == 2

    local_executor["faults"] = {}
    assert cli.main(["resume", str(out)]) == 0
    err = capsys.readouterr().err
    print(err)
    assert f"resume {out}: batch {batch.absolute()} --set steps=3 --set guidance=1.0 --sweep seed=5,6" in err
    led = Ledger.open_readonly(out)
    jobs = led.jobs()
    assert len(jobs) == 4 and all(j.state is JobState.DONE for j in jobs)
    assert {(j.spec.steps, j.spec.guidance, j.spec.seed) for j in jobs} == {(3, 1.0, 5), (3, 1.0, 6)}
    assert led.get_meta("runs")[-1]["command"] == "resume" and led.get_meta("runs")[-1]["flags"] == flags
    led.close()


def test_bad_override_exits_2_naming_the_flag_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "x"}])
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--set", "num_inference_steps=4"]) == 2
    err = capsys.readouterr().err
    print(err)
    assert "--set num_inference_steps=4: num_inference_steps: unknown key" in err and "did you mean 'steps'?" in err
    assert not out.exists()
    assert cli.main(["validate", str(batch), "--sweep", "steps=4,0"]) == 2
    assert "--sweep steps=4,0: steps[1]: got 0" in capsys.readouterr().err


def _seconds(shown: str) -> int:
    """``1m37s`` -> 97 (views' duration format)."""
    m = re.fullmatch(r"(?:(\d+)m)?(\d+)s", shown)
    assert m, shown
    return int(m[1] or 0) * 60 + int(m[2])


def _history(folder: Path, batch: Path) -> None:
    """An earlier run's ledger on this CPU (its group loaded on device cpu): every job done with
    set stage seconds (2 s conditioning, 5 s per sampling step, 10 s decode, 3 s encode)."""
    folder.mkdir()
    led = Ledger.open(folder)
    specs = load_batch(batch, check_model=False).jobs
    led.add_jobs(specs, retries=0)
    led.log(specs[0].job_id, EventKind.GROUP_LOAD, "group g0x1: loaded on 1 rank(s), device cpu, backend gloo")
    for s in specs:
        led.transition(s.job_id, JobEvent.START, reason="test")
        for stage, secs in [(Stage.CONDITIONING, 2.0), (Stage.SAMPLING, 5.0 * s.steps), (Stage.DECODE, 10.0),
                            (Stage.ENCODE, 3.0)]:
            led.set_stage(s.job_id, stage, StageEvent.FINISH, seconds=secs)
        led.transition(s.job_id, JobEvent.FINISH, reason="test")
    led.close()


def test_dry_run_plans_without_the_checkpoint_from_an_earlier_runs_ledger(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    renders = tmp_path / "renders"
    renders.mkdir()
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "x"}], sweep={"seed": [0, 1]},
                        model="checkpoints/not-downloaded-yet")
    _history(renders / "yesterday", batch)
    out = renders / "tonight"
    # `run` needs the checkpoint (exit 3, as for any checkpoint it cannot load); the dry run and validate do not.
    assert cli.main(["run", str(batch), "--out", str(out)]) == cli.EXIT_ENVIRONMENT
    err = capsys.readouterr().err
    assert "not-downloaded-yet: checkpoint folder does not exist" in err and "nothing was recorded" in err
    assert cli.main(["run", str(batch), "--out", str(out), "--dry-run", "--set", "steps=20",
                     "--sweep", "guidance=2,4", "--cpu-gpus", "2"]) == 0
    text = capsys.readouterr().out
    print(text)
    header = text.splitlines()[0].split()
    # The swept fields are columns (once: guidance is not repeated among the fixed ones).
    assert header == ["id", "seed", "guidance", "size", "steps", "gpus", "est.", "GPU", "time"]
    # Per job on one GPU: 2 + 20 x 5 + 10 + 3 = 115 s, from the earlier run; 4 jobs on 2 GPUs.
    rows = [line.split() for line in text.splitlines()[1:5]]
    assert sorted((r[1], r[2], r[-1]) for r in rows) == [("0", "2", "1m55s"), ("0", "4", "1m55s"),
                                                         ("1", "2", "1m55s"), ("1", "4", "1m55s")]
    assert "GPU time 7m40s" in text and "on 2 GPU(s)" in text
    assert f"4 job(s) from this machine's runs (2 done job(s) in {renders / 'yesterday'}" in text
    assert not out.exists()

    # A size no earlier run had: the same runs, scaled to it by the cost model (more frames, more time),
    # and validate says the checkpoint it plans for is not there.
    assert cli.main(["validate", str(batch), "--out", str(out), "--set", "frames=33"]) == cli.EXIT_CHECKPOINT
    text = capsys.readouterr().out
    print(text)
    assert "2 job(s) from this machine's runs" in text and "`run` will refuse it" in text
    # Its own size (8 steps): 2 + 8 x 5 + 10 + 3 = 55 s a job; 33 frames cost more.
    assert all(_seconds(line.split()[-1]) > 55 for line in text.splitlines()[1:3])
    assert not out.exists()


def _failed_twice(tmp_path: Path, local_executor: dict[str, Any]) -> Path:
    batch = write_batch(tmp_path / "b.yaml", [{"name": "fine", "prompt": "x"}, {"name": "broken", "prompt": "y"}],
                        sweep={"seed": [0, 1]}, defaults={"steps": 2})
    out = tmp_path / "out"
    local_executor["faults"] = {"fail": {"job": "broken", "stage": "decode"}}
    assert cli.main(["run", str(batch), "--out", str(out), "--retries", "1"]) == 1
    return out


def test_show_on_a_failed_job_prints_every_attempts_traceback(
        tmp_path: Path, local_executor: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    out = _failed_twice(tmp_path, local_executor)
    capsys.readouterr()
    led = Ledger.open_readonly(out)
    broken = next(j for j in led.jobs() if j.name == "broken" and j.spec.seed == 1)
    led.close()
    for query in (broken.id, broken.id[:len("broken-seed1")]):
        assert cli.main(["show", str(out), query]) == 1  # exit 1: the job failed
        text = capsys.readouterr().out
        assert text.startswith(f"job      {broken.id}\n")
    print(text)
    assert "state    failed (stage decode), 2 attempt(s), 0 retries left" in text
    assert "attempts (2):" in text
    assert text.count("Traceback (most recent call last)") == 2
    assert text.count("RuntimeError: injected failure in decode of job broken") >= 2
    assert re.search(r"sampling\s+done\s+[\d.]+ s\s+broken-seed1-\w+/latents.safetensors \(\d+ bytes\)", text)
    assert "pending->running" in text and "running->failed" in text
    assert re.search(r"\n  seed\s+1\n", text) and '\n  sweep            {"seed": 1}\n' in text
    # A name shared by two jobs of the sweep is ambiguous; an unknown one is named.
    assert cli.main(["show", str(out), "broken"]) == 2
    assert "'broken' matches 2 jobs" in capsys.readouterr().err
    assert cli.main(["show", str(out), "nope"]) == 2
    assert "no job 'nope'" in capsys.readouterr().err


def test_status_shows_swept_values_videos_and_the_last_run(
        tmp_path: Path, local_executor: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    out = _failed_twice(tmp_path, local_executor)
    capsys.readouterr()
    assert cli.main(["status", str(out)]) == 1
    text = capsys.readouterr().out
    print(text)
    lines = text.splitlines()
    assert "not running; last run started" in lines[1] and "elapsed" in lines[1]
    assert lines[2].split()[:5] == ["state", "stage", "att", "id", "seed"]
    fine0 = next(line for line in lines if line.startswith("done") and "fine-seed0-" in line)
    assert re.search(r"fine-seed0-\w+\s+0\s+[\d.]+\s+fine-seed0-\w+/video.mp4", fine0)
    assert lines[-1] == "2 done, 2 failed"
    # --watch on a folder no run holds draws once and ends.
    assert cli.main(["status", str(out), "--watch", "0.1"]) == 1
    assert "every 0.1 s" in capsys.readouterr().out


def test_plain_output_has_one_line_per_event_and_run_log_repeats_it(
        tmp_path: Path, local_executor: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    out = _failed_twice(tmp_path, local_executor)
    err = capsys.readouterr().err
    printed = [line for line in err.splitlines() if line]
    logged = (out / RUN_LOG_NAME).read_text().splitlines()
    print(err)
    # Every line printed is in run.log, in order, after a UTC timestamp.
    assert [re.sub(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", "", line) for line in logged] == printed
    assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", line) for line in logged)
    led = Ledger.open_readonly(out)
    events = led.events()
    led.close()
    # One plain line per job event, naming the job by id: starts, stages, retries, ends.
    kinds = {"pending->running": "start", "running->done": "done", "running->pending": "retry",
             "running->failed": "FAILED"}
    for kind, word in kinds.items():
        ledger_ids = sorted(e.job_id for e in events if e.label == kind)
        printed_ids = sorted(line.split()[1] for line in printed if line.split()[0] == word)
        assert printed_ids == ledger_ids, (word, printed_ids, ledger_ids)
    assert sum(line.startswith("stage ") for line in printed) >= 4 * 2  # sampling + decode+encode at least
    assert printed[-1].startswith("  failed: broken-seed1-") and "show" in printed[-1]


def test_ray_client_address_without_the_extra_exits_2_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "grpc", None)  # as without `ray[client]`: `import grpc` fails
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "x"}])
    out = tmp_path / "out"
    assert cli.main(["run", str(batch), "--out", str(out), "--address", "ray://head:10001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    print(err)
    assert len(err) == 1 and "ray:// address needs Ray's client extra" in err[0]
    assert "pip install 'pan2-render[client]'" in err[0]
    assert not out.exists()


def test_presets_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["presets"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("tiny-preview "))
    assert row.split()[1:6] == ["64", "64", "17", "8.0", "8"]
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert re.fullmatch(r"pan2-render \d+\.\d+\.\d+\n", capsys.readouterr().out)


def test_presets_name_prints_that_preset_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["presets", "fastwan-720p"]) == 0
    text = capsys.readouterr().out
    assert "timesteps: [1000, 757, 522]" in text and "# FastVideo's FastWan2.2-TI2V-5B recipe" in text
    assert yaml.safe_load(text)["sampler"] == "dmd"
    assert cli.main(["presets", "tiny-preveiw"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'tiny-preveiw' (did you mean 'tiny-preview'?)" in err and "pan2-720p" in err


def test_stop_signals_are_handled_unless_ignored_as_under_nohup() -> None:
    import signal

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what `nohup` does
    term_before = signal.getsignal(signal.SIGTERM)  # (Ray, when an earlier test started it here)
    try:
        with cli_common.stop_signals_interrupt():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is cli_common.on_stop_signal
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGTERM)
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # a second one waits for the clean-up
        assert signal.getsignal(signal.SIGTERM) == term_before
    finally:
        signal.signal(signal.SIGHUP, previous)
        cli_common.stopped_by.clear()


def test_status_of_a_live_run_has_an_eta_from_its_own_measured_stages(
        tmp_path: Path, local_executor: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import socket

    from pan2render.jobs.ledger import FolderLock

    out = _failed_twice(tmp_path, local_executor)
    extra = write_batch(tmp_path / "more.yaml", [{"name": "later", "prompt": "z"}], defaults={"steps": 2})
    led = Ledger.open(out)
    led.add_jobs(load_batch(extra).jobs, retries=0)  # pending, as in a run still going
    led.close()
    # The folder's lock is held (by this process), as a running driver holds it.
    lock = FolderLock(out)
    lock.acquire()
    capsys.readouterr()
    try:
        assert cli.main(["status", str(out)]) == 1
    finally:
        lock.release()
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith(f"running (pid {os.getpid()} on {socket.gethostname()}); last run started")
    assert "ETA ~" in line and "1 job(s) from this machine's runs" in line
    assert cli.main(["status", str(out)]) == 1  # released
    text = capsys.readouterr().out
    assert "\nnot running; last run started" in text and "ETA" not in text


def test_hints_name_the_command_as_it_can_be_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from a venv that is not activated, the closing hints give the full path."""
    exe = tmp_path / ".venv" / "bin" / "pan2-render"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(exe), "status"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert cli_common.program() == str(exe)
    monkeypatch.setenv("PATH", f"{exe.parent}:/usr/bin:/bin")  # activated
    assert cli_common.program() == "pan2-render"
