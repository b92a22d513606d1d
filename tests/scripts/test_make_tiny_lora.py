"""`scripts/make_tiny_lora.py` (the README's recipe for a LoRA that fits the tiny model) writes a
file the batch check accepts against the tiny DiT, and that changes what the tiny model renders."""

from __future__ import annotations

import runpy
from pathlib import Path

from pan2render.jobs.batch import load_batch
from pan2render.models.pipeline import PAN2Pipeline, PAN2PipelineConfig

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_lora.py"


def test_the_recipes_lora_fits_the_tiny_model_and_changes_its_render(tmp_path: Path) -> None:
    make = runpy.run_path(str(SCRIPT))["main"]
    lora = tmp_path / "loras" / "tiny-style.safetensors"
    assert make([str(lora), "--rank", "2", "--seed", "3"]) == 0
    batch = tmp_path / "b.yaml"
    batch.write_text("model: tiny\npreset: tiny-preview\ndefaults:\n  loras: [{path: loras/tiny-style.safetensors, "
                     "scale: 0.5}]\njobs:\n  - prompt: a fox\n")
    (job,) = load_batch(batch).jobs  # checked against the tiny DiT's layers and shapes
    assert job.loras[0].scale == 0.5 and job.lora_digests

    pipe = PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cpu"))
    args = dict(prompt="a fox", height=32, width=32, frames=5, steps=2, guidance=2.5, seed=0)
    plain = pipe.sample(**args)
    assert pipe.set_loras([(pipe.read_lora(lora), 0.5)])
    adapted = pipe.sample(**args)
    rel = float((adapted - plain).norm() / plain.norm())
    print(f"the adapter at 0.5 moves the latents by {rel:.3f} (relative L2)")
    assert rel > 1e-3
