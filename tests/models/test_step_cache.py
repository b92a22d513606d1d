"""The velocity a fast-lane plan gives, step by step, against a hand computation: a guided step is
``uncond + g (cond - uncond)``; a gated step runs the conditional branch alone and adds ``(g - 1)``
times the difference of the LAST guided step, ``cond + (g - 1)(cond' - uncond')``. (The tiny model's
tests only check that gating differs from the exact path; this checks the formula itself.)"""

from __future__ import annotations

import torch

from pan2render.lanes import Branch, FastLanes, plan_sampling
from pan2render.models.step_cache import fast_lane_velocity

# What each branch's forward returns at steps 0..3 (one 2-element "velocity" each).
COND = [torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0]), torch.tensor([3.0, 6.0]), torch.tensor([4.0, 8.0])]
UNCOND = [torch.tensor([0.5, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([9.0, 9.0]), torch.tensor([9.0, 9.0])]


def test_a_gated_step_adds_g_minus_1_times_the_last_guided_difference() -> None:
    plan = plan_sampling(FastLanes(guidance_until=0.5), steps=4, guided=True)  # steps 0, 1 guided; 2, 3 gated
    asked: list[set[Branch]] = []
    step = {"i": 0}

    def forwards(x: torch.Tensor, t: torch.Tensor, *, needs: dict) -> dict[Branch, torch.Tensor]:
        i = step["i"]
        step["i"] += 1
        asked.append(set(needs))
        return {b: (COND if b is Branch.COND else UNCOND)[i] for b in needs}

    velocity = fast_lane_velocity(forwards, plan, guidance=3.0)
    got = [velocity(torch.zeros(2), torch.tensor([t])) for t in (999.0, 700.0, 400.0, 100.0)]
    # By hand, g = 3: guided steps 0.5 + 3 (1 - 0.5) = 2, 1 + 3 (2 - 1) = 4; 1 + 3 (4 - 1) = 10;
    # the last guided difference (step 1's) is (1, 3): gated 3 + 2 * 1 = 5, 6 + 2 * 3 = 12; 4 + 2 = 6, 8 + 6 = 14.
    expected = [torch.tensor([2.0, 4.0]), torch.tensor([4.0, 10.0]), torch.tensor([5.0, 12.0]),
                torch.tensor([6.0, 14.0])]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert torch.equal(g, e), (i, g, e)
    assert asked == [{Branch.COND, Branch.UNCOND}] * 2 + [{Branch.COND}] * 2  # gated: no unconditional forward
