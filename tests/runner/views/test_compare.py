"""`pan2-render compare` and the report on a folder holding an exact job and fast-lane versions of
it (the fake pipeline renders a fast job a little off the exact one): PSNR / SSIM against an
independent computation on the two videos, sampling seconds from the ledger, params.json's plan."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from runner_helpers import render, spec

from pan2render.jobs.ledger import Ledger, Stage
from pan2render.media.quality import psnr, read_frames, ssim
from pan2render.runner.views.compare import QUALITY_NAME, comparisons, lane_pairs
from pan2render.runner.views.report import write_report


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    out = tmp_path_factory.mktemp("lanes")
    exact = spec("fox", steps=8)
    cached = dataclasses.replace(exact, cache="magcache", sweep={"cache": "magcache"})
    gated = dataclasses.replace(exact, guidance_until=0.5, sweep={"guidance_until": 0.5})
    other_seed = dataclasses.replace(exact, seed=9, cache="magcache", sweep={"seed": 9})  # no exact partner
    summary, _, ledger = render(out, [exact, cached, gated, other_seed])
    ledger.close()
    return out, {"exact": exact, "cached": cached, "gated": gated, "other": other_seed}


def test_compare_pairs_each_fast_video_with_its_exact_one(folder) -> None:
    out, jobs = folder
    ledger = Ledger.open_readonly(out)
    try:
        pairs = {(f.id, e.id) for f, e in lane_pairs(ledger.jobs())}
        rows = {r.job_id: r for r in comparisons(out, ledger)}
        seconds = {j.job_id: ledger.stages(j.job_id)[Stage.SAMPLING].seconds for j in jobs.values()}
    finally:
        ledger.close()
    exact = jobs["exact"].job_id
    assert pairs == {(jobs["cached"].job_id, exact), (jobs["gated"].job_id, exact)}
    ref = read_frames(out / exact / "video.mp4")
    for key in ("cached", "gated"):
        row = rows[jobs[key].job_id]
        video = read_frames(out / row.job_id / "video.mp4")
        print(key, row.summary())
        assert row.psnr_db == pytest.approx(psnr(video, ref), abs=1e-3) and not math.isinf(row.psnr_db)
        assert row.ssim == pytest.approx(ssim(video, ref), abs=1e-5) and row.ssim < 1.0
        assert row.sampling_s == seconds[row.job_id] and row.exact_sampling_s == seconds[exact]
        assert json.loads((out / row.job_id / QUALITY_NAME).read_text())["ssim"] == round(row.ssim, 5)
    params = json.loads((out / jobs["cached"].job_id / "params.json").read_text())
    assert params["fast_lanes"]["settings"]["cache"] == "magcache"
    assert params["fast_lanes"]["forwards"] == len(params["fast_lanes"]["cond_computed"]) + len(
        params["fast_lanes"]["uncond_computed"]) < 16
    assert json.loads((out / exact / "params.json").read_text())["fast_lanes"] is None


def test_the_cli_and_the_report_show_the_same(folder) -> None:
    out, jobs = folder
    cmd = [sys.executable, "-m", "pan2render.runner.cli", "compare", str(out), "--json"]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    assert {r["job_id"] for r in rows} == {jobs["cached"].job_id, jobs["gated"].job_id}
    text = subprocess.run(cmd[:-1], check=True, capture_output=True, text=True).stdout
    assert "PSNR dB" in text and "cache=magcache" in text and "guidance_until=0.5" in text
    page = write_report(out).read_text()
    for r in rows:
        assert f"vs exact: PSNR {r['psnr_db']:.2f} dB, SSIM {r['ssim']:.4f}" in page


@pytest.mark.parametrize(("fast_s", "exact_s", "shown"), [(3.732, 2.0, "0.54x"), (2.0, 3.94, "1.97x")])
def test_the_speed_up_is_exact_over_fast_and_named_so(fast_s: float, exact_s: float, shown: str) -> None:
    """A fast-lane job 1.87 times slower than its exact job shows a speed-up of 0.54x, never 1.87x
    (a ratio users read as a speed-up); one twice as fast, ~2x. In the table, the JSON and the report."""
    from pan2render.runner.views.compare import LaneComparison, format_comparisons

    row = LaneComparison(job_id="fox-cache-magcache-12345678", name="fox", lanes={"cache": "magcache"},
                         exact_id="fox-87654321", psnr_db=30.0, ssim=0.9, sampling_s=fast_s, exact_sampling_s=exact_s)
    assert row.speed_up == pytest.approx(exact_s / fast_s)
    doc = row.to_json()
    assert doc["speed_up"] == pytest.approx(exact_s / fast_s) and "speed_ratio" not in doc
    text = format_comparisons([row])
    print(text)
    header, line = text.splitlines()[:2]
    assert header.rstrip().endswith("speed-up (exact / fast)") and line.rstrip().endswith(shown)
    assert row.summary().endswith(f"speed-up {shown}")
