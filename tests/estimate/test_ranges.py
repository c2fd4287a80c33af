"""Sums and maxima over any range of layers in O(1), against Python's sum and max."""

from __future__ import annotations

import random

from gpipe.estimate.ranges import RangeMax, StridedMax, prefix_sums


def test_every_range_against_sum_and_max():
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 16, 33):
        values = [rng.uniform(-5, 5) for _ in range(n)]
        sums, largest = prefix_sums(values), RangeMax(values)
        for i in range(n):
            for j in range(i + 1, n + 1):
                assert abs(sums[j] - sums[i] - sum(values[i:j])) < 1e-12
                assert largest(i, j) == max(values[i:j])
        for step in (1, 2, 3, 5):
            strided = StridedMax(values, step)
            for start in range(n):
                for count in range(1, len(values[start::step]) + 1):
                    assert strided(start, count) == max(values[start::step][:count])
