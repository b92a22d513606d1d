"""Screenshots of the farm's web monitor for the README, from a real render.

    python scripts/monitor_screenshots.py --out docs            # docs/monitor-sweep.png, docs/monitor-failed.png

`pan2-render farm start --cpu-gpus 2` in a folder of its own (Ray, the embedded tiny model), then two
batches through `pan2-render submit`: a sweep of 3 seeds x 2 guidance scales, and a batch of two
jobs one of which fails its decode (the worker's fault hook, ``PAN2_RENDER_FAULTS``, so that the
monitor has a real traceback to show). Headless Chromium (Debian's, through Playwright) opens the
monitor with the token in the URL's fragment and takes one picture while the sweep runs and one of
the failed job with its traceback open. The farm is stopped at the end. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VIEWPORT = {"width": 1100, "height": 820}
WAIT_MS = 300_000  # the tiny model on 2 CPU cores, two groups sharing them
SWEEP = """model: tiny
preset: tiny-preview
defaults: {steps: 40}
jobs:
  - name: lantern
    prompt: A paper lantern drifts up into a starry night sky.
sweep:
  seed: [0, 1, 2]
  guidance: [2.5, 3.5]
"""
FAILING = """model: tiny
preset: tiny-preview
jobs:
  - name: harbour
    prompt: Fishing boats rock gently in a harbour at dusk.
  - name: broken
    prompt: This job's decode fails (a fault injected for the picture).
"""
FAULTS = {"fail": {"job": "broken", "stage": "decode"}}


def cli(args: list[str], env: dict[str, str], *, cwd: Path | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pan2render.runner.cli", *args], env=env, check=True, cwd=cwd)


def shoot(url: str, token: str, out: Path, *, sweep: str, failing: str) -> None:
    from playwright.sync_api import sync_playwright  # a test extra

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("needs Chromium: apt-get install chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(f"{url}/#token={token}")
        page.wait_for_selector("#show-ended", timeout=WAIT_MS)
        page.check("#show-ended")  # the failing batch stays listed once it ends
        page.wait_for_selector(f"#batch-{sweep}", timeout=WAIT_MS)
        page.click(f"#batch-{sweep} td.id button")
        # A moment with a video done, a sampling at step k/N with its rate, and jobs still waiting.
        page.wait_for_function(
            "() => [...document.querySelectorAll('#grids figure.cell img')].some(i => i.complete && i.naturalWidth)"
            " && [...document.querySelectorAll('#grids figure.cell')].some(f => / \\d+\\/\\d+ · /.test(f.textContent))",
            timeout=WAIT_MS, polling=100)
        page.screenshot(path=str(out / "monitor-sweep.png"))
        page.wait_for_selector(f"#batch-{failing} .badge.failed", timeout=WAIT_MS)
        page.click(f"#batch-{failing} td.id button")
        page.wait_for_selector("#jobs tr.error-row details.traceback", timeout=WAIT_MS)
        page.click("#jobs tr.error-row details.traceback summary")
        page.locator("#batch-section").scroll_into_view_if_needed()
        page.screenshot(path=str(out / "monitor-failed.png"))
        browser.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the two PNGs (docs/)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pan2-monitor-") as tmp:
        work = Path(tmp)
        root = work / "farm"
        env = {**os.environ, "PAN2_RENDER_FAULTS": json.dumps(FAULTS)}
        (work / "sweep.yaml").write_text(SWEEP)
        (work / "failing.yaml").write_text(FAILING)
        # Started in the work folder: the folders it reads batches' files from and writes into.
        cli(["farm", "start", "--root", str(root), "--cpu-gpus", "2"], env, cwd=work)
        try:
            info: dict[str, Any] = json.loads((root / "farm.json").read_text())
            token = (root / "token").read_text().strip()
            cli(["submit", str(work / "sweep.yaml"), "--out", str(work / "sweep"), "--root", str(root),
                 "--priority", "5"], env)
            cli(["submit", str(work / "failing.yaml"), "--out", str(work / "failing"), "--root", str(root)], env)
            time.sleep(0.5)
            shoot(info["url"], token, args.out, sweep="b1", failing="b2")
        finally:
            cli(["farm", "stop", "--root", str(root)], env)
    for name in ("monitor-sweep.png", "monitor-failed.png"):
        print(f"{args.out / name}: {(args.out / name).stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
