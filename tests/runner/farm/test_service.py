"""The farm's scheduler, queue and API in this process (the in-process executor, the fake pipeline):
order by priority then submission (and again when a priority is raised), pause (a paused batch
passed over, not blocking the queue), cancel (kept through a restart), retry, idle release,
eviction for another model, a group held out of service after its device faults in a row, two
clients at once, the token.
tests/runner/scenarios/test_farm_process.py runs the farm as `farm start` does, on Ray, and kills it."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fake_clock import FakeClock
from runner_helpers import RecordingExecutor, farm_config, spec, step_until

from pan2render.jobs.ledger import JobState, Ledger
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import Batch, JobSpec
from pan2render.runner.farm.actions import FarmRequestError
from pan2render.runner.farm.api import start_api
from pan2render.runner.farm.folder import ensure_token
from pan2render.runner.farm.intake import Roots
from pan2render.runner.farm.queue import BatchState
from pan2render.runner.farm.service import Farm
from pan2render.runner.farm.users import Users
from pan2render.runner.protocol.messages import LoadCall, SampleCall, WorkerConfig
from pan2render.runner.serve.session import BatchRequest
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def _farm(tmp_path: Path, *, gpus: int = 1, faults: dict[str, Any] | None = None, clock: FakeClock | None = None,
          **config: Any) -> tuple[Farm, RecordingExecutor]:
    root = tmp_path / "farm"
    root.mkdir(exist_ok=True)
    ex = RecordingExecutor(gpus=gpus, config=WorkerConfig(pipeline_factory=FAKE_FACTORY, faults=faults or {}))
    return Farm(farm_config(root, **config), ex, log=lambda text: None, clock=clock or time.time), ex


def _request(out: Path, jobs: list[JobSpec]) -> BatchRequest:
    return BatchRequest(out_dir=out, batch=Batch(path="b.yaml", model="tiny", preset="tiny-preview", jobs=jobs),
                        overrides=Overrides())


def _serve_until_idle(farm: Farm, *, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while farm.served or farm.scheduler.busy:
        farm.step()
        assert time.monotonic() < deadline, "the farm did not finish its batches"


def _started(out: Path) -> list[tuple[float, str]]:
    led = Ledger.open_readonly(out)
    try:
        return [(e.at, e.job_id) for e in led.events() if e.started]
    finally:
        led.close()


def test_jobs_run_by_priority_then_submission(tmp_path: Path) -> None:
    farm, ex = _farm(tmp_path)
    low = farm.actions.submit(_request(tmp_path / "low", [spec("l1"), spec("l2")]), owner="ann", priority=0)
    first = farm.actions.submit(_request(tmp_path / "first", [spec("f1")]), owner="bob", priority=5)
    second = farm.actions.submit(_request(tmp_path / "second", [spec("s1")]), owner="cy", priority=5)
    _serve_until_idle(farm)
    order = [name for _, name in ex.calls if name is not None and _ == SampleCall]
    print("sampling order:", order)
    assert order == ["f1", "s1", "l1", "l2"]  # priority 5 first, in submission order; then 0
    states = {b["id"]: b["state"] for b in (farm.describe(x["id"]) for x in (low, first, second))}
    assert set(states.values()) == {"done"}
    farm.close()


def test_pause_holds_a_batch_and_unpause_lets_it_finish(tmp_path: Path) -> None:
    farm, _ = _farm(tmp_path)
    b = farm.actions.submit(_request(tmp_path / "out", [spec("a"), spec("b")]), owner="ann", priority=0)
    farm.actions.pause(b["id"], paused=True)
    for _ in range(20):
        farm.step()
    assert farm.describe(b["id"])["counts"]["done"] == 0 and not _started(tmp_path / "out")
    with pytest.raises(FarmRequestError, match="paused: it cannot be paused"):
        farm.actions.pause(b["id"], paused=True)
    farm.actions.pause(b["id"], paused=False)
    _serve_until_idle(farm)
    d = farm.describe(b["id"])
    assert d["state"] == "done" and d["counts"]["done"] == 2 and d["exit_code"] == 0
    farm.close()


def test_a_cancelled_batch_writes_nothing_more_and_retry_finishes_it(tmp_path: Path) -> None:
    farm, _ = _farm(tmp_path)
    out = tmp_path / "out"
    b = farm.actions.submit(_request(out, [spec("a"), spec("b")]), owner="ann", priority=0)
    farm.actions.cancel(b["id"])
    _serve_until_idle(farm)
    d = farm.describe(b["id"])
    print(d)
    assert d["state"] == "cancelled" and d["counts"]["cancelled"] == 2 and d["exit_code"] == 1
    assert not list(out.glob("*/video.mp4")) and not _started(out)
    with pytest.raises(FarmRequestError, match=r"job a \(a-\w+\) of batch b1 is already cancelled: nothing to cancel"):
        farm.actions.cancel(b["id"], job="a")
    farm.actions.retry(b["id"])
    _serve_until_idle(farm)
    assert farm.describe(b["id"])["counts"]["done"] == 2 and len(list(out.glob("*/video.mp4"))) == 2
    farm.close()


def test_one_job_is_cancelled_and_the_others_run(tmp_path: Path) -> None:
    farm, _ = _farm(tmp_path)
    b = farm.actions.submit(_request(tmp_path / "out", [spec("a"), spec("b"), spec("c")]), owner="ann", priority=0)
    farm.actions.cancel(b["id"], job="b")
    _serve_until_idle(farm)
    d = farm.describe(b["id"])
    assert (d["counts"]["done"], d["counts"]["cancelled"], d["state"], d["exit_code"]) == (2, 1, "cancelled", 1)
    led = Ledger.open_readonly(tmp_path / "out")
    assert {j.name: j.state for j in led.jobs()} == {"a": JobState.DONE, "b": JobState.CANCELLED, "c": JobState.DONE}
    led.close()
    farm.close()


def test_a_folder_served_by_the_farm_is_not_taken_twice(tmp_path: Path) -> None:
    farm, _ = _farm(tmp_path)
    out = tmp_path / "out"
    b = farm.actions.submit(_request(out, [spec("a")]), owner="ann", priority=0)
    farm.actions.pause(b["id"], paused=True)
    with pytest.raises(FarmRequestError, match=f"already served by batch {b['id']}"):
        farm.actions.submit(_request(out, [spec("z")]), owner="bob", priority=0)
    farm.close()


def test_an_idle_group_is_released_and_a_new_model_evicts_the_old(tmp_path: Path) -> None:
    """The pool's idle time is read from a clock the test moves: however long the machine takes
    between the two batches (a model folder copied, a loaded CI), the group is idle no time at
    all until the test says so."""
    clock = FakeClock()
    farm, ex = _farm(tmp_path, idle_release_s=60, clock=clock)
    farm.actions.submit(_request(tmp_path / "a", [spec("a")]), owner="ann", priority=0)
    _serve_until_idle(farm)
    from pan2render.models.tiny import tiny_model_folder

    other_model = str(shutil.copytree(tiny_model_folder(), tmp_path / "other-model"))  # (a folder of its own)
    other = JobSpec(**{**spec("b").to_dict(), "model": other_model})
    farm.actions.submit(_request(tmp_path / "b", [other]), owner="ann", priority=0)
    _serve_until_idle(farm)
    loads = [m for m in ex.messages if isinstance(m, LoadCall)]
    print("loads:", loads)
    # One GPU: the warm group unloads the first model for the second (no new group), then idles.
    assert [(m.model, m.unload) for m in loads] == [("tiny", ()), (other_model, ("tiny",))]
    assert ex.groups_created == 1
    groups = farm.scheduler.pool.describe()
    assert [(g.loads.keys(), state) for g, state, _ in groups] == [({other_model: None}.keys(), "idle")]
    clock.advance(59)
    farm.step()
    assert [state for _, state, _ in farm.scheduler.pool.describe()] == ["idle"]  # not idle long enough yet
    clock.advance(2)
    farm.step()
    assert farm.scheduler.pool.describe() == []  # released after its idle time
    farm.close()


def test_a_broken_gpu_is_held_out_of_service_and_its_jobs_done_elsewhere(tmp_path: Path) -> None:
    farm, ex = _farm(tmp_path, gpus=2, faults={"broken_gpu": {"gpu": 0}}, device_fault_limit=3)
    jobs = [spec(f"j{i}", seed=i) for i in range(6)]
    b = farm.actions.submit(_request(tmp_path / "out", jobs), owner="ann", priority=0)
    _serve_until_idle(farm)
    d = farm.describe(b["id"])
    held = [(g.id, state, g.faults) for g, state, _ in farm.scheduler.pool.describe() if state == "out of service"]
    print(d["counts"], held, ex.groups_created)
    assert d["counts"]["done"] == 6 and d["exit_code"] == 0  # one broken GPU does not fail the queue
    assert len(held) == 1 and held[0][2] == 3
    farm._publish()
    assert [g["state"] for g in farm.snapshot()["groups"]].count("out of service") == 1
    farm.close()


def test_two_clients_submitting_at_once_are_both_queued(tmp_path: Path) -> None:
    farm, _ = _farm(tmp_path)
    loop = threading.Thread(target=farm.run, daemon=True)  # the farm's main thread, as in its process
    results: dict[str, Any] = {}

    def client(name: str) -> None:
        results[name] = farm.ask(lambda: farm.actions.submit(_request(tmp_path / name, [spec(name)]), owner=name,
                                                     priority=0)).result(timeout=30)

    clients = [threading.Thread(target=client, args=(n,)) for n in ("one", "two")]
    loop.start()
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=30)
    queued = farm.ask(lambda: sorted(b.out_dir for b in farm.queue.batches())).result(timeout=30)
    farm.stop()
    loop.join(timeout=30)
    print(results)
    assert {r["id"] for r in results.values()} == {"b1", "b2"}
    assert queued == [str(tmp_path / "one"), str(tmp_path / "two")]


def test_a_request_without_the_token_is_refused(tmp_path: Path) -> None:
    farm, _ = _farm(tmp_path)
    token = ensure_token(farm.root)
    assert oct((farm.root / "token").stat().st_mode & 0o777) == "0o600"
    api = start_api(farm, users=Users(farm.root, admin_token=token), roots=Roots.of([tmp_path], [tmp_path]),
                    host="127.0.0.1", port=0, say=lambda text: None)
    farm._publish()
    try:
        def get(path: str, headers: dict[str, str]) -> tuple[int, Any]:
            req = urllib.request.Request(api.url + path, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        assert get("/api/status", {})[0] == 401
        code, body = get("/api/status", {"Authorization": "Bearer not-the-token"})
        assert code == 401 and "token" in body["error"]
        code, body = get("/api/status", {"Authorization": f"Bearer {token}"})
        assert code == 200 and body["root"] == str(farm.root)
        req = urllib.request.Request(api.url + "/api/batches/b1/pause", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 401
    finally:
        api.stop()
        farm.close()


def test_a_farm_started_again_continues_its_batches_from_their_ledgers(tmp_path: Path) -> None:
    """The queue and the ledgers are the farm's whole state: a new Farm on the same folder serves
    what the last one left, and redoes nothing done."""
    farm, _ = _farm(tmp_path)
    out = tmp_path / "out"
    b = farm.actions.submit(_request(out, [spec("a"), spec("b"), spec("c")]), owner="ann", priority=0)
    while farm.describe(b["id"])["counts"]["done"] < 1:
        farm.step()
    farm.close()  # (a kill is the process-level test's: here, the state it leaves on disk)
    done_before = {p: p.stat().st_mtime_ns for p in out.glob("*/video.mp4")}
    sampled_before = {p: p.stat().st_mtime_ns for p in out.glob("*/latents.safetensors")}
    assert done_before
    again, ex = _farm(tmp_path)
    again.resume_unfinished()
    _serve_until_idle(again)
    d = again.describe(b["id"])
    assert d["state"] == "done" and d["counts"]["done"] == 3
    assert all(p.stat().st_mtime_ns == t for p, t in {**done_before, **sampled_before}.items())  # nothing redone
    assert len([m for m in ex.messages if isinstance(m, SampleCall)]) == 3 - len(sampled_before)
    assert again.queue.get(b["id"]).state is BatchState.DONE
    again.close()


def test_a_batch_whose_checkpoint_cannot_be_loaded_is_not_served(tmp_path: Path) -> None:
    """Refused before it is queued (422, nothing written); and a queued batch whose checkpoint broke
    since is not retried, nor continued when the farm starts again: every job would fail its load
    the same way, so none is started or charged."""
    from pan2render.models.tiny import tiny_model_folder

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model_folder(), ckpt)
    (broken := tmp_path / "broken").mkdir()
    (broken / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    farm, _ = _farm(tmp_path)
    with pytest.raises(FarmRequestError, match="the checkpoint cannot be loaded") as refused:
        farm.actions.submit(_request(tmp_path / "never", [dataclasses.replace(spec("a"), model=str(broken))]),
                    owner="ann", priority=0)
    assert refused.value.status == 422
    assert "transformer" in str(refused.value) and "submit it again" in str(refused.value)
    assert not (tmp_path / "never").exists() and not farm.queue.batches(include_ended=True)

    jobs = [dataclasses.replace(spec(n), model=str(ckpt)) for n in ("a", "b")]
    cancelled = farm.actions.submit(_request(tmp_path / "out", jobs), owner="ann", priority=0)
    farm.actions.cancel(cancelled["id"])
    _serve_until_idle(farm)
    left = farm.actions.submit(_request(tmp_path / "left", [dataclasses.replace(spec("c"), model=str(ckpt))]),
                       owner="bob", priority=0)
    farm.close()  # before a step: its job is queued, the batch active
    shutil.rmtree(ckpt / "transformer")

    again, ex = _farm(tmp_path)
    with pytest.raises(FarmRequestError, match="transformer") as refused:
        again.actions.retry(cancelled["id"])
    assert refused.value.status == 422 and again.describe(cancelled["id"])["state"] == "cancelled"
    again.resume_unfinished()
    row = again.queue.get(left["id"])
    assert row.state is BatchState.STOPPED and "the checkpoint cannot be loaded" in row.reason
    _serve_until_idle(again)
    assert not ex.calls  # no group was asked for anything
    for out in ("out", "left"):
        led = Ledger.open_readonly(tmp_path / out)
        assert all(j.state is not JobState.DONE and j.attempts == 0 for j in led.jobs())
        led.close()
    again.close()


def test_a_batch_paused_while_its_last_job_runs_ends_when_that_job_ends(tmp_path: Path) -> None:
    """Pause stops new jobs; the running one finishes, and then nothing of the batch is left."""
    farm, _ = _farm(tmp_path, faults={"slow": {"job": "a", "stage": "encode", "seconds": 0.5}})
    b = farm.actions.submit(_request(tmp_path / "out", [spec("a")]), owner="ann", priority=0)
    while not farm.describe(b["id"])["running"]:
        farm.step()
    farm.actions.pause(b["id"], paused=True)  # (the encode runs on the worker's I/O thread meanwhile)
    _serve_until_idle(farm)
    d = farm.describe(b["id"])
    assert (d["state"], d["counts"]["done"], d["exit_code"]) == ("done", 1, 0)
    farm.close()


def _sampled(ex: RecordingExecutor) -> list[str | None]:
    return [name for kind, name in ex.calls if kind is SampleCall]


def test_raising_a_batchs_priority_puts_its_queued_jobs_ahead_of_a_lower_batchs(tmp_path: Path) -> None:
    """One GPU: the first batch's first job is running when the second batch is raised above it;
    the job running finishes, then every queued job of the raised batch goes before the first's."""
    farm, ex = _farm(tmp_path)
    first = farm.actions.submit(_request(tmp_path / "first", [spec("a1"), spec("a2")]), owner="ann", priority=0)
    second = farm.actions.submit(_request(tmp_path / "second", [spec("b1"), spec("b2")]), owner="bob", priority=0)
    step_until(farm, lambda: farm.describe(first["id"])["running"], "the first batch's first job running")
    farm.actions.set_priority(second["id"], 5)
    _serve_until_idle(farm)
    print("sampling order:", _sampled(ex))
    assert _sampled(ex) == ["a1", "b1", "b2", "a2"]
    farm.close()


