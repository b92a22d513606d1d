"""What each fast lane cost: a fast video against the exact one of the same job (``pan2-render compare``).

A job is *fast* when one of its fast-lane fields (``pan2render.lanes.FAST_LANE_FIELDS``) is away
from the exact path; its *exact* partner is the done job that is the same in every other field
(prompt, seed, size, steps, ...) with every fast-lane field at its default. For each such pair of
finished videos this gives the fast video's PSNR and SSIM against the exact one
(``pan2render.media.quality``) and both jobs' sampling seconds (the ledger's). The measure is
kept in ``DIR/<fast job>/quality.json`` with the digests of the two videos it was taken on, so the
report and later calls reuse it until either video changes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pan2render.jobs.ledger import JobRecord, JobState, Ledger, Stage
from pan2render.jobs.spec import JobSpec
from pan2render.lanes import FAST_LANE_FIELDS, FastLanes
from pan2render.runner.protocol import artifacts as st

QUALITY_NAME = "quality.json"
_EXACT = {name: getattr(FastLanes(), name) for name in FAST_LANE_FIELDS}


@dataclass(frozen=True)
class LaneComparison:
    """One fast video against its exact partner."""

    job_id: str
    name: str
    lanes: dict[str, Any]  # the fast-lane fields away from the exact path
    exact_id: str
    psnr_db: float  # inf: identical videos
    ssim: float
    sampling_s: float | None
    exact_sampling_s: float | None

    @property
    def speed_up(self) -> float | None:
        """How many times faster this job sampled than the exact job: the exact job's sampling
        seconds over this one's (above 1 faster, below 1 slower; a ratio the other way round read
        as a speed-up once, for a job 1.87 times slower)."""
        if not self.sampling_s or not self.exact_sampling_s:
            return None
        return self.exact_sampling_s / self.sampling_s

    def summary(self) -> str:
        """One line, as the report shows it beside the fast video."""
        psnr = "identical" if math.isinf(self.psnr_db) else f"PSNR {self.psnr_db:.2f} dB"
        up = self.speed_up
        speed = "" if up is None else (f", sampling {self.sampling_s:.1f} s against the exact job's "
                                       f"{self.exact_sampling_s:.1f} s: speed-up {up:.2f}x")
        return f"vs exact: {psnr}, SSIM {self.ssim:.4f}{speed}"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "psnr_db": None if math.isinf(self.psnr_db) else self.psnr_db,
                "speed_up": self.speed_up}


def _lanes(spec: JobSpec) -> dict[str, Any]:
    return {k: getattr(spec, k) for k in FAST_LANE_FIELDS if getattr(spec, k) != _EXACT[k]}


def _exact_key(spec: JobSpec) -> str:
    """The id hash of the job with every fast-lane field at its default: what its partner has."""
    return dataclasses.replace(spec, **_EXACT).spec_hash


def lane_pairs(jobs: list[JobRecord]) -> list[tuple[JobRecord, JobRecord]]:
    """(fast job, its exact partner) for every done fast job whose partner is done too (the newest
    version of a partner when the folder holds several)."""
    done = sorted((j for j in jobs if j.state is JobState.DONE), key=lambda j: j.position)
    exact = {j.spec_hash: j for j in done if not _lanes(j.spec)}
    return [(j, exact[_exact_key(j.spec)]) for j in done if _lanes(j.spec) and _exact_key(j.spec) in exact]


def _video(out_dir: Path, ledger: Ledger, job: JobRecord) -> tuple[Path, str]:
    rec = ledger.stages(job.id)[Stage.ENCODE]
    return out_dir / str(rec.artifact), str(rec.sha256)


def _measured(out_dir: Path, fast: tuple[Path, str], exact: tuple[Path, str], job_id: str) -> dict[str, Any]:
    """The quality of ``fast``'s video against ``exact``'s, from quality.json or measured now."""
    from pan2render.media.quality import VideoQuality, compare_videos  # PyAV

    rel = f"{job_id}/{QUALITY_NAME}"
    key = {"video_sha256": fast[1], "reference_sha256": exact[1]}
    try:
        kept = json.loads((out_dir / rel).read_text())
        if {k: kept.get(k) for k in key} == key:
            return VideoQuality.from_json(kept).to_json()
    except (OSError, ValueError, KeyError, TypeError):
        pass  # measured again below
    doc = {**key, **compare_videos(fast[0], exact[0]).to_json()}
    st.write_artifact(out_dir, rel, (json.dumps(doc, indent=2) + "\n").encode())
    return doc


def comparisons(out_dir: Path, ledger: Ledger, *, say: Callable[[str], None] | None = None) -> list[LaneComparison]:
    """Every fast video of the folder against its exact partner (see the module doc)."""
    rows = []
    for fast, exact in lane_pairs(ledger.jobs()):
        if say is not None:
            say(f"comparing {fast.id} with {exact.id}")
        q = _measured(out_dir, _video(out_dir, ledger, fast), _video(out_dir, ledger, exact), fast.id)
        rows.append(LaneComparison(
            job_id=fast.id, name=fast.name, lanes=_lanes(fast.spec), exact_id=exact.id,
            psnr_db=math.inf if q["psnr_db"] is None else float(q["psnr_db"]), ssim=float(q["ssim"]),
            sampling_s=ledger.stages(fast.id)[Stage.SAMPLING].seconds,
            exact_sampling_s=ledger.stages(exact.id)[Stage.SAMPLING].seconds))
    return rows


def format_comparisons(rows: list[LaneComparison]) -> str:
    """The table ``pan2-render compare`` prints."""
    from pan2render.runner.views.format import table

    if not rows:
        return ("no fast-lane jobs with an exact partner here: a job with cache, guidance_until or precision "
                "away from the default is compared with the done job that differs from it in those fields only")

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    body = [[r.name, r.job_id[-8:], ", ".join(f"{k}={v}" for k, v in r.lanes.items()),
             "inf" if math.isinf(r.psnr_db) else f"{r.psnr_db:.2f}", f"{r.ssim:.4f}", s(r.sampling_s),
             s(r.exact_sampling_s), "-" if r.speed_up is None else f"{r.speed_up:.2f}x"] for r in rows]
    return table(["job", "id", "fast lanes", "PSNR dB", "SSIM", "sampling s", "exact s", "speed-up (exact / fast)"],
                 body)
