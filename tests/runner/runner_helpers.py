"""Helpers shared by the runner tests (imported by name: tests/ is not a package)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import JobState, Ledger, Stage, StageState
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import JobSpec
from pan2render.runner.cluster.executor import Call, Group
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.farm.api import start_api
from pan2render.runner.farm.config import FarmConfig
from pan2render.runner.farm.folder import ensure_token
from pan2render.runner.farm.intake import Roots
from pan2render.runner.farm.service import Farm
from pan2render.runner.farm.users import Users
from pan2render.runner.protocol.messages import (
    CollectCall,
    DecodeCall,
    EncodePromptsCall,
    FetchCheckpointCall,
    FetchPreviewCall,
    InterpolateCall,
    Lane,
    SampleCall,
    SegmentFrameCall,
    StopSamplingCall,
    WorkerCall,
    WorkerConfig,
)
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver, RunSummary
from pan2render.runner.serve.session import BatchRequest
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def sqlite_disk_full() -> sqlite3.OperationalError:
    """A real SQLITE_FULL error, as SQLite raises it on a full disk (code and message): a
    database capped at two pages refuses a larger row."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("CREATE TABLE t (x)")
        conn.execute("PRAGMA max_page_count = 2")
        conn.execute("INSERT INTO t VALUES (zeroblob(100000))")
    except sqlite3.OperationalError as e:
        return e
    finally:
        conn.close()
    raise AssertionError("SQLite accepted a row larger than its page cap")


def write_batch(path: Path, jobs: list[dict], *, defaults: dict | None = None,
                sweep: dict | None = None, model: str = "tiny") -> Path:
    doc: dict = {"model": model, "preset": "tiny-preview", "jobs": jobs}
    if defaults:
        doc["defaults"] = defaults
    if sweep:
        doc["sweep"] = sweep
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def until(check: Callable[[], Any], what: str, timeout_s: float = 60.0, *, poll_s: float = 0.1) -> Any:
    """Poll ``check`` until it gives something true, and return that; ``timeout_s`` passing first
    fails the test, naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)
    return got


def step_until(farm: Farm, done: Callable[[], Any], what: str, timeout_s: float = 60.0) -> None:
    """Turn ``farm``'s loop here, a pass at a time (its own thread not started), until ``done()``;
    ``timeout_s`` passing first fails the test, naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout_s
    while not done():
        farm.step()
        assert time.monotonic() < deadline, f"the farm did not get to: {what}"


def stop_farm(env: dict[str, str], *marks: str | Path) -> None:
    """End what a test started of a farm: `farm stop` of the farm ``env`` names, then SIGKILL to any
    live process whose command line still names one of ``marks`` (the test's own folders), so that
    a stop that did not end it, or a start that raced it, leaves nothing running."""
    subprocess.run([sys.executable, "-m", "pan2render.runner.cli", "farm", "stop"], env=env,
                   capture_output=True, timeout=120, check=False)
    wanted = [str(m).encode() for m in marks]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if int(pid) != os.getpid() and any(m in cmd for m in wanted):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_while_running(run: subprocess.Popen, ready: Callable[[], bool], *, within_s: float, what: str,
                       poll_s: float = 0.1) -> None:
    """Poll until ``ready()``; the run ending first, or ``within_s`` passing, fails the test."""
    deadline = time.monotonic() + within_s
    while not ready():
        assert run.poll() is None, f"run ended early: {run.stderr.read() if run.stderr else ''}"
        assert time.monotonic() < deadline, f"{what} within {within_s:.0f} s"
        time.sleep(poll_s)


def spec(name: str, *, seed: int = 0, gpus: int = 1, prompt: str | None = None, steps: int = 3,
         image: Path | None = None) -> JobSpec:
    return JobSpec(name=name, model="tiny", prompt=prompt or f"a clip of {name}", negative_prompt="",
                   image=None if image is None else str(image),
                   image_sha256=None if image is None else hashlib.sha256(image.read_bytes()).hexdigest(),
                   seed=seed, steps=steps, guidance=2.5, height=32,
                   width=48, frames=9, fps=8.0, flow_shift=5.0, sampler="unipc", gpus=gpus, crf=18,
                   preset="tiny-preview")


