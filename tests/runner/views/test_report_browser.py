"""The report in a real browser: headless Chromium loads the quickstart's index.html and every
video reaches HAVE_METADATA (Debian's Chromium decodes our H.264 mp4s). Skipped without Chromium;
CI installs it (.ci/run).

The quickstart batch is rendered in-process with the fake pipeline: the same jobs, sizes, encoder
and page as `make run`, other pixels, in seconds instead of the tiny model's minutes on 2 cores."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from runner_helpers import CHROMIUM

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import Ledger
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.protocol.messages import WorkerConfig
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver
from pan2render.runner.views.report import write_report
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY

QUICKSTART = Path(__file__).resolve().parents[3] / "jobs" / "quickstart.yaml"
HAVE_METADATA = 1

# Appended to a copy of the page (the report itself has no script): asks every <video> to load,
# waits for its metadata or its error, and writes what it saw into the DOM that Chromium dumps.
_PROBE = """<script>
(async () => {
  const seen = await Promise.all([...document.querySelectorAll("video")].map(v => new Promise(done => {
    const report = () => done({src: v.getAttribute("src"), readyState: v.readyState,
                               error: v.error && v.error.code, width: v.videoWidth, height: v.videoHeight});
    v.addEventListener("loadedmetadata", report, {once: true});
    v.addEventListener("error", report, {once: true});
    setTimeout(report, 20000);
    v.load();
  })));
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify(seen);
  document.body.appendChild(out);
})();
</script>"""


def _videos_in_chromium(page: Path) -> list[dict]:
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--mute-audio",
         "--virtual-time-budget=30000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True).stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, f"the probe never reported; Chromium's DOM ends with: {dom[-500:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_quickstart_report_videos_play_in_headless_chromium(tmp_path: Path) -> None:
    out = tmp_path / "quickstart"
    out.mkdir()
    specs = load_batch(QUICKSTART).jobs
    ledger = Ledger.open(out)
    ledger.add_jobs(specs, retries=0)
    ex = LocalExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    summary = Driver(out_dir=out, ledger=ledger, executor=ex,
                     config=ServingConfig(retries=0, progress=False)).run([s.job_id for s in specs])
    ledger.close()
    assert summary.exit_code == 0 and len(summary.done) == len(specs) == 6

    page = write_report(out)
    probe = out / "_probe.html"  # beside index.html, so the relative links resolve the same way
    (out / "not-a-video.mp4").write_bytes(b"\x00" * 4096)  # negative control: this one cannot play
    probe.write_text(page.read_text().replace(
        "</body>", '<video src="not-a-video.mp4" preload="none"></video>' + _PROBE + "</body>"))
    seen = _videos_in_chromium(probe)
    print(json.dumps(seen, indent=1))
    videos, control = seen[:-1], seen[-1]
    assert sorted(v["src"] for v in videos) == sorted(f"{s.job_id}/video.mp4" for s in specs)
    for v in videos:
        assert v["error"] is None and v["readyState"] >= HAVE_METADATA, v
        assert (v["width"], v["height"]) == (64, 64)
    assert control["readyState"] == 0 and control["error"] is not None  # the check can fail
