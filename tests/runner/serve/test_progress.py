"""Progress that tells the truth: the step rate measured where the steps happen, a row per running
group with its job's stage, the overall row, minute summaries off a terminal, run.log."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

from pan2render.jobs.batch import load_batch
from pan2render.runner.protocol.messages import LoadCall, SampleCall, WorkerConfig
from pan2render.runner.protocol.steps import StepClock, StepReport
from pan2render.runner.serve.progress import RunLog, RunProgress
from pan2render.runner.worker import packing
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY, FakePipeline
from pan2render.runner.worker.render_worker import RenderWorker


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_step_rate_equals_steps_over_seconds_on_a_slow_fake_model(tmp_path: Path, monkeypatch) -> None:
    """A worker samples 12 steps of 0.15 s on a thread, reporting to a StepClock (what the Ray
    executor's progress actor is); the driver-side progress polls it every 0.4 s, as seldom as the
    scheduling loop may. The rate shown must be the sampling's steps / seconds within 10%."""
    monkeypatch.setenv("PAN2_FAKE_STEP_SECONDS", "0.15")
    clock = StepClock()
    worker = RenderWorker(rank=0, world_size=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY),
                          progress=clock)
    batch = tmp_path / "b.yaml"
    batch.write_text("model: tiny\npreset: tiny-preview\ndefaults: {steps: 12, height: 32, width: 32, frames: 5}\n"
                     "jobs: [{name: slow, prompt: x}]\n")
    spec = load_batch(batch).jobs[0]
    emb = packing.pack_embedding(FakePipeline("tiny").encode_prompt("x"), key="k", text_encoder_id="fake-text-v1")
    worker.execute(LoadCall(model="tiny"))
    reply: dict = {}

    def sample() -> None:
        t0 = time.perf_counter()
        reply["r"] = worker.execute(SampleCall(model="tiny", job_id=spec.job_id, spec=spec,
                                               prompt_embeds=emb, negative_embeds=emb))
        reply["seconds"] = time.perf_counter() - t0

    progress = RunProgress(log=RunLog(None, stream=io.StringIO()))
    progress.begin(total=1, done=0, failed=0)
    progress.job_started(spec.job_id, group="g0x1", attempt=1)
    progress.stage(spec.job_id, "sampling")
    thread = threading.Thread(target=sample)
    thread.start()
    shown = []
    while thread.is_alive():
        time.sleep(0.4)
        progress.steps(clock.snapshot())
        shown.append(progress.group_rows()[0])
    thread.join()
    progress.steps(clock.snapshot())
    assert reply["r"].ok, reply["r"].failure
    true_rate = 12 / reply["seconds"]
    row = progress.group_rows()[0]
    print("\n".join(shown), f"\nfinal: {row}; true {true_rate:.2f} step/s")
    assert row.startswith("  g0x1     sampling 12/12 ") and row.endswith(f"step/s  {spec.job_id}")
    rate = float(row.split()[-3])
    assert abs(rate - true_rate) / true_rate < 0.10
    # It is a rate over the steps done, not a counter: mid-run rows say the same within 10%.
    mid = [float(r.split()[-3]) for r in shown if "step/s" in r and "12/12" not in r]
    assert mid and all(abs(m - true_rate) / true_rate < 0.10 for m in mid)


def test_a_retried_job_restarts_its_step_clock() -> None:
    clock = StepClock()
    for k in (1, 2, 3):
        clock.report("j", k, 3)
    first = clock.snapshot()["j"].first_at
    time.sleep(0.01)
    clock.report("j", 1, 3)
    again = clock.snapshot()["j"]
    assert again.done == 1 and again.first_at > first and again.rate is None


