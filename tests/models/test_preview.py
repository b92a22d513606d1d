"""Live previews on one process: they arrive at the requested cadence with increasing steps, hold the
sampler's own clean estimate for the frames they show, and never change the sampling's latents; the
latent -> RGB map fitted on the tiny model beats a grey picture and a map fitted for another VAE,
and the fit recovers a known linear decode exactly.

CPU, the embedded tiny model (random weights); seconds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_clock import FakeClock
from tiny_requests import IMAGE, REQUESTS, SIZE

from pan2render.models import PAN2Pipeline
from pan2render.models import pipeline as pipeline_module
from pan2render.models.preview import (
    FitSamples,
    PreviewHook,
    PreviewLatents,
    RgbMap,
    calibrate_rgb_map,
    fit_rgb_map,
    grey_map,
    preview_frames,
    preview_psnr,
    rgb_map_path,
    store_rgb_map,
    stored_rgb_map,
    vae_rgb_map,
)

EVERY_BOUNDARY = 1e-9  # s: a preview due at every step boundary


def steps_of(req: dict) -> int:
    return len(req["timesteps"]) if "timesteps" in req else req["steps"]


# ---------------------------------------------------------------------------------- when they come
def test_a_preview_is_due_after_that_many_seconds_of_sampling() -> None:
    clock, taken = FakeClock(0.0), []

    def on_preview(p: PreviewLatents) -> None:
        taken.append(p)
        clock.now += 10.0  # the hook's own time is not sampling time

    asked: list[tuple[int, ...]] = []

    def estimate(frames: tuple[int, ...]) -> torch.Tensor:
        asked.append(frames)
        return torch.full((48, len(frames), 2, 3), float(step))

    hook = PreviewHook(every_s=2.5, on_preview=on_preview, clock=clock)
    hook.start()
    for step in range(1, 12):  # boundaries after steps 1..11 of 12, one second a step
        clock.now += 1.0
        hook.at_boundary(step=step, total_steps=12, latent_frames=31, estimate=estimate)
    assert [p.step for p in taken] == [3, 6, 9]  # every 2.5 s of sampling: after steps 3, 6, 9
    assert asked == [(0, 10, 20, 30)] * 3  # the x0 of 4 latent frames only, first to last, was asked for
    assert all(p.frames == (0, 10, 20, 30) and p.x0.shape == (48, 4, 2, 3) and p.x0.device.type == "cpu"
               and float(p.x0[0, 0, 0, 0]) == p.step and p.total_steps == 12 for p in taken)
    assert not PreviewHook(every_s=5.0).active  # an interval without a hook: nothing to do
    assert not PreviewHook(every_s=0.0, on_preview=print).active  # 0: off
    for bad in (-1.0, float("nan"), True, "5"):
        with pytest.raises(ValueError, match="preview_every_s=.*must be a number of seconds >= 0"):
            PreviewHook(every_s=bad, on_preview=print)


def test_preview_frames_spread_from_first_to_last() -> None:
    assert preview_frames(31) == (0, 10, 20, 30)
    assert preview_frames(5) == (0, 1, 3, 4)
    assert preview_frames(3) == (0, 1, 2)  # no more than there are
    assert preview_frames(31, 1) == (15,) and preview_frames(2, 4) == (0, 1)


@pytest.mark.parametrize("name", REQUESTS)
def test_previews_come_at_every_boundary_with_rising_steps_and_leave_the_latents_bit_equal(
        tiny: PAN2Pipeline, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    req = REQUESTS[name]
    n = steps_of(req)
    plain = tiny.sample(**SIZE, **req)
    got: list[PreviewLatents] = []
    on = tiny.sample(**SIZE, **req, preview_every_s=EVERY_BOUNDARY, on_preview=got.append)
    assert torch.equal(on, plain)  # previews on: the same bits
    assert [p.step for p in got] == list(range(1, n)) and all(p.total_steps == n for p in got)
    assert all(p.frames == (0, 1, 3, 4) and p.x0.shape == (48, 4, 4, 4) for p in got)
    assert not any(torch.equal(a.x0, b.x0) for a, b in zip(got, got[1:]))  # each a new prediction
    if "image" in req:  # the conditioning frame shows as it is, not the model's guess at it
        first = tiny.encode_image(IMAGE, height=SIZE["height"], width=SIZE["width"])[0, :, 0]
        assert all(torch.equal(p.x0[:, 0], first) for p in got)

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("a preview was taken while previews are off")

    monkeypatch.setattr(pipeline_module, "_x0_frames", boom)
    off = tiny.sample(**SIZE, **req, preview_every_s=0, on_preview=boom)  # 0: never
    idle = tiny.sample(**SIZE, **req, preview_every_s=1e9, on_preview=boom)  # on, never due
    assert torch.equal(off, plain) and torch.equal(idle, plain)


def test_a_preview_holds_the_samplers_own_clean_estimate(tiny: PAN2Pipeline) -> None:
    """UniPC keeps x0 = x - sigma v of each step in its state: a preview's frames are those, bit for
    bit (one arithmetic, `samplers.clean_estimate`, on a slice)."""
    req = REQUESTS["unipc"]
    states, previews = [], []
    tiny.sample(**SIZE, **req, checkpoint_every_s=EVERY_BOUNDARY, on_checkpoint=states.append,
                preview_every_s=EVERY_BOUNDARY, on_preview=previews.append)
    assert len(states) == len(previews) == steps_of(req) - 1
    for state, p in zip(states, previews):
        own = state.sampler.tensors
        newest = own[f"x0.{len([k for k in own if k.startswith('x0.')]) - 1}"]  # [1, 48, T, h, w]
        assert state.step == p.step and torch.equal(p.x0, newest[0][:, list(p.frames)])
    # Negative control: the previous step's estimate is another picture.
    assert not torch.equal(previews[1].x0, previews[0].x0)


# ---------------------------------------------------------------------------------- the map
def test_the_map_fitted_on_the_tiny_model_beats_grey_and_another_vaes_map(tiny: PAN2Pipeline) -> None:
    """Fitted on the x0s of two samplings (as `pan2-render calibrate` does), judged on a third
    sampling's final latents and their real decode, at the latent grid."""
    size = dict(height=128, width=128, frames=17)  # latent 48 x 5 x 8 x 8
    x0s = []
    for seed, prompt in [(0, "a fox in the snow"), (1, "a red kite over the sea")]:
        keep = FitSamples(steps=6)
        tiny.sample(**size, prompt=prompt, steps=6, guidance=2.5, seed=seed, preview_every_s=EVERY_BOUNDARY,
                    on_preview=keep, preview_frames=size["frames"])
        assert len(keep.x0s) == 4 and keep.x0s[0].shape == (48, 5, 8, 8)
        x0s += keep.x0s
    fitted, quality = calibrate_rgb_map(tiny, x0s)
    held_out = tiny.sample(**size, prompt="a boat on a lake", steps=6, guidance=2.5, seed=7)
    frames = tiny.decode(held_out).numpy()
    psnr = {name: preview_psnr(m, held_out, frames)
            for name, m in [("fitted", fitted), ("grey", grey_map(48)), ("vae's", vae_rgb_map(tiny)[0]),
                            ("another vae's", another_vaes_map(seed=1))]}
    print(f"tiny model, held-out sampling: PSNR {psnr} dB; in-sample {quality}")
    assert psnr["fitted"] > psnr["grey"] and psnr["fitted"] > psnr["another vae's"]
    assert psnr["vae's"] > psnr["grey"] and psnr["vae's"] > psnr["another vae's"]
    assert quality["psnr_db"] > quality["grey_psnr_db"]