def jobs_done(out: Path) -> int:
    """How many of a running batch's jobs its ledger has done (0 before the ledger exists or while
    its writer holds the journal)."""
    try:
        led = Ledger.open_readonly(out)
    except FileNotFoundError:
        return 0
    try:
        return sum(j.state is JobState.DONE for j in led.jobs())
    except Exception:  # the writer holds the journal this instant
        return 0
    finally:
        led.close()


SIDE_CALLS = (FetchCheckpointCall, FetchPreviewCall, StopSamplingCall)


class RecordingExecutor(LocalExecutor):
    """Records every worker call (its type, the job's name) so tests can see what was (not) redone."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.calls: list[tuple[type[WorkerCall], str | None]] = []
        self.on_group: list[tuple[type[WorkerCall], str | None, str]] = []  # ... and the group's id
        self.encoded_texts: list[list[str]] = []  # the texts of each EncodePromptsCall
        # step-checkpoint and preview fetches, stops
        self.side_calls: list[tuple[type[WorkerCall], str | None]] = []
        self.messages: list[WorkerCall] = []  # every message, as sent

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        self.messages.append(message)
        if isinstance(message, SIDE_CALLS):  # beside a sampling, not a stage's
            self.side_calls.append((type(message), job_name(message)))
            return super().call(group, message, timeout_s=timeout_s)
        self.calls.append((type(message), job_name(message)))
        self.on_group.append((type(message), job_name(message), group.id))
        if isinstance(message, EncodePromptsCall):
            self.encoded_texts.append(list(message.texts))
        return super().call(group, message, timeout_s=timeout_s)


class ThreadedExecutor(LocalExecutor):
    """The in-process executor with each group's GPU lane on a thread of its own, as a Ray actor's
    runs beside the driver: the scheduler's loop goes on while a sampling runs (and the calls
    beside a sampling, its step checkpoints, previews and stops, meet it while it runs), and two
    groups sample at once."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self._gpu_lanes: dict[str, futures.ThreadPoolExecutor] = {}

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        seq = group.take_seq(message)
        lane = self._io if message.lane is Lane.IO else self._gpu_lanes.setdefault(
            group.id, futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gpu-lane-{group.id}"))
        return Call(group=group, message=message, started=time.monotonic(), timeout_s=timeout_s,
                    handle=lane.submit(self._execute, group, message, seq))

    def shutdown(self) -> None:
        super().shutdown()
        for lane in self._gpu_lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)


def job_name(message: WorkerCall) -> str | None:
    """The name of the job a call is for (None for one that serves several: load, encode)."""
    if isinstance(message, (SampleCall, SegmentFrameCall, DecodeCall, InterpolateCall, CollectCall, *SIDE_CALLS)):
        return message.job_id.rsplit("-", 1)[0]  # a job id is "<name>-<hash8>"
    return None


def render(out: Path, jobs: list[JobSpec], *, gpus: int = 1, retries: int = 2,
           faults: dict[str, Any] | None = None, factory: str = FAKE_FACTORY,
           executor: type[RecordingExecutor] | None = None) -> tuple[RunSummary, RecordingExecutor, Ledger]:
    out.mkdir(exist_ok=True)
    ledger = Ledger.open(out)
    ledger.add_jobs(jobs, retries=retries)
    ex = (executor or RecordingExecutor)(gpus=gpus, config=WorkerConfig(pipeline_factory=factory, faults=faults or {}))
    driver = Driver(out_dir=out, ledger=ledger, executor=ex,
                    config=ServingConfig(retries=retries, progress=False, poll_s=0.01))
    return driver.run([j.job_id for j in jobs]), ex, ledger


