"""The throughput planner: deterministic ranking from known costs, budgets, the search
space, and --verify."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.estimate.memory_model import MemoryModel
from gpipe.estimate.profile import Profile
from gpipe.planner import Link, plan_from_profiles
from gpipe.schedule import build_schedule
from gpipe.schedule.simulate import Costs, simulate

BATCH = 8
FREE_LINK = Link(latency=0.0, bandwidth=1e30)
CLASSIC = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")  # one stage per rank, or interleaved


def known_profile() -> Profile:
    """Six equal layers; a big first layer in parameters (an embedding), for 8 samples."""
    return Profile.from_costs(
        [1e-3] * 6,  # forward 1 ms; backward 2 ms, split evenly into B and W
        param_bytes=[4 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20],
        activation_bytes=1 << 20,
        saved_bytes=32 << 20,
        batch_size=BATCH,
    )


def ranked(**options):
    """The plan of the known profile on 2 devices, free transfers, no runtime overhead."""
    return plan_from_profiles(
        known_profile(), batch_size=BATCH, devices=2, link=FREE_LINK, overhead=0.0, **options
    )


def test_plan_of_known_costs_is_deterministic_and_ranked():
    first = ranked()
    again = ranked()
    assert first.candidates == again.candidates
    assert first.table(top=None) == again.table(top=None)
    assert first.candidates and not first.rejected  # no budget: everything fits

    keys = [c.rank_key() for c in first.candidates]
    assert keys == sorted(keys)
    # ties (equal throughput) are broken by fewer stages, then smaller M, then the name
    for a, b in zip(first.candidates, first.candidates[1:], strict=False):
        assert a.throughput >= b.throughput * (1 - 1e-9)
        if math.isclose(a.throughput, b.throughput, rel_tol=1e-9):
            auto = (a.schedule == "zb-auto", b.schedule == "zb-auto")  # hand-made first
            assert (a.stages, a.chunks, auto[0], a.schedule) <= (
                b.stages, b.chunks, auto[1], b.schedule
            )  # fmt: skip
    names = [(c.stages, c.chunks, c.schedule, c.checkpoint) for c in first.candidates]
    # gpipe and 1f1b take equally long with equal costs: 1f1b ranks first by name
    assert names.index((2, 8, "1f1b", "never")) + 1 == names.index((2, 8, "gpipe", "never"))

    # Equal costs, free transfers: ZB-V's bubble (K-1)/(6M+K-1) is the smallest, at the
    # largest M, without recomputation; of one stage per rank, ZB-H1's (K-1)/(3M+K-1).
    best = first.best
    assert (best.stages, best.virtual_stages, best.chunks, best.schedule, best.checkpoint) == (
        2, 2, 8, "zb-v", "never",
    )  # fmt: skip
    one_each = ranked(schedules=CLASSIC).best
    assert (one_each.chunks, one_each.schedule, one_each.checkpoint) == (8, "zb-h1", "never")
    assert one_each.balance == (3, 3) and best.balance == (1, 1, 2, 2)
    # its prediction is the simulated makespan of the per-stage costs of one sample; the
    # first stage computes no input gradient: its B is empty and its W the whole backward
    costs = Costs(forward=[3e-3 / 8] * 2, backward=[0.0, 3e-3 / 8], weight=[6e-3 / 8, 3e-3 / 8])
    result = simulate(build_schedule("zb-h1", num_ranks=2, num_microbatches=8), costs)
    assert one_each.step_time == pytest.approx(result.makespan)
    assert one_each.throughput == pytest.approx(BATCH / result.makespan)
    assert one_each.bubble == pytest.approx(result.bubble_fraction)
    assert "zb-v" in first.table(top=3).splitlines()[4]


def test_memory_budget_filters_and_changes_the_choice():
    unlimited = ranked(schedules=CLASSIC)
    # The unconstrained best, ZB-H1 at M=8 without recomputation, needs on its first device
    # (1 + 1 + AdamW 2) x 6 MiB of parameters + 2 micro-batches of one sample, each with
    # 3 x 4 MiB of saved activations and a 0.125 MiB input.
    assert max(unlimited.best.memory) == pytest.approx(24 * 2**20 + 2 * (12 + 0.125) * 2**20)
    budget = 48 * 2**20
    limited = ranked(memory_budget=budget, schedules=CLASSIC)
    assert limited.candidates and limited.rejected
    assert all(max(c.memory) <= budget for c in limited.candidates)
    assert all(not c.fits and c.reason for c in limited.rejected)
    assert len(limited.candidates) + len(limited.rejected) == len(unlimited.candidates)
    # Now 1F1B wins with a cut that moves a layer off the heavy first stage; ZB-H1 with
    # recomputation is as fast and ranks second by name.
    best, second = limited.candidates[:2]
    assert (best.schedule, best.checkpoint, best.chunks, best.balance) == (
        "1f1b",
        "never",
        8,
        (2, 4),
    )
    assert (second.schedule, second.checkpoint) == ("zb-h1", "always")
    assert second.throughput == pytest.approx(best.throughput)
    assert sum(m.total for m in best.stage_memory) == pytest.approx(sum(best.memory))

    # a budget no candidate meets: nothing fits, and the table shows the closest
    tiny = ranked(memory_budget=2**20)
    assert not tiny.candidates
    assert "none fits" in tiny.table()
    with pytest.raises(ValueError, match="no candidate fits"):
        tiny.best  # noqa: B018


def test_search_space_and_costs_are_honoured():
    prof = known_profile()
    result = plan_from_profiles(
        prof,
        batch_size=BATCH,
        devices=4,
        stages=[4],
        chunks=[4],
        schedules=["interleaved-1f1b", "1f1b"],
        checkpoints=["always"],
        virtual_stages=[1, 2],
        memory=MemoryModel(optimizer_state=0),
        link=Link(latency=1e-3, bandwidth=1e9),
        overhead=1e-4,
    )
    seen = {
        (c.stages, c.virtual_stages, c.chunks, c.schedule, c.checkpoint) for c in result.candidates
    }
    # interleaved needs v > 1 and 4 * 2 > 6 layers: only 1F1B remains
    assert seen == {(4, 1, 4, "1f1b", "always")}
    (only,) = result.candidates
    assert sorted(only.balance) == [1, 1, 2, 2]
    # By hand: 2 samples per micro-batch; recomputation adds a forward to each backward,
    # the overhead comes with every action, a hand-over costs latency + bytes / bandwidth.
    forward = [n * 0.25e-3 + 1e-4 for n in only.balance]
    backward = [n * (0.5e-3 + 0.25e-3) + 1e-4 for n in only.balance]
    transfer = 1e-3 + (2**20 * 2 / 8) / 1e9
    schedule = build_schedule("1f1b", num_ranks=4, num_microbatches=4)
    expected = simulate(schedule, Costs(forward, backward, 0.0), transfer=transfer).makespan
    assert only.step_time == pytest.approx(expected)
    # no optimizer state: parameters and their gradients only
    assert only.stage_memory[0].optimizer == 0
    with pytest.raises(ValueError, match="unknown schedule"):
        plan_from_profiles(prof, batch_size=BATCH, devices=2, schedules=["zb-h9"])
    with pytest.raises(ValueError, match="chunks"):
        plan_from_profiles(prof, batch_size=BATCH, devices=2, chunks=[16])


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_verify_runs_the_top_candidate_on_processes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    result = gpipe.plan(
        model,
        x,
        devices=2,
        target=y,
        loss_fn=F.mse_loss,
        repeats=1,
        warmup=0,
        stages=[2],
        chunks=[2],
        schedules=["1f1b"],
        checkpoints=["never"],
        virtual_stages=[1],
        verify=1,
        verify_steps=2,
    )
    (verified,) = result.verified
    assert verified.candidate == result.best
    assert verified.step_time > 0 and verified.throughput == pytest.approx(8 / verified.step_time)
    assert len(verified.activation_bytes) == 2 and min(verified.activation_bytes) > 0
    assert "measured" in result.table()
