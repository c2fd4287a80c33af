"""Exact partitioning: optimal against brute force, memory budgets, and balance='auto'."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.estimate.balance import BudgetError, balance_profile
from gpipe.estimate.memory_model import MemoryModel, held_microbatches
from gpipe.estimate.profile import Profile
from gpipe.schedule import build_schedule
from reference import (
    compositions,
    even_balance,
    reference_step,
    relative_error,
    stage_sums,
    twin,
    worst_gradient_error,
)


@pytest.fixture(autouse=True)
def one_thread():
    """Timings on one thread: steadier on a shared machine, and what a stage process gets."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def synthetic(seed: int, n: int) -> Profile:
    rng = random.Random(seed)
    return Profile.from_costs(
        [rng.uniform(0.1, 3.0) for _ in range(n)],
        param_bytes=[rng.randint(0, 100) for _ in range(n)],
        activation_bytes=[rng.randint(1, 20) for _ in range(n)],
        saved_bytes=[rng.randint(0, 50) for _ in range(n)],
        batch_size=4,
    )


def direct_memory(prof: Profile, balance, held, factor=4.0):
    """Stage memory summed layer by layer (no prefix sums): the brute force's reference."""
    out, start = [], 0
    for s, size in enumerate(balance):
        layers = prof.layers[start : start + size]
        params = sum(lay.param_bytes for lay in layers)
        inner = sum(lay.saved_bytes for lay in layers)
        out.append(
            params * factor + layers[0].input_bytes * held[s].boundary + inner * held[s].inner
        )
        start += size
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_time_balance_under_a_memory_budget_is_optimal_against_brute_force(schedule):
    for seed in range(25):
        n, k, m = 4 + seed % 5, 2 + seed % 3, 4
        if k > n:
            continue
        prof = synthetic(seed, n)
        held = held_microbatches(build_schedule(schedule, num_ranks=k, num_microbatches=m), "never")
        times = [lay.forward + lay.backward for lay in prof.layers]
        every = list(compositions(n, k))
        memories = [max(direct_memory(prof, b, held)) for b in every]
        budget = sorted(memories)[len(memories) // 3] + 0.5  # about a third of cuts fit
        feasible = [b for b, mem in zip(every, memories, strict=True) if mem <= budget]
        part = balance_profile(
            prof, stages=k, chunks=m, checkpoint="never", schedule=schedule, memory_budget=budget
        )
        assert max(direct_memory(prof, part.balance, held)) <= budget
        best = min(max(stage_sums(times, b)) for b in feasible)
        assert max(part.times) == pytest.approx(best)
        assert max(stage_sums(times, part.balance)) == pytest.approx(best)
        # balance by size: the smallest largest stage memory
        by_size = balance_profile(
            prof, stages=k, by="size", chunks=m, schedule=schedule, checkpoint="never"
        )
        assert max(direct_memory(prof, by_size.balance, held)) == pytest.approx(min(memories))
        assert [mem.total for mem in by_size.memory] == pytest.approx(
            direct_memory(prof, by_size.balance, held)
        )


def test_budget_changes_the_cut_and_an_infeasible_budget_says_what_is_missing():
    # A heavy embedding-like first layer in parameters, cheap in time.
    prof = Profile.from_costs(
        [0.1, 1, 1, 1, 1, 1], param_bytes=[600, 10, 10, 10, 10, 10], activation_bytes=10
    )
    free = balance_profile(prof, stages=2, chunks=1, checkpoint="never")
    assert free.balance == [3, 3]
    # (1 + gradients 1 + AdamW 2) x parameters + the input: stage 0 of [3, 3] needs
    # 620 x 4 + 10 = 2490 bytes, of [2, 4] 2450
    assert free.memory[0].total == 2490
    fitted = balance_profile(prof, stages=2, chunks=1, checkpoint="never", memory_budget=2460)
    assert fitted.balance == [2, 4] and max(m.total for m in fitted.memory) <= 2460
    with pytest.raises(BudgetError) as caught:
        balance_profile(prof, stages=2, chunks=1, checkpoint="never", memory_budget=2000)
    error = caught.value
    assert error.balance == [1, 5]
    assert error.missing[0] == pytest.approx(600 * 4 + 10 - 2000) and error.missing[1] == 0
    message = str(error)
    assert "stage 0 (layer 0)" in message and "MiB missing" in message
    assert "stage 1 (layers 1-5)" in message and "fits" in message
    # SGD without momentum: no optimizer state, and it fits
    sgd = MemoryModel(optimizer_state=0)
    assert balance_profile(prof, stages=2, chunks=1, memory_budget=2000, memory=sgd).balance
    with pytest.raises(ValueError, match="one per stage"):
        balance_profile(prof, stages=2, memory_budget=[1e9])


class Heavy(nn.Module):
    """One layer with a wide hidden layer: ~200 times a light layer's time (more than 7 times
    keeps the uniform split's imbalance over 2 on a loaded machine)."""

    def __init__(self, width: int = 64, hidden: int = 8192) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def lopsided() -> nn.Sequential:
    light = lambda: nn.Linear(64, 64)  # noqa: E731
    return nn.Sequential(
        light(),
        light(),
        Heavy(),
        light(),
        light(),
        light(),
        light(),
        light(),
        light(),
        Heavy(),
        Heavy(),
        light(),
    )


def test_time_balance_of_a_lopsided_model_beats_the_uniform_split():
    torch.manual_seed(0)
    model, x = lopsided(), torch.randn(64, 64)
    # each layer's median of 15 runs: with two CPU burners beside the suite's workers, a
    # light layer's 5 runs were preempted often enough to look heavy
    balance = gpipe.balance_by_time(model, x, stages=4, repeats=15, warmup=2)
    # judged on independent measurements: each layer's fastest of three profiles, so that
    # one stall of a busy machine does not decide
    profiles = [gpipe.profile(model, x, repeats=5, warmup=1) for _ in range(3)]
    times = [
        min(lay.forward + lay.backward for lay in layers)
        for layers in zip(*(prof.layers for prof in profiles), strict=True)
    ]

    def imbalance(b):
        stage = stage_sums(times, b)
        return max(stage) / (sum(stage) / len(stage))

    uniform = even_balance(len(model), 4)
    assert imbalance(uniform) > 2.0  # two heavy layers share the last stage
    # each heavy layer (2, 9, 10) gets a stage of its own, and the measured imbalance drops
    stage_of = [s for s, size in enumerate(balance) for _ in range(size)]
    assert len({stage_of[2], stage_of[9], stage_of[10]}) == 3, balance
    assert imbalance(balance) < 0.8 * imbalance(uniform), (balance, times)


def test_balance_by_size_without_a_sample_balances_parameters():
    model = nn.Sequential(
        nn.Embedding(1000, 16),
        nn.Linear(16, 16),
        nn.Linear(16, 16),
        nn.Linear(16, 16),
        nn.Linear(16, 1000),
    )
    # parameters 16000, 272 x 3, 17000: [4, 1] leaves 17000 in the larger stage
    assert gpipe.balance_by_size(model, stages=2) == [4, 1]
    with torch.device("meta"):
        on_meta = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 1000), nn.Linear(1000, 10))
    assert gpipe.balance_by_size(on_meta, stages=2) == [2, 1]
    for wrong, words in ((nn.Sequential(), "Sequential of length 0"), (nn.Linear(2, 2), "Linear")):
        with pytest.raises(
            TypeError, match=f"balance_by_size takes a non-empty nn.Sequential, got {words}"
        ):
            gpipe.balance_by_size(wrong, stages=2)


