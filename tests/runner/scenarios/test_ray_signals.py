"""SIGTERM (a scheduler, `kill`) and SIGHUP (a dropped SSH session) stop `pan2-render run` the way
Ctrl-C does: running jobs back to pending in the ledger, the Ray processes the run started gone,
and `resume` finishes the batch. A subprocess with its own local Ray cluster, as a user runs it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from runner_helpers import jobs_done, wait_while_running, write_batch

from pan2render.jobs.ledger import JobState, Ledger, StageState
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pan2render.runner.cli"]


def _session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the run was started as a session leader, so everything
    it and Ray started is in it unless they left it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session id
            pids.append(int(entry.name))
    return pids


def _carrying(mark: str) -> dict[int, tuple[int, bytes]]:
    """Live processes whose environment or command line holds ``mark`` (a test's RAY_TMPDIR: every
    Ray process a run started, the agents that rename themselves included) -> (parent, argv[0])."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if fields[0] != "Z" and (mark.encode() in cmdline or mark.encode() in environ):
            found[int(entry.name)] = (int(fields[1]), cmdline.split(b"\0")[0])
    return found


def _raylet_children(mark: str) -> list[int]:
    """The processes the raylet of the run marked ``mark`` has started (its agents, then workers)."""
    procs = _carrying(mark)
    raylets = {pid for pid, (_, argv0) in procs.items() if Path(argv0.decode(errors="replace")).name == "raylet"}
    return [pid for pid, (parent, _) in procs.items() if parent in raylets]


def test_sigterm_mid_run_leaves_a_consistent_ledger_and_resume_finishes(tmp_path: Path) -> None:
    batch = write_batch(tmp_path / "b.yaml", [{"name": f"j{i}", "prompt": f"clip {i}"} for i in range(3)],
                        defaults={"steps": 4})
    out = tmp_path / "out"
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "PAN2_RENDER_PIPELINE": FAKE_FACTORY, "PAN2_FAKE_STEP_SECONDS": "0.3"}
    run = subprocess.Popen([*CLI, "run", str(batch), "--out", str(out), "--cpu-gpus", "1"], env=env,
                           start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        wait_while_running(run, lambda: jobs_done(out) >= 1, within_s=120, what="no job done")
        time.sleep(0.5)  # into the next job's sampling
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=90)
        print(err[-1500:])
        assert run.returncode == 130, err
        assert f"interrupted by SIGTERM; finished stages are kept: `pan2-render resume {out}` continues" in err
        # Everything the run started is gone (Ray's GCS, raylet, workers), without our help.
        deadline = time.monotonic() + 20
        while _session_pids(run.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _session_pids(run.pid)
        assert not left, [Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:120] for p in left]
    finally:
        try:
            os.killpg(run.pid, signal.SIGKILL)  # clean-up should the test fail
        except ProcessLookupError:
            pass
    led = Ledger.open_readonly(out)
    jobs = led.jobs()
    stage_states = {s.state for j in jobs for s in led.stages(j.id).values()}
    interrupted = [e.detail for e in led.events() if e.label == "running->pending"]
    led.close()
    print({j.name: j.state.value for j in jobs}, interrupted)
    assert JobState.RUNNING not in {j.state for j in jobs} and StageState.RUNNING not in stage_states
    assert len(interrupted) == 1 and interrupted[0].startswith("interrupted (")
    assert "interrupted" in (out / "run.log").read_text()

    resume = subprocess.run([*CLI, "resume", str(out), "--cpu-gpus", "1"], env=env, capture_output=True,
                            text=True, timeout=180, start_new_session=True)
    print(resume.stderr[-600:])
    assert resume.returncode == 0, resume.stderr
    led = Ledger.open_readonly(out)
    assert all(j.state is JobState.DONE for j in led.jobs()) and len(led.jobs()) == 3
    led.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_while_ray_starts_leaves_no_ray_process(tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C (or a SIGTERM, which ray.init's own handler turns into an exit) while ray.init waits
    for the run's new raylet to register, which it does once its dashboard and runtime-env agents
    are up: Ray knows no node to shut down yet, and those agents (children of the raylet, which
    dies with the run) would live on for a minute. The signal goes to the run alone once the
    raylet has started both agents (a terminal's Ctrl-C also reaches agents young enough to die of
    it, which would make the leak a matter of timing)."""
    ray_tmp = tempfile.mkdtemp(prefix="p2i", dir="/tmp")  # short: Ray's unix sockets live under it
    home = tmp_path / "home"
    home.mkdir()
    batch = write_batch(tmp_path / "b.yaml", [{"name": "a", "prompt": "a"}], defaults={"steps": 2})
    out = tmp_path / "out"
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "HOME": str(home), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
           "RAY_USAGE_STATS_ENABLED": "0", "PAN2_RENDER_PIPELINE": FAKE_FACTORY}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.Popen([*CLI, "run", str(batch), "--out", str(out), "--cpu-gpus", "1"], env=env,
                           start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        wait_while_running(run, lambda: len(_raylet_children(ray_tmp)) >= 2, within_s=60, poll_s=0.02,
                           what="Ray's raylet did not start its two agents")
        os.kill(run.pid, sig)
        _, err = run.communicate(timeout=60)
        print(err[-1500:])
        assert run.returncode == 130 and "interrupted" in err, err
        if sig is signal.SIGINT:  # acted on once ray.init returned, not inside it (a crash at exit)
            assert "stopping once Ray has started" in err, err
        deadline = time.monotonic() + 5
        while _carrying(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _carrying(ray_tmp)
        assert not left, [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for p in left]
    finally:
        if run.poll() is None:  # clean-up should the test fail
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=10)
        for pid in _carrying(ray_tmp):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
