"""Step checkpoints on one process: a sampling stopped between two steps (by ``should_stop``, or
by keeping only a timed checkpoint's bytes and loading the model again) continues bit for bit; a
damaged, stale or foreign checkpoint is refused with its reason; with the hooks off nothing runs.

CPU, the embedded tiny model at 64x64x17 (latent 48x5x4x4); seconds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from fake_clock import FakeClock
from tiny_requests import REQUESTS, SIZE

from pan2render.models import PAN2Pipeline, PAN2PipelineConfig
from pan2render.models import pipeline as pipeline_module
from pan2render.models.sampler_state import (
    SamplerState,
    SamplingPreempted,
    StepCheckpointError,
    StepHooks,
    pack_sampler_state,
    unpack_sampler_state,
)
from pan2render.models.samplers import SchedulerConfig, make_sampler
from pan2render.step_checkpoint import checkpoint_problem

SPEC = "a" * 64  # a job's spec hash, as the runner passes it


def steps_of(req: dict) -> int:
    return len(req["timesteps"]) if "timesteps" in req else req["steps"]


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> tuple[PAN2Pipeline, PAN2Pipeline]:
    """The tiny model loaded twice: a resume on the second knows only the bytes the first packed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAN2_RENDER_CACHE", str(tmp_path_factory.mktemp("cache")))
        return (PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cpu")),
                PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cpu")))


def stop_after(k: int):
    """A should_stop that says stop at the k-th boundary it is asked at."""
    polls = []

    def should_stop() -> bool:
        polls.append(1)
        return len(polls) == k

    return should_stop


def stopped_state(pipe: PAN2Pipeline, req: dict, k: int) -> SamplerState:
    with pytest.raises(SamplingPreempted) as stopped:
        pipe.sample(**SIZE, **req, should_stop=stop_after(k))
    return stopped.value.state


@pytest.mark.parametrize("name", REQUESTS)
def test_a_sampling_stopped_at_any_boundary_resumes_bit_equal(pipes, name: str) -> None:
    pipe, fresh = pipes
    req = REQUESTS[name]
    n = steps_of(req)
    full = pipe.sample(**SIZE, **req)
    for k in range(1, n):
        state = stopped_state(pipe, req, k)
        assert state.step == k and state.key.total_steps == n
        seen: list[tuple[int, int]] = []
        in_memory = pipe.sample(**SIZE, **req, resume_from=state, progress=lambda i, m: seen.append((i, m)))
        from_bytes = fresh.sample(**SIZE, **req, resume_from=unpack_sampler_state(
            pack_sampler_state(state, spec_hash=SPEC), spec_hash=SPEC, model_id=fresh.model_id))
        diff = float((from_bytes - full).abs().max())
        print(f"{name}: stopped after step {k} of {n}, resumed from bytes: max abs diff {diff:.1e}")
        assert torch.equal(in_memory, full) and torch.equal(from_bytes, full), f"{name} stopped at {k}"
        assert seen == [(i, n) for i in range(k + 1, n + 1)]  # the resumed steps only
    # Negative control: the resume really continues from the state it is given. Another seed's
    # state at the same step, relabelled as this request's, ends elsewhere.
    other = stopped_state(pipe, {**req, "seed": req["seed"] + 100}, n // 2)
    relabelled = dataclasses.replace(other, key=stopped_state(pipe, req, n // 2).key)
    assert not torch.equal(pipe.sample(**SIZE, **req, resume_from=relabelled), full)


@pytest.mark.parametrize("name", ["unipc", "dmd"])
def test_timed_checkpoints_resume_bit_equal_from_their_bytes_alone(pipes, name: str) -> None:
    """A checkpoint due at every boundary (a tiny interval): the sampling with the hook returns what
    one without it does, and each checkpoint's bytes alone, loaded by another pipeline object,
    continue to the same latents."""
    pipe, fresh = pipes
    req = REQUESTS[name]
    n = steps_of(req)
    full = pipe.sample(**SIZE, **req)
    packed: list[bytes] = []
    with_hook = pipe.sample(**SIZE, **req, checkpoint_every_s=1e-9,
                            on_checkpoint=lambda s: packed.append(pack_sampler_state(s, spec_hash=SPEC)))
    assert torch.equal(with_hook, full) and len(packed) == n - 1
    for k, data in enumerate(packed, start=1):
        state = unpack_sampler_state(data, spec_hash=SPEC, model_id=fresh.model_id)
        assert state.step == k
        assert torch.equal(fresh.sample(**SIZE, **req, resume_from=state), full), f"checkpoint after step {k}"


def test_the_hooks_off_run_nothing_and_change_nothing(pipes, monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, _ = pipes
    req = REQUESTS["unipc"]
    plain = pipe.sample(**SIZE, **req)
    idle = pipe.sample(**SIZE, **req, should_stop=lambda: False, checkpoint_every_s=1e9,
                       on_checkpoint=lambda s: pytest.fail("not due"))
    assert torch.equal(idle, plain)  # hooks on, never firing: the same bits

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("a hook ran while the hooks are off")

    monkeypatch.setattr(pipeline_module, "capture_state", boom)
    monkeypatch.setattr(pipe.denoiser, "any_rank", boom)
    off = pipe.sample(**SIZE, **req, checkpoint_every_s=0, on_checkpoint=boom)  # interval 0: never
    assert torch.equal(off, plain) and torch.equal(pipe.sample(**SIZE, **req), plain)


def test_a_damaged_checkpoint_is_refused_whichever_byte_flipped(pipes) -> None:
    pipe, _ = pipes
    data = pack_sampler_state(stopped_state(pipe, REQUESTS["unipc"], 3), spec_hash=SPEC)
    header_end = 8 + int.from_bytes(data[:8], "little")
    positions = [*range(header_end), *range(header_end, len(data), 97)]
    reasons: dict[str, int] = {}
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 0x01  # one bit
        problem = checkpoint_problem(bytes(bad), spec_hash=SPEC, model_id=pipe.model_id)
        assert problem is not None, f"a flipped bit at byte {pos} of {len(data)} passed"
        reasons[problem.split(":")[0]] = reasons.get(problem.split(":")[0], 0) + 1
        if pos >= header_end:
            assert problem == "damaged: its sha256 does not match its contents", pos
    print(f"{len(positions)} single-bit flips of a {len(data)}-byte checkpoint, refused as {reasons}")
    assert checkpoint_problem(data, spec_hash=SPEC, model_id=pipe.model_id) is None  # the intact one passes
    for cut in (0, 7, header_end, len(data) - 1):
        assert checkpoint_problem(data[:cut]).startswith("damaged: "), cut


def test_a_stale_checkpoint_is_refused_naming_what_differs(pipes) -> None:
    pipe, _ = pipes
    req = REQUESTS["unipc"]
    data = pack_sampler_state(stopped_state(pipe, req, 2), spec_hash=SPEC)
    with pytest.raises(StepCheckpointError, match=r"^stale: it belongs to spec_hash 'aaaaaaaaaaaa', this "
                                                  r"sampling's is 'bbbbbbbbbbbb'"):
        unpack_sampler_state(data, spec_hash="b" * 64)
    with pytest.raises(StepCheckpointError, match="^stale: it belongs to model_id 'tiny-v"):
        unpack_sampler_state(data, model_id="another-model")
    state = unpack_sampler_state(data, spec_hash=SPEC, model_id=pipe.model_id)
    for change, what in [({"steps": 7}, "total_steps 6, this sampling's is 7"),
                         ({"seed": 4}, "seed 3, this sampling's is 4"),
                         ({"guidance": 3.0}, "guidance 2.5, this sampling's is 3.0"),
                         ({"sampler": "euler"}, "sampler 'unipc', this sampling's is 'euler'"),
                         ({"height": 96}, "latent_shape (1, 48, 5, 4, 4), this sampling's is (1, 48, 5, 6, 4)"),
                         ({"flow_shift": 3.0}, "another schedule")]:
        with pytest.raises(StepCheckpointError, match="stale: ") as refused:
            pipe.sample(**{**SIZE, **req, **change}, resume_from=state)
        assert what in str(refused.value), (change, str(refused.value))


def test_a_foreign_checkpoint_is_refused(pipes, tmp_path: Path) -> None:
    from safetensors.torch import save

    from pan2render.runner.worker.packing import pack_latents

    pipe, _ = pipes
    latents = pipe.sample(**SIZE, **REQUESTS["euler"])
    artifact = pack_latents(latents, spec_hash=SPEC, seed=5, steps=5, model_id=pipe.model_id)
    assert checkpoint_problem(artifact).startswith("foreign: not a pan2-render step checkpoint")
    assert checkpoint_problem(b"\x00" * 64).startswith("damaged: ")
    assert checkpoint_problem(save({"x": torch.zeros(2)})).startswith("foreign: ")
    state = stopped_state(pipe, REQUESTS["euler"], 2)
    from safetensors import safe_open

    path = tmp_path / "c.safetensors"
    path.write_bytes(pack_sampler_state(state))
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    later = save(tensors, metadata={**meta, "version": "2"})
    assert checkpoint_problem(later) == "stale: step checkpoint format version '2', this pan2-render reads version 1"
    # An euler state with a history:
    extra = save({**tensors, "sampler.x0.0": tensors["latents"].clone()}, metadata=meta)
    assert checkpoint_problem(extra) == "damaged: its sha256 does not match its contents"


# ---------------------------------------------------------------------------------- the samplers alone
LATENT = (1, 4, 3, 5, 6)


def _velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for the DiT."""
    return torch.tanh(1.3 * x) * (0.6 + float(t) / 1000) + 0.25 * torch.sin(3.0 * x)


def _set_up(name: str, config: SchedulerConfig, generator: torch.Generator):
    sched = make_sampler(name, config)
    if name == "dmd":
        sched.set_dmd_timesteps([1000, 800, 600, 400, 200], generator=generator)
    else:
        sched.set_timesteps(7)
    return sched


@pytest.mark.parametrize("name, config", [
    ("unipc", SchedulerConfig()), ("unipc", SchedulerConfig(solver_order=1)),
    ("unipc", SchedulerConfig(disable_corrector=(0, 2))), ("euler", SchedulerConfig()), ("dmd", SchedulerConfig()),
])
def test_a_sampler_continues_exactly_from_its_state_at_every_boundary(name: str, config: SchedulerConfig) -> None:
    def run(stop: int | None, *, carry_generator: bool = True) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(LATENT, generator=gen)
        sched = _set_up(name, config, gen)
        for i, t in enumerate(sched.timesteps):
            if i == stop:  # carry the state (and the generator's) over to a sampler set up afresh
                state = sched.state()
                state = dataclasses.replace(state, tensors={k: v.clone() for k, v in state.tensors.items()})
                carried = gen.get_state()
                gen = torch.Generator().manual_seed(99)
                if carry_generator:
                    gen.set_state(carried)
                sched = _set_up(name, config, gen)
                sched.load_state(state, device="cpu")
            x = sched.step(_velocity(x, t), t, x)
        return x

    full = run(None)
    n = len(_set_up(name, config, torch.Generator()).timesteps)
    for stop in range(1, n):
        assert torch.equal(run(stop), full), f"{name} {config} resumed at {stop}"
    if name == "dmd":  # its fresh noise is the generator's: without its state the result differs
        assert not torch.equal(run(1, carry_generator=False), full)


def test_load_state_refuses_a_state_that_does_not_fit() -> None:
    gen = torch.Generator().manual_seed(1)
    unipc = _set_up("unipc", SchedulerConfig(), gen)
    x = torch.randn(LATENT, generator=gen)
    for t in unipc.timesteps[:3]:
        x = unipc.step(_velocity(x, t), t, x)
    state = unipc.state()
    assert sorted(state.tensors) == ["last_sample", "x0.0", "x0.1"] and state.counters == {"last_order": 2}
    with pytest.raises(RuntimeError, match="continues a job just set up"):
        unipc.load_state(state, device="cpu")
    fresh = lambda name="unipc", config=None: _set_up(name, config or SchedulerConfig(), gen)  # noqa: E731
    no_history = dataclasses.replace(state, tensors={"last_sample": state.tensors["last_sample"]})
    with pytest.raises(ValueError, match=r"keeps \['last_sample', 'x0.0', 'x0.1'\], got \['last_sample'\]"):
        fresh().load_state(no_history, device="cpu")
    with pytest.raises(ValueError, match="needs counters"):
        fresh().load_state(dataclasses.replace(state, counters={"last_order": 3}), device="cpu")
    with pytest.raises(ValueError, match="step 9 is not a boundary of this 7-step schedule"):
        fresh().load_state(dataclasses.replace(state, step=9), device="cpu")
    with pytest.raises(ValueError, match="FlowEulerSampler keeps no state between steps"):
        fresh("euler").load_state(state, device="cpu")
    with pytest.raises(ValueError, match=r"order 1\) after 3 step\(s\) keeps \['last_sample', 'x0.0'\]"):
        fresh("unipc", SchedulerConfig(solver_order=1)).load_state(state, device="cpu")


# ---------------------------------------------------------------------------------- when the hooks fire
def test_a_checkpoint_is_due_after_that_many_seconds_of_sampling_and_a_stop_is_agreed() -> None:
    clock, taken = FakeClock(0.0), []

    def on_checkpoint(state: object) -> None:
        taken.append(step)
        clock.now += 10.0  # the hook's own time (packing, sending) is not sampling time

    hooks = StepHooks(checkpoint_every_s=2.5, on_checkpoint=on_checkpoint, clock=clock)
    hooks.start()
    for step in range(1, 8):  # boundaries after steps 1..7 of 8, one second a step
        clock.now += 1.0
        hooks.at_boundary(lambda: f"state after {step}", any_rank=lambda flag: pytest.fail("no should_stop"))
    assert taken == [3, 6]
    # A stop asked on another rank only: the agreed flag decides; the state is checkpointed first.
    asked: list[bool] = []
    stop = StepHooks(should_stop=lambda: False, on_checkpoint=lambda s: asked.append(s), clock=clock)
    with pytest.raises(SamplingPreempted) as stopped:
        stop.at_boundary(lambda: _state_after(4), any_rank=lambda flag: asked.append(flag) or True)
    assert asked[0] is False and asked[1] is stopped.value.state and stopped.value.state.step == 4
    assert not StepHooks(checkpoint_every_s=5.0).active  # an interval without a hook: nothing to do
    for bad in (-1.0, float("nan"), True, "60"):
        with pytest.raises(ValueError, match="checkpoint_every_s=.*must be a number of seconds >= 0"):
            StepHooks(checkpoint_every_s=bad, on_checkpoint=print)


def _state_after(step: int) -> SamplerState:
    from pan2render.models.samplers import StepState
    from pan2render.step_checkpoint import CheckpointKey

    key = CheckpointKey(model_id="m", sampler="euler", total_steps=8, latent_shape=(1, 1), seed=0, guidance=1.0)
    return SamplerState(key=key, latents=torch.zeros(1, 1), schedule=torch.zeros(9), generator=torch.zeros(1),
                        sampler=StepState(step=step, tensors={}, counters={}))