def test_pipe_auto_balance_trains_like_the_unsplit_model():
    torch.manual_seed(0)
    model = lopsided().double()
    x, y = torch.randn(12, 64, dtype=torch.float64), torch.randn(12, 64, dtype=torch.float64)
    reference = twin(model)
    pipe = gpipe.Pipe(model, balance="auto", sample=x[:3], devices=["cpu"] * 3, chunks=4)
    assert len(pipe.balance) == 3 and sum(pipe.balance) == len(model)
    loss = pipe.step(x, y, F.mse_loss, seed=7)
    expected = reference_step(reference, x, y, F.mse_loss, chunks=4, seed=7)
    assert relative_error(loss, expected) <= 1e-10
    worst, where = worst_gradient_error(pipe, reference)
    assert worst <= 1e-10, f"worst gradient error {worst:.3g} at {where}"


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v"])
def test_balance_by_step_never_lengthens_the_simulated_step(schedule):
    from gpipe.estimate.costs import stage_costs
    from gpipe.schedule import build_schedule
    from gpipe.schedule.simulate import simulate

    built = build_schedule(schedule, num_ranks=3, num_microbatches=6)
    stages = built.num_stages
    shorter = 0
    for seed in range(12):
        rng = random.Random(seed)
        forward = [rng.uniform(0.2, 3.0) for _ in range(14)]
        prof = Profile.from_costs(forward, [f * rng.uniform(1.5, 3.0) for f in forward],
                                  weight_fraction=rng.uniform(0.2, 0.6))  # fmt: skip
        options = {"stages": stages, "chunks": 6, "schedule": schedule, "checkpoint": "never",
                   "virtual_stages": built.num_stages // 3}  # fmt: skip
        by_time = balance_profile(prof, by="time", **options).balance
        by_step = balance_profile(prof, by="step", **options).balance

        def step(cut, prof=prof):
            return simulate(built, stage_costs(prof, cut, built, "never")).makespan

        assert sum(by_step) == 14 and min(by_step) >= 1
        assert step(by_step) <= step(by_time) * (1 + 1e-12)
        shorter += step(by_step) < step(by_time) * (1 - 1e-6)
    if schedule == "zb-v":  # two stages per rank: the slowest stage misjudges the step
        assert shorter >= 3, shorter
