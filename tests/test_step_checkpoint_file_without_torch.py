"""The step-checkpoint format (pan2render.step_checkpoint) is checked without torch: the runner's
driver, which never imports it, tells a usable checkpoint from a stale or damaged one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from pan2render.models.sampler_state import SamplerState, pack_sampler_state
from pan2render.models.samplers import StepState
from pan2render.step_checkpoint import CheckpointKey

_CHECK_WITHOUT_TORCH = """
import sys
from pathlib import Path
from pan2render.step_checkpoint import checkpoint_problem, read_checkpoint
data = Path(sys.argv[1]).read_bytes()
header, arrays = read_checkpoint(data, spec_hash="f" * 64)
print("step", header.step, "of", header.key.total_steps, "tensors", sorted(arrays))
print("other job:", checkpoint_problem(data, spec_hash="e" * 64))
bad = bytearray(data); bad[-1] ^= 1
print("flipped:", checkpoint_problem(bytes(bad)))
assert sys.modules["torch"] is None, "checking a step checkpoint imported torch"
"""


def test_the_driver_checks_a_step_checkpoint_without_torch(tmp_path: Path) -> None:
    key = CheckpointKey(model_id="m-1", sampler="unipc", total_steps=5, latent_shape=(1, 2, 1, 2, 2), seed=3,
                        guidance=2.5)
    latents = torch.randn(key.latent_shape)
    state = SamplerState(key=key, latents=latents, schedule=torch.linspace(1, 0, 6),
                         generator=torch.Generator().manual_seed(3).get_state(),
                         sampler=StepState(step=2, tensors={"x0.0": latents * 2, "x0.1": latents * 3,
                                                            "last_sample": latents + 1},
                                           counters={"last_order": 2}))
    path = tmp_path / "sampling.ckpt.safetensors"
    path.write_bytes(pack_sampler_state(state, spec_hash="f" * 64))
    blocker = "import sys; sys.modules['torch'] = None\n"  # any import of torch now fails
    done = subprocess.run([sys.executable, "-c", blocker + _CHECK_WITHOUT_TORCH, str(path)],
                          capture_output=True, text=True, timeout=60)
    print(done.stdout, done.stderr)
    assert done.returncode == 0, done.stderr
    assert "step 2 of 5 tensors ['generator', 'latents', 'sampler.last_sample', 'sampler.x0.0', " \
           "'sampler.x0.1', 'schedule']" in done.stdout
    assert "other job: stale: it belongs to spec_hash 'ffffffffffff', this sampling's is 'eeeeeeeeeeee'" \
        in done.stdout
    assert "flipped: damaged: its sha256 does not match its contents" in done.stdout
