"""Sums and maxima over any range of layers in O(1), after one pass over them: what lets the
memory model (``gpipe.estimate.memory_model``) and the cuts (``gpipe.estimate.cuts``) price
every candidate stage without walking its layers."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["RangeMax", "StridedMax", "prefix_sums", "spans"]


def prefix_sums(values: Sequence[float]) -> list[float]:
    """``out[j] - out[i]`` is the sum of ``values[i:j]``."""
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def spans(balance: Sequence[int]) -> list[tuple[int, int]]:
    """The layers ``i..j-1`` of each stage of ``balance``, as ``(i, j)``."""
    ends = prefix_sums(balance)
    return [(int(ends[s]), int(ends[s + 1])) for s in range(len(balance))]


class RangeMax:
    """Largest of ``values[i:j]`` in O(1), after O(n log n) preparation (a sparse table)."""

    def __init__(self, values: Sequence[float]) -> None:
        self.levels = [list(values)]
        width = 1
        while 2 * width <= len(values):
            below = self.levels[-1]
            self.levels.append(
                [max(below[i], below[i + width]) for i in range(len(values) - 2 * width + 1)]
            )
            width *= 2

    def __call__(self, i: int, j: int) -> float:
        level = (j - i).bit_length() - 1
        row = self.levels[level]
        return max(row[i], row[j - (1 << level)])


class StridedMax:
    """Largest of ``values[start], values[start + step], ...`` (``count`` of them) in O(1)."""

    def __init__(self, values: Sequence[float], step: int) -> None:
        self.step = step
        self.rows = [RangeMax(values[r::step]) for r in range(min(step, len(values)))]

    def __call__(self, start: int, count: int) -> float:
        first = start // self.step
        return self.rows[start % self.step](first, first + count)
