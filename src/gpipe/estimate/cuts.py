"""Exact contiguous cuts of ``n`` layers into stages, by dynamic programming over (stages
used, layers covered), not a greedy guess.

The best cut for speed minimises the largest stage cost (a pipeline runs at the speed of
its slowest stage), in O(K·L²)::

    best(s, j) = min over i of max(best(s-1, i), cost(stage s-1 = layers i..j-1))

Of the partitions that reach the optimum, the one with the smallest sum of squared stage
costs is chosen (a second pass of the same recursion), so the other stages are as even as
they can be too. The cost of a stage may depend on its position, and a stage may be
required to fit a memory budget; both enter the same recursion (:func:`min_max_cut`).
For memory alone, :func:`cut_within` finds a cut under a bound in about O(K·L) and
:func:`lightest_cut` the one whose fullest stage needs the least (the capacity search's).
:mod:`gpipe.estimate.balance` applies them to a profiled model.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

from gpipe.base.errors import PartitionError
from gpipe.estimate.memory_model import StageMemoryTable
from gpipe.estimate.ranges import prefix_sums, spans
from gpipe.layout import Layout

__all__ = ["balance_costs", "check_stages", "cut_within", "lightest_cut", "min_max_cut"]


def min_max_cut(
    n: int,
    stages: int,
    cost: Callable[[int, int, int], float],
    fits: Callable[[int, int, int], bool] | None = None,
) -> tuple[float, list[int]] | None:
    """Min over contiguous partitions of max over stages of ``cost(stage, start, stop)``.

    Stages are non-empty; only stages with ``fits(stage, start, stop)`` are allowed.
    Returns (optimum, balance), or None if no partition is allowed. Many partitions
    usually share the optimal slowest stage; among them the one with the smallest sum of
    squared stage costs is returned (the others as even as they can be), so that the
    answer does not hang on which layer a noisy measurement made the slowest.
    """
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = -inf  # max over no stages
    for s in range(1, stages + 1):
        # stage s-1 covers layers i..j-1; the stages after it need a layer each
        for j in range(s, n - (stages - s) + 1):
            row = inf
            for i in range(s - 1, j):
                before = best[s - 1][i]
                if before >= row or (fits is not None and not fits(s - 1, i, j)):
                    continue
                row = min(row, max(before, cost(s - 1, i, j)))
            best[s][j] = row
    optimum = best[stages][n]
    if optimum == inf:
        return None

    # Second pass: the least sum of squares among partitions within the optimum (a
    # rounding's worth of slack, so that the optimal partition itself qualifies).
    bound = optimum + 1e-9 * abs(optimum) + 1e-300
    squares = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(stages + 1)]
    squares[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            row, row_choice = inf, -1
            for i in range(s - 1, j):
                if squares[s - 1][i] == inf:
                    continue
                c = cost(s - 1, i, j)
                if c > bound or (fits is not None and not fits(s - 1, i, j)):
                    continue
                value = squares[s - 1][i] + c * c
                if value < row:
                    row, row_choice = value, i
            squares[s][j], choice[s][j] = row, row_choice
    balance, j = [], n
    for s in range(stages, 0, -1):
        i = choice[s][j]
        balance.append(j - i)
        j = i
    return optimum, balance[::-1]


def check_stages(n: int, stages: Any) -> None:
    problems = Layout(stages=stages).problems(layers=n)  # the rule is Layout's
    if problems:
        raise PartitionError(problems[0])


def balance_costs(costs: Sequence[float], stages: int) -> list[int]:
    """The balance (layers per stage) that minimises the largest sum of ``costs``.

    Exact for any non-negative costs::

        >>> balance_costs([1, 1, 1, 9, 1, 1], stages=3)
        [3, 1, 2]
    """
    values = [float(c) for c in costs]
    check_stages(len(values), stages)
    if any(not v >= 0 for v in values):
        raise ValueError(f"costs must be non-negative numbers, got {list(costs)}")
    prefix = prefix_sums(values)
    solved = min_max_cut(len(values), stages, lambda s, i, j: prefix[j] - prefix[i])
    assert solved is not None  # without a memory constraint every partition is allowed
    return solved[1]


def cut_within(table: StageMemoryTable, n: int, stages: int, bound: float) -> list[int] | None:
    """A cut of ``n`` layers into ``stages`` stages whose every stage needs at most ``bound``
    bytes (``table.total``), or None if there is none. Exact, in about O(stages · n):

    stage s may end at layer j if it can start at a layer i where stage s - 1 ended with
    ``table.weights(i, j) <= bound`` — the weights never shrink as a stage grows, so the
    smallest such i only moves right as j does — and ``table.total(s, i, j) <= bound``,
    tried from the latest such end down.
    """
    ends = [0]  # where the stages so far can end, ascending
    came_from: list[dict[int, int]] = []  # per stage: end -> start
    for s in range(stages):
        last = s == stages - 1
        reach, starts, lo = [], {}, 0
        for j in [n] if last else range(s + 1, n - (stages - s - 1) + 1):
            while lo < j and table.weights(lo, j) > bound:
                lo += 1
            if lo > ends[-1]:  # too heavy to start after any end: so is every later j
                break
            k = bisect.bisect_right(ends, j - 1) - 1
            while k >= 0 and ends[k] >= lo:
                if table.total(s, ends[k], j) <= bound:
                    reach.append(j)
                    starts[j] = ends[k]
                    break
                k -= 1
        if not reach:
            return None
        ends = reach
        came_from.append(starts)
    balance, j = [], n
    for s in range(stages - 1, -1, -1):
        i = came_from[s][j]
        balance.append(j - i)
        j = i
    return balance[::-1]


def lightest_cut(table: StageMemoryTable, n: int, stages: int) -> list[int]:
    """The cut whose fullest stage needs the least (to a relative 1e-6), by bisection on
    :func:`cut_within`'s bound."""
    even = [n // stages + (s < n % stages) for s in range(stages)]
    high = max(0.0, *(table.total(s, i, j) for s, (i, j) in enumerate(spans(even))))
    best, low = even, 0.0
    while high - low > 1e-6 * high:
        middle = (low + high) / 2
        balance = cut_within(table, n, stages, middle)
        if balance is None:
            low = middle
        else:
            best, high = balance, middle
    return best
