"""RIFE's IFNet (pan2render.models.ifnet): parity with ccvfi's IFNet from one random state dict,
the interpolation of a video, and the weights files it loads or refuses."""

from __future__ import annotations

import pickle
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pan2render.ifnet_files import VARIANTS, ifnet_shapes
from pan2render.models.ifnet import (
    IFNet,
    IFNetConfig,
    IFNetWeightsError,
    check_ifnet_weights,
    interpolate,
    interpolate_uint8,
    load_ifnet,
)

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
_make = runpy.run_path(str(SCRIPTS / "make_random_ifnet.py"))
_ccvfi = runpy.run_path(str(SCRIPTS / "ccvfi_ifnet.py"))
random_ifnet_state = _make["random_ifnet_state"]
save_random_ifnet = _make["save_random_ifnet"]

PARITY_TOL = 1e-4  # float32 on the CPU: the same arithmetic in another order


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Frames of a few thousand pixels: a second intra-op thread only adds synchronisation, which
    on a busy 2-core machine costs ten times the work itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _frames(height: int, width: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two smooth frames [1, 3, H, W] in [0, 1], the second the first moved by (3, 5) pixels."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, height // 8 + 2, width // 8 + 2, generator=gen)
    big = F.interpolate(coarse, size=(height + 8, width + 8), mode="bicubic", align_corners=False).clamp(0, 1)
    return big[..., :height, :width].contiguous(), big[..., 5:height + 5, 3:width + 3].contiguous()


# ------------------------------------------------------------------------------------------------
# Parity with ccvfi


@pytest.fixture(scope="module")
def both() -> tuple[IFNet, torch.nn.Module]:
    """Ours and ccvfi's, from one random state dict."""
    reference_class = _ccvfi["ccvfi_ifnet_class"]()
    if reference_class is None:
        pytest.skip(_ccvfi["MISSING"])
    state = random_ifnet_state(seed=0)
    reference = reference_class().eval()
    reference.load_state_dict(state, strict=True)
    ours = IFNet().eval()
    ours.load_state_dict(state, strict=True)
    return ours, reference


def _reference(reference: torch.nn.Module, img0: torch.Tensor, img1: torch.Tensor, timestep: float | torch.Tensor,
               *, scale: float = 1.0) -> torch.Tensor:
    """ccvfi's network on frames padded as Practical-RIFE pads them (zeros right and bottom), cropped
    back. ccvfi's own wrapper resizes to the alignment instead; the network is what is compared."""
    height, width = img0.shape[-2:]
    align = round(64 / scale)
    pad = (0, -width % align, 0, -height % align)
    x = torch.cat((F.pad(img0, pad), F.pad(img1, pad)), 1)
    if torch.is_tensor(timestep):  # ccvfi takes a per-sample timestep as a full-size map
        timestep = timestep.view(-1, 1, 1, 1).expand(-1, 1, x.shape[2], x.shape[3])
    out = reference(x, timestep, [16 / scale, 8 / scale, 4 / scale, 2 / scale, 1 / scale])
    return out[..., :height, :width]


@pytest.mark.parametrize("height,width,scale", [(64, 128, 1.0), (60, 100, 1.0), (60, 100, 0.5)],
                         ids=["aligned", "padded", "padded-scale0.5"])
def test_middle_frame_matches_ccvfi(both, height: int, width: int, scale: float) -> None:
    ours, reference = both
    img0, img1 = _frames(height, width, seed=1)
    with torch.no_grad():
        got = ours(img0, img1, 0.5, scale=scale)
        want = _reference(reference, img0, img1, 0.5, scale=scale)
    diff = float((got - want).abs().max())
    print(f"{height}x{width} scale {scale}: max |ours - ccvfi| = {diff:.2e}")
    assert got.shape == img0.shape
    assert diff < PARITY_TOL
    assert float((got - img0).abs().mean()) > 1e-2 and float((got - img1).abs().mean()) > 1e-2  # not a copy


def test_per_pair_timesteps_match_ccvfi_and_move_the_frame(both) -> None:
    ours, reference = both
    img0, img1 = _frames(60, 100, seed=2)
    img0, img1 = img0.expand(3, -1, -1, -1), img1.expand(3, -1, -1, -1)
    t = torch.tensor([0.25, 0.5, 0.75])
    with torch.no_grad():
        got = ours(img0, img1, t)
        want = _reference(reference, img0, img1, t)
    assert float((got - want).abs().max()) < PARITY_TOL
    assert float((got[0] - got[2]).abs().max()) > 1e-3  # the timestep is an input, not ignored


def test_negative_control_one_perturbed_tensor_breaks_parity(both) -> None:
    """The tolerance can fail: one tensor of ours moved by 5% puts the output past it."""
    ours, reference = both
    img0, img1 = _frames(64, 128, seed=1)
    weight = ours.block0.convblock[3].conv.weight
    keep = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(1.05)
            diff = float((ours(img0, img1, 0.5) - _reference(reference, img0, img1, 0.5)).abs().max())
    finally:
        with torch.no_grad():
            weight.copy_(keep)
    print(f"block0.convblock.3.conv.weight x 1.05: max |ours - ccvfi| = {diff:.2e}")
    assert diff > 1e-3


# ------------------------------------------------------------------------------------------------
# Interpolating a video


@pytest.fixture(scope="module")
def small() -> IFNet:
    """A narrow network (the same code at toy widths): what `interpolate` does with frames does
    not depend on the widths, and it runs in a fraction of the published sizes' time."""
    torch.manual_seed(0)
    return IFNet(IFNetConfig(encoder_channels=4, block_channels=(8, 8, 8, 8, 8))).eval()


@pytest.mark.parametrize("factor", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpolate_keeps_the_originals_and_places_the_in_betweens(small: IFNet, factor: int,
                                                                    dtype: torch.dtype) -> None:
    frames = torch.rand(3, 3, 36, 52, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = interpolate(small, frames, factor, batch=3)
    assert out.shape == ((3 - 1) * factor + 1, 3, 36, 52) and out.dtype == dtype
    assert torch.equal(out[::factor], frames)  # bit for bit
    # Frame 1 * factor + j is the network's at t = j / factor between frames 1 and 2.
    for j in range(1, factor):
        want = small(frames[1:2].float(), frames[2:3].float(), j / factor)
        assert torch.allclose(out[factor + j:factor + j + 1].float(), want, atol=1e-5 if dtype == torch.float32
                              else 1e-3)
        assert not torch.equal(out[factor + j], out[factor])


def test_interpolate_gives_the_same_frames_whatever_the_batch(small: IFNet) -> None:
    """Windows of pairs share their edge frame's encoding; the split must not change a frame."""
    frames = torch.rand(4, 3, 36, 52, generator=torch.Generator().manual_seed(4))
    results = [interpolate(small, frames, 4, batch=b) for b in (1, 2, 64)]
    for other in results[1:]:
        assert torch.allclose(other, results[0], atol=1e-5)


def test_interpolate_uint8_matches_the_float_path(small: IFNet) -> None:
    frames = torch.randint(0, 256, (3, 36, 52, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    out = interpolate_uint8(small, frames, 2)
    assert out.shape == (5, 36, 52, 3) and out.dtype == torch.uint8
    assert torch.equal(out[::2], frames)
    as_float = interpolate(small, frames.permute(0, 3, 1, 2).float() / 255, 2)
    assert torch.equal(out.permute(0, 3, 1, 2), (as_float * 255).round().clamp(0, 255).to(torch.uint8))


def test_interpolate_refuses_what_it_cannot_do(small: IFNet) -> None:
    frames = torch.rand(2, 3, 16, 16)
    assert torch.equal(interpolate(small, frames[:1], 2), frames[:1])  # one frame: nothing in between
    with pytest.raises(ValueError, match=r"factor must be one of \(2, 4\), got 3"):
        interpolate(small, frames, 3)
    with pytest.raises(ValueError, match=r"float RGB \[N, 3, H, W\]"):
        interpolate(small, frames.permute(0, 2, 3, 1), 2)
    with pytest.raises(ValueError, match="uint8 RGB"):
        interpolate_uint8(small, frames, 2)
    with pytest.raises(ValueError, match="scale must be one of"):
        interpolate(small, frames, 2, scale=3.0)
    with pytest.raises(ValueError, match="timestep must be in"):
        small(frames[:1], frames[1:], 1.0)


# ------------------------------------------------------------------------------------------------
# Weights files


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_torch_free_shape_table_is_the_networks(variant: str) -> None:
    with torch.device("meta"):
        model = IFNet(VARIANTS[variant])
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == ifnet_shapes(VARIANTS[variant])


def _params(model: IFNet) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()}


def test_safetensors_and_torch_files_load_the_same_network(tmp_path: Path) -> None:
    st = save_random_ifnet(tmp_path / "rife.safetensors", seed=7)
    pkl = save_random_ifnet(tmp_path / "flownet.pkl", seed=7, prefix="module.")  # Practical-RIFE's naming
    assert check_ifnet_weights(st) is None and check_ifnet_weights(pkl) is None
    a, b = load_ifnet(st), load_ifnet(pkl, dtype=torch.bfloat16)
    assert not a.training and not any(p.requires_grad for p in a.parameters())
    assert {p.dtype for p in b.parameters()} == {torch.bfloat16}
    for key, value in _params(a).items():
        assert torch.equal(value.to(torch.bfloat16), _params(b)[key]), key
    state = random_ifnet_state(seed=7)
    assert torch.equal(_params(a)["block3.lastconv.0.weight"], state["block3.lastconv.0.weight"])
    legacy = tmp_path / "old-flownet.pkl"  # torch.save's format before the zip archive (older releases)
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    assert check_ifnet_weights(legacy) is None
    assert torch.equal(_params(load_ifnet(legacy))["block0.convblock.7.beta"], state["block0.convblock.7.beta"])


def test_published_training_only_tensors_are_left_unread(tmp_path: Path) -> None:
    """Practical-RIFE's 4.2x files also carry their training teacher and time calibration."""
    state = {f"module.{k}": v for k, v in random_ifnet_state(seed=1).items()}
    state["module.teacher.convblock.0.conv.weight"] = torch.zeros(64, 64, 3, 3)
    state["module.caltime.0.weight"] = torch.zeros(8, 41, 3, 3)
    path = tmp_path / "flownet.pkl"
    torch.save(state, path)
    assert check_ifnet_weights(path) is None
    assert torch.equal(load_ifnet(path).encode.cnn0.weight, state["module.encode.cnn0.weight"])


def test_each_variant_is_told_from_its_shapes(tmp_path: Path) -> None:
    path = save_random_ifnet(tmp_path / "rife426.pth", seed=2, variant="v4.25 / v4.26")
    model = load_ifnet(path)
    assert model.config == VARIANTS["v4.25 / v4.26"]
    img0, img1 = _frames(64, 64, seed=3)
    with torch.no_grad():
        assert model(img0, img1).shape == img0.shape


def _write_bad(kind: str, path: Path) -> Path:
    state = random_ifnet_state(seed=0)
    if kind == "missing key":
        del state["block2.convblock.5.beta"]
        save_file(state, str(path))
    elif kind == "wrong shape":
        state["block1.lastconv.0.bias"] = torch.zeros(51)
        save_file(state, str(path))
    elif kind == "unexpected key":
        state["refine.conv.weight"] = torch.zeros(1)
        torch.save(state, path)
    elif kind == "integer tensor":
        state["encode.cnn1.bias"] = torch.zeros(16, dtype=torch.int64)
        save_file(state, str(path))
    elif kind == "v4.25.lite":  # its finest block is 24 wide (and its scales differ): refused, not misread
        state["block4.conv0.1.0.weight"] = torch.zeros(24, 16, 3, 3)
        torch.save(state, path)
    elif kind == "truncated":
        save_file(state, str(path))
        path.write_bytes(path.read_bytes()[:-1000])
    elif kind == "a list":
        torch.save([torch.zeros(1)], path)
    elif kind == "code":
        # Unpickling this would create the marker file; weights_only refuses before running anything.
        marker = path.with_name("ran")
        path.write_bytes(pickle.dumps({"x": _Touch(marker)}, protocol=2))
    elif kind == "text":
        path.write_text("these are not weights\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "directory":
        path.mkdir()
    elif kind == "missing":
        pass
    return path


class _Touch:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


BAD = {
    "missing key": (r"missing 1 key\(s\) 'block2\.convblock\.5\.beta'", "rife.safetensors"),
    "wrong shape": (r"'block1\.lastconv\.0\.bias' is \[51\], expected \[52\]", "rife.safetensors"),
    "unexpected key": (r"1 unexpected key\(s\) 'refine\.conv\.weight'", "rife.pth"),
    "integer tensor": (r"not floating point: 'encode\.cnn1\.bias' \(I64\)", "rife.safetensors"),
    "v4.25.lite": (r"flow blocks 192/128/96/64/24 wide are no RIFE variant", "rife.pth"),
    "truncated": (r"byte ranges do not fill its [\d,]+ bytes of data", "rife.safetensors"),
    "a list": (r"holds a list, not a state dict", "rife.pth"),
    "code": (r"not a plain state dict: torch\.load\(weights_only=True\) refused it", "rife.pkl"),
    "text": (r"neither a safetensors file nor a torch state dict \(it starts b'these ar", "rife.safetensors"),
    "empty": (r"is empty", "rife.pth"),
    "directory": (r"is a directory", "rife.pth"),
    "missing": (r"does not exist", "rife.pth"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_unusable_files_are_refused_naming_the_file_and_the_problem(tmp_path: Path, kind: str) -> None:
    pattern, name = BAD[kind]
    path = _write_bad(kind, tmp_path / name)
    reason = check_ifnet_weights(path)
    assert reason is not None and str(path) in reason, reason
    assert re.search(pattern, reason), reason
    with pytest.raises(IFNetWeightsError) as raised:
        load_ifnet(path)
    assert str(raised.value) == reason
    assert not (tmp_path / "ran").exists()


_CHECK_WITHOUT_TORCH = """
import sys
from pathlib import Path
from pan2render.ifnet_files import check_ifnet_weights
print("good:", check_ifnet_weights(Path(sys.argv[1])))
print("bad:", check_ifnet_weights(Path(sys.argv[2])))
assert sys.modules["torch"] is None
"""


def test_a_safetensors_file_is_checked_without_torch(tmp_path: Path) -> None:
    """Batch validation runs in a driver that never imports torch: the header alone is read."""
    good = save_random_ifnet(tmp_path / "good.safetensors", seed=0)
    bad = _write_bad("wrong shape", tmp_path / "bad.safetensors")
    blocker = "import sys; sys.modules['torch'] = None\n"  # any import of torch now fails
    done = subprocess.run([sys.executable, "-c", blocker + _CHECK_WITHOUT_TORCH, str(good), str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "good: None" in done.stdout
    assert "bad: IFNet weights file" in done.stdout and "expected [52]" in done.stdout


def test_the_random_weights_script_writes_a_file_that_loads(tmp_path: Path) -> None:
    out = tmp_path / "weights" / "ifnet-random.safetensors"
    assert _make["main"]([str(out), "--seed", "3", "--variant", "v4.25.heavy"]) == 0
    assert load_ifnet(out).config == VARIANTS["v4.25.heavy"]
