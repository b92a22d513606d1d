"""The live progress on a real terminal of 80 columns (tmux): rows longer than the terminal are cut,
not wrapped, so redrawing in place leaves no stale row behind, also when other output (Ray's
forwarded worker lines) lands between redraws. Negative control: the same run with rows left
uncut leaves stale rows in the scrollback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")

SCRIPT = r'''
import sys, time
from pathlib import Path
from pan2render.runner.serve import progress
from pan2render.runner.serve.progress import RunLog, RunProgress
from pan2render.runner.protocol.steps import StepReport

if sys.argv[1] == "uncut":
    progress.fit = lambda text, width: text
log = RunLog(None, stream=sys.stderr)
p = RunProgress(log=log, live=True, redraw_every_s=0.0)
p.begin(total=9, done=0, failed=0)
ids = [f"a-rather-long-job-name-from-its-prompt-flow_shift5.0-guidance{g}-0123abcd" for g in (2.5, 3.5, 4.5)]
for n, job in enumerate(ids):
    p.job_started(job, group=f"g{n}x1", attempt=1)
    p.stage(job, "sampling")
for step in range(1, 13):
    now = time.time()
    p.steps({job: StepReport(done=step, total=50, window=((1, now - step), (step, now))) for job in ids})
    p.tick()
    if step == 6:
        print("(RayWorkerProcess pid=4242) a line a worker printed", file=sys.stderr, flush=True)
    time.sleep(0.02)
for job in ids:
    p.job_ended(job, "done")
p.close()
Path(sys.argv[2]).write_text("finished")
'''


def _scrollback(tmp_path: Path, mode: str) -> list[str]:
    script = tmp_path / "draw.py"
    script.write_text(SCRIPT)
    marker = tmp_path / f"finished-{mode}"
    socket = f"pan2-test-{os.getpid()}-{mode}"
    env_path = os.pathsep.join([str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")])
    command = f"PYTHONPATH={env_path} {sys.executable} {script} {mode} {marker}; sleep 60"
    tmux = ["tmux", "-L", socket, "-f", os.devnull]
    subprocess.run([*tmux, "new-session", "-d", "-x", "80", "-y", "40", command], check=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline, "the drawing script did not finish"
            time.sleep(0.1)
        time.sleep(0.2)
        shown = subprocess.run([*tmux, "capture-pane", "-p", "-J", "-S", "-", "-E", "-"], check=True,
                               capture_output=True, text=True).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    return [line for line in shown.splitlines() if line.strip()]


@pytest.mark.parametrize("mode", ["cut", "uncut"])
def test_progress_on_80_columns_leaves_no_stale_row(tmp_path: Path, mode: str) -> None:
    lines = _scrollback(tmp_path, mode)
    print("\n".join(lines))
    stale = [line for line in lines if line.startswith(("  g", "jobs "))]
    events = [line for line in lines if line.startswith(("start  ", "stage  ", "done   ", "(RayWorkerProcess"))]
    assert len(events) == 3 + 3 + 3 + 1  # every event line and the foreign line are kept, once each
    if mode == "cut":
        assert stale == [], "rows of the redrawn block were left behind"
    else:  # the control: wrapped rows are more terminal lines than the redraw moves up over
        assert stale, "uncut rows left no stale row: this test could not tell"