def test_a_paused_batch_is_passed_over_while_another_is_served_and_served_after_unpause(tmp_path: Path) -> None:
    """The paused batch is first in the queue (higher priority): the batch behind it still runs."""
    farm, ex = _farm(tmp_path)
    held = farm.actions.submit(_request(tmp_path / "held", [spec("h1"), spec("h2")]), owner="ann", priority=5)
    farm.actions.pause(held["id"], paused=True)
    other = farm.actions.submit(_request(tmp_path / "other", [spec("o1"), spec("o2")]), owner="bob", priority=0)
    step_until(farm, lambda: farm.describe(other["id"])["state"] == "done", "the batch behind the paused one done")
    assert _sampled(ex) == ["o1", "o2"] and not _started(tmp_path / "held")
    farm.actions.pause(held["id"], paused=False)
    _serve_until_idle(farm)
    assert _sampled(ex) == ["o1", "o2", "h1", "h2"] and farm.describe(held["id"])["state"] == "done"
    farm.close()


def test_a_restart_keeps_cancelled_the_jobs_a_client_cancelled_in_a_batch_still_active(tmp_path: Path) -> None:
    """The batch is still active when the farm stops (one job done, one not yet): the farm started
    again renders the job left, not the one a client cancelled (as a retry or a submit again would)."""
    farm, _ = _farm(tmp_path)
    out = tmp_path / "out"
    b = farm.actions.submit(_request(out, [spec("a"), spec("b"), spec("c")]), owner="ann", priority=0)
    farm.actions.cancel(b["id"], job="c")
    step_until(farm, lambda: farm.describe(b["id"])["counts"]["done"] == 1, "one job done")
    assert farm.describe(b["id"])["state"] == "active"
    farm.close()
    again, ex = _farm(tmp_path)
    again.resume_unfinished()
    _serve_until_idle(again)
    d = again.describe(b["id"])
    print(d["state"], d["counts"], _sampled(ex))
    assert "c" not in _sampled(ex) and not (out / spec("c").job_id).exists()
    assert (d["state"], d["counts"]["done"], d["counts"]["cancelled"]) == ("cancelled", 2, 1)
    again.close()


def test_a_success_between_device_faults_keeps_the_group_in_service(tmp_path: Path) -> None:
    """A held-out GPU is one whose jobs fault in a row: x faults, y succeeds on the same group, x's
    retry faults again; with a limit of 2 the group is restarted each time, never held out."""
    farm, ex = _farm(tmp_path, device_fault_limit=2, retries=1,
                     faults={"fail": {"job": "x", "stage": "sampling", "raise": "DeviceError"}})
    b = farm.actions.submit(_request(tmp_path / "out", [spec("x"), spec("y")]), owner="ann", priority=0)
    _serve_until_idle(farm)
    d = farm.describe(b["id"])
    groups = [(g.id, state, g.faults) for g, state, _ in farm.scheduler.pool.describe()]
    print(_sampled(ex), d["counts"], groups)
    assert _sampled(ex) == ["x", "y", "x"] and (d["counts"]["done"], d["counts"]["failed"]) == (1, 1)
    assert [state for _, state, _ in groups] == ["idle"] and groups[0][2] == 1
    farm.close()