def jobs_by_name(out: Path) -> dict[str, Any]:
    """The ledger's jobs in ``out``, by name (read-only: a run may still hold the ledger)."""
    led = Ledger.open_readonly(out)
    try:
        return {j.name: j for j in led.jobs()}
    finally:
        led.close()


def one_done_and_one_sampling(out: Path) -> bool:
    """One job done and another sampling: a fault injected now hits a running job, with a finished
    one beside it that must not be redone. False while the ledger is not readable yet."""
    try:
        led = Ledger.open_readonly(out)
    except (FileNotFoundError, sqlite3.Error):
        return False
    try:
        jobs = led.jobs()
        return any(j.state is JobState.DONE for j in jobs) and any(
            j.state is JobState.RUNNING and led.stages(j.id)[Stage.SAMPLING].state is StageState.RUNNING
            for j in jobs)
    except sqlite3.Error:  # the writer holds the journal this instant
        return False
    finally:
        led.close()


CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@contextmanager
def serving_farm(tmp_path: Path, *, gpus: int = 1, faults: dict[str, Any] | None = None,
                 pipeline: str = FAKE_FACTORY, users: dict[str, str] | None = None, root: Path | None = None,
                 executor: type[LocalExecutor] = LocalExecutor, **config: Any) -> Iterator[tuple[Farm, str, str]]:
    """A farm in this process (the fake pipeline; ``pipeline``: another factory, e.g. the tiny
    model's, DEFAULT_PIPELINE_FACTORY) with its API on a free port and its main loop on a thread, as
    in its own process, reading and writing inside ``tmp_path``: yields (farm, url, admin token);
    stopped on exit. ``users``: a dict filled with a token per name it holds; ``executor``: the
    in-process one (LocalExecutor), or ThreadedExecutor for samplings that run beside the loop."""
    root = root or tmp_path / "farm"
    root.mkdir(exist_ok=True, mode=0o700)
    for name in users or {}:
        users[name] = Users(root).add(name)  # type: ignore[index]
    ex = executor(gpus=gpus, config=WorkerConfig(pipeline_factory=pipeline, faults=faults or {}))
    farm = Farm(farm_config(root, **config), ex, log=print)  # (pytest shows it when a test fails)
    token = ensure_token(root)
    api = start_api(farm, users=Users(root, admin_token=token), roots=Roots.of([tmp_path], [tmp_path]),
                    host=farm.config.host, port=0, say=lambda text: None)
    farm.url = api.url
    loop = threading.Thread(target=farm.run, name="farm-main", daemon=True)
    loop.start()
    try:
        yield farm, api.url, token
    finally:
        farm.stop()
        loop.join(timeout=30)
        api.stop()


def submit_file(farm: Farm, out: Path, doc: dict[str, Any], *, owner: str = "ann", priority: int = 0,
                paused: bool = False) -> str:
    """Validate a batch file's content as `submit` does and queue it on ``farm``: the batch's id.
    ``paused``: paused in the same request, before the farm's loop can start any of its jobs."""
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump({"model": "tiny", "preset": "tiny-preview", **doc}, sort_keys=False))
    request = BatchRequest(out_dir=out, batch=load_batch(path), overrides=Overrides())

    def submit() -> str:
        batch_id = farm.actions.submit(request, owner=owner, priority=priority)["id"]
        if paused:
            farm.actions.pause(batch_id, paused=True)
        return batch_id

    return farm.ask(submit).result(timeout=60)


def farm_config(root: Path, **settings: Any) -> FarmConfig:
    """A farm's config for tests: quick passes; ``settings`` either the farm's own or serving ones."""
    serving = {k: settings.pop(k) for k in list(settings) if k in ServingConfig.__dataclass_fields__}
    return FarmConfig(root=root, poll_s=0.01, serving=ServingConfig(**serving), **settings)