def test_plain_lines_per_event_and_a_summary_each_minute(tmp_path: Path) -> None:
    clock = _Clock()
    stream = io.StringIO()
    log = RunLog(tmp_path / "run.log", stream=stream)
    p = RunProgress(log=log, clock=clock)
    p.begin(total=4, done=1, failed=0)
    p.job_started("a-1", group="g0x1", attempt=1)
    p.stage("a-1", "conditioning")
    p.stage("a-1", "conditioning")  # no change: no line
    p.job_started("b-2", group="g1x2", attempt=2)
    p.stage("b-2", "decode+encode")
    clock.t += 30
    p.tick()  # under a minute: no summary yet
    p.job_ended("a-1", "done")
    clock.t += 31
    p.tick()
    p.tick()  # once per minute
    log.close()
    lines = stream.getvalue().splitlines()
    print("\n".join(lines))
    assert lines[:5] == ["start  a-1  on g0x1", "stage  a-1  conditioning", "start  b-2  on g1x2, attempt 2",
                         "stage  b-2  decode+encode", "done   a-1"]
    # 2 of 4 jobs finished, 1 of them in this run's 61 s: 2 left take ~122 s.
    assert lines[5] == ("[progress] jobs 2/4: 2 done, 0 failed, 1 running, 1 waiting; elapsed 1m01s, ETA 2m02s; "
                        "g1x2 b-2: decode+encode 1m01s")
    assert len(lines) == 6
    logged = (tmp_path / "run.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in logged] == lines


def test_terminal_block_has_a_row_per_group_and_redraws_in_place() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    clock = _Clock()
    stream = Tty()
    log = RunLog(None, stream=stream)
    assert log.is_terminal
    p = RunProgress(log=log, live=True, clock=clock)
    p.begin(total=3, done=0, failed=0)
    p.job_started("a", group="g0x1", attempt=1)
    p.job_started("b", group="g1x1", attempt=1)
    p.stage("a", "sampling")
    assert p.group_rows() == ["  g0x1     sampling 0s  a", "  g1x1     starting 0s  b"]
    assert p.overall().startswith("jobs 0/3: 0 done, 0 failed, 2 running, 1 waiting; elapsed 0s, ETA ?")
    p.close()
    out = stream.getvalue()
    assert "\x1b[3F\x1b[J" in out  # the 3-line block (2 groups + overall) cleared before the next line
    assert out.endswith("\x1b[J")  # closed: the block is gone, the event lines stay


def test_a_stream_that_went_away_still_logs_to_the_file(tmp_path: Path) -> None:
    class Gone(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError(5, "Input/output error")  # a terminal after SIGHUP

    log = RunLog(tmp_path / "run.log", stream=Gone())
    log.line("one")
    log.line("two")
    log.close()
    assert [line.split(" ", 1)[1] for line in (tmp_path / "run.log").read_text().splitlines()] == ["one", "two"]


def test_the_step_rate_is_the_recent_steps_not_the_whole_sampling() -> None:
    """A first step that compiled for 10 s, then 2 steps a second: after 20 steps the rate shown is
    the recent 2 step/s, where steps over the whole sampling would say about 1. The steps are
    stamped by the worker (``at``), so reports that arrive in one burst keep their spacing."""
    clock = StepClock()
    clock.report("j", 1, 50, at=100.0)
    for k in range(2, 21):
        clock.report("j", k, 50, at=110.0 + 0.5 * (k - 2))
    rep = clock.snapshot()["j"]
    whole = (rep.done - 1) / (rep.last_at - 100.0)
    print(f"window {rep.rate:.2f} step/s, whole sampling {whole:.2f} step/s")
    assert abs(rep.rate - 2.0) < 1e-9 and whole < 1.1


def test_running_lists_each_job_at_its_stage_with_its_steps() -> None:
    """What the farm's snapshot (and so the web monitor) shows per running job."""
    clock = _Clock()
    p = RunProgress(log=RunLog(None, stream=None), clock=clock)
    p.begin(total=2, done=0, failed=0)
    p.job_started("a", group="g0", attempt=1)
    p.job_started("b", group="g1", attempt=1)
    p.stage("a", "sampling")
    clock.t += 2.5
    p.steps({"a": StepReport(done=5, total=8, window=((1, 10.0), (5, 12.0))),
             "b": StepReport(done=3, total=8, window=((1, 0.0), (3, 1.0)))})
    rows = {r.job_id: r for r in p.running()}
    assert rows["a"].stage == "sampling" and (rows["a"].steps.done, rows["a"].steps.total) == (5, 8)
    assert rows["a"].steps.rate == 2.0 and p.stage_seconds(rows["a"]) == 2.5
    assert rows["b"].stage == "starting" and rows["b"].steps is None  # (steps count only while sampling)
    p.job_ended("a", "done")
    assert [r.job_id for r in p.running()] == ["b"]
