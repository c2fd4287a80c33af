"""Exact min-max cuts of a sequence of layer costs (``balance_costs``), against brute force."""

from __future__ import annotations

import random

import pytest

from gpipe.base.errors import PartitionError
from gpipe.estimate.cuts import balance_costs
from reference import compositions, stage_sums


def test_balance_costs_is_optimal_against_brute_force():
    rng = random.Random(0)
    for seed in range(300):
        n = rng.randint(1, 10)
        k = rng.randint(1, min(6, n))
        # integers with ties, and spread-out floats
        costs = (
            [rng.randint(0, 5) for _ in range(n)]
            if seed % 2
            else [rng.lognormvariate(0, 1.5) for _ in range(n)]
        )
        balance = balance_costs(costs, k)
        assert len(balance) == k and sum(balance) == n and min(balance) >= 1
        best = min(max(stage_sums(costs, b)) for b in compositions(n, k))
        assert max(stage_sums(costs, balance)) == pytest.approx(best, abs=1e-12), (seed, costs)


def test_balance_costs_examples_and_errors():
    assert balance_costs([1, 1, 1, 9, 1, 1], 3) == [3, 1, 2]
    assert balance_costs([5], 1) == [1]
    with pytest.raises(PartitionError, match=r"stages=3 needs at least 3 layers \(one per stage\)"):
        balance_costs([1, 2], 3)
    with pytest.raises(ValueError, match="non-negative"):
        balance_costs([1, -1], 1)
