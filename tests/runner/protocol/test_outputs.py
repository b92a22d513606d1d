"""params.json beside every video, the mp4's own tags, and params.json checked on resume."""

from __future__ import annotations

import json
from pathlib import Path

import av

from pan2render.jobs.ledger import Ledger, Stage
from pan2render.jobs.spec import JobSpec
from pan2render.runner.cluster.local_executor import LocalExecutor
from pan2render.runner.protocol import outputs
from pan2render.runner.protocol.messages import WorkerConfig
from pan2render.runner.serve.config import ServingConfig
from pan2render.runner.serve.driver import Driver
from pan2render.runner.worker.fake_pipeline import FAKE_FACTORY


def swept(name: str, *, guidance: float, seed: int) -> JobSpec:
    return JobSpec(name=name, model="tiny", prompt=f"a clip of {name}", negative_prompt="blurry",
                   image=None, image_sha256=None, seed=seed, steps=3, guidance=guidance, height=32,
                   width=48, frames=9, fps=8.0, flow_shift=5.0, sampler="unipc", gpus=1, crf=18,
                   preset="tiny-preview", sweep={"guidance": guidance, "seed": seed})


def render(out: Path, jobs: list[JobSpec]) -> Ledger:
    out.mkdir(exist_ok=True)
    ledger = Ledger.open(out)
    ledger.add_jobs(jobs, retries=1)
    ex = LocalExecutor(gpus=1, config=WorkerConfig(pipeline_factory=FAKE_FACTORY))
    summary = Driver(out_dir=out, ledger=ledger, executor=ex,
                     config=ServingConfig(retries=1, progress=False, poll_s=0.01)).run([j.job_id for j in jobs])
    assert summary.exit_code == 0, summary
    return ledger


def test_params_json_of_a_swept_job(tmp_path: Path) -> None:
    job = swept("fox", guidance=3.5, seed=1)
    ledger = render(tmp_path, [job])
    doc = json.loads((tmp_path / job.job_id / "params.json").read_text())
    print(json.dumps(doc, indent=1))
    assert doc["job_id"] == job.job_id and doc["spec_hash"] == job.spec_hash
    assert doc["sweep"] == {"guidance": 3.5, "seed": 1}
    # Every field of the resolved spec, with the values that rendered it.
    assert set(doc["spec"]) == set(job.to_dict())
    assert (doc["spec"]["guidance"], doc["spec"]["prompt"], doc["seed"]) == (3.5, "a clip of fox", 1)
    assert doc["model"]["model"] == "tiny" and doc["model"]["model_id"].startswith("fake-")
    sampler = doc["sampler"]
    assert (sampler["name"], sampler["steps"], sampler["flow_shift"]) == ("unipc", 3, 5.0)
    sigmas = sampler["sigmas"]
    assert len(sigmas) == 3 and 1.0 > sigmas[0] > sigmas[1] > sigmas[2] > 0  # shifted, decreasing
    assert doc["attempts"] == 1
    recorded = {s.value: r.seconds for s, r in ledger.stages(job.job_id).items()}
    assert set(doc["seconds"]) == {s.value for s in Stage}
    assert all(doc["seconds"][k] == (None if v is None else round(v, 3)) for k, v in recorded.items())
    assert recorded["interpolate"] is None  # (a job that does not interpolate spends no time there)
    assert doc["gpu_layout"]["group_size"] == 1 and doc["gpu_layout"]["device"] == "cpu"
    assert doc["gpu_layout"]["decode"] == "fake"  # what the group's pipeline reported on load
    assert doc["versions"]["pan2-render"] and doc["versions"]["torch"]
    assert doc["created_at"].endswith("Z")
    # The ledger holds the very text on disk (what resume checks against).
    assert ledger.document(job.job_id, "params.json") == (tmp_path / job.job_id / "params.json").read_text()


def test_mp4_tags_read_back_with_pyav(tmp_path: Path) -> None:
    job = swept("harbour", guidance=2.0, seed=0)
    render(tmp_path, [job])
    with av.open(str(tmp_path / job.job_id / "video.mp4")) as container:
        tags = dict(container.metadata)
    print(tags)
    assert tags["title"] == "harbour" and tags["comment"] == "a clip of harbour"
    spec = json.loads(tags[outputs.MP4_PARAMS_KEY])
    assert spec["job_id"] == job.job_id and spec["spec_hash"] == job.spec_hash
    assert {k: spec[k] for k in ("seed", "guidance", "steps", "sampler", "sweep")} == {
        "seed": 0, "guidance": 2.0, "steps": 3, "sampler": "unipc", "sweep": {"guidance": 2.0, "seed": 0}}


def test_truncated_params_json_is_detected_and_rewritten_on_resume(tmp_path: Path) -> None:
    jobs = [swept("a", guidance=2.0, seed=0), swept("a", guidance=3.0, seed=0)]
    render(tmp_path, jobs).close()
    cut, gone = (tmp_path / j.job_id / "params.json" for j in jobs)
    good = cut.read_bytes()
    video = tmp_path / jobs[0].job_id / "video.mp4"
    mtime = video.stat().st_mtime_ns
    cut.write_bytes(good[: len(good) // 2])
    gone.unlink()

    ledger = render(tmp_path, jobs)  # a re-run: both jobs done, only their params.json damaged
    assert cut.read_bytes() == good and json.loads(gone.read_text())["job_id"] == jobs[1].job_id
    assert video.stat().st_mtime_ns == mtime  # the video was not rendered again
    reasons = [e.detail for e in ledger.events(jobs[0].job_id) if e.label == "params-rewritten"]
    print(reasons, [e.detail for e in ledger.events(jobs[1].job_id) if e.label == "params-rewritten"])
    assert reasons and "differs from the ledger's copy" in reasons[0]
    assert all(ledger.job(j.job_id).attempts == 1 for j in jobs)