def another_vaes_map(*, seed: int) -> RgbMap:
    """A plausible map of the same channels that is not this VAE's: the negative control."""
    weight = np.random.default_rng(seed).normal(0, 0.05, (48, 3))
    return RgbMap(weight=tuple(tuple(r) for r in weight.tolist()), bias=(0.0, 0.0, 0.0), source="another VAE")


def test_the_fit_recovers_a_linear_decode_and_needs_the_vaes_frame_layout() -> None:
    """A decode that IS linear per latent pixel (a known 48 x 3 map, each latent frame's frames laid
    out as the causal VAE's: the first alone, then 4 each, 16 x 16 pixels each): the fit finds the
    map. Negative control: the same pictures laid out one frame late fit far worse."""
    rng = np.random.default_rng(0)
    true = RgbMap(weight=tuple(tuple(r) for r in rng.normal(0, 0.03, (48, 3)).tolist()),
                  bias=(0.1, -0.2, 0.05), source="test")

    def decode(z: torch.Tensor, late: bool = False) -> np.ndarray:
        pictures = true.apply(z.numpy())  # uint8 [T, h, w, 3]
        per_frame = [0] + [t for t in range(1, z.shape[1]) for _ in range(4)]  # 1 + 4(T - 1) frames
        if late:
            per_frame = [t for t in range(z.shape[1]) for _ in range(4)][:len(per_frame)]
        return pictures[per_frame].repeat(16, axis=1).repeat(16, axis=2)

    latents = [torch.from_numpy(rng.normal(0, 1, (48, 5, 6, 8)).astype(np.float32)) for _ in range(3)]
    fitted = fit_rgb_map([(z, decode(z)) for z in latents], source="test")
    assert np.abs(np.array(fitted.weight) - np.array(true.weight)).max() < 2e-3  # (uint8 rounding)
    assert np.abs(np.array(fitted.bias) - np.array(true.bias)).max() < 2e-3
    test_z = torch.from_numpy(rng.normal(0, 1, (48, 5, 6, 8)).astype(np.float32))
    good = preview_psnr(fitted, test_z, decode(test_z))
    late = fit_rgb_map([(z, decode(z, late=True)) for z in latents], source="test")
    bad = preview_psnr(late, test_z, decode(test_z))
    print(f"linear decode: PSNR {good:.1f} dB; laid out one frame late: {bad:.1f} dB")
    assert good > 45 and bad < good - 15


def test_a_models_map_is_its_stored_one_else_one_fitted_on_its_vae_and_kept(tiny: PAN2Pipeline) -> None:
    """Nothing stored: the first ask fits a map on the VAE's encodes of colour fields and keeps it,
    which then serves (no second fit); a map stored since (`calibrate`'s) replaces it at once."""
    path = rgb_map_path(tiny.model_id)
    path.unlink(missing_ok=True)
    first = tiny.preview_map
    assert first.channels == 48 and first.source.startswith(f"fitted on {tiny.model_id}'s VAE")
    assert stored_rgb_map(tiny.model_id) == first  # kept beside the model id
    kept = path.stat().st_mtime_ns
    assert tiny.preview_map == first and path.stat().st_mtime_ns == kept  # read, not fitted again
    mine = RgbMap(weight=((0.5, 0.0, 0.0),) * 48, bias=(0.0, 0.1, 0.2), source="fitted on the test")
    store_rgb_map(tiny.model_id, mine, quality={"psnr_db": 30.0})
    try:
        assert tiny.preview_map == mine
    finally:
        path.unlink()
    with pytest.raises(ValueError, match="cannot name a calibration file"):
        stored_rgb_map("../evil")
