"""Which depths :func:`gpipe.planner.verify_capacity` measures to find the largest that fits.

A measured run costs minutes (a deep pipeline's two training steps on a busy CPU), so the
search spends as few as it can. Each round measures two adjacent depths, ``t`` and ``t +
1`` (at once where the caller can: each process's peak is its own), aimed at the answer:
``t`` is the depth whose peak is estimated to meet the budget, from the nearest measured
peak and a slope in bytes per block, the measured one between two depths at least two
blocks apart where there are such, else the prediction's over eight blocks (a single block
moves the fullest stage of a pipeline by a block or by nothing, as the lightest cut
shifts). The prediction's error is mostly a per-stage offset, so one round usually lands
within a block, and the pair then decides. Where the aim is the depth just past the deepest
within the budget, that depth alone is run: with the deepest within it decides, and one
more, estimated over too, would only cost a run. Where the estimate fails (a flat or jumpy
measured curve), the steps grow as a gallop (1, 2, 4, ... blocks) until a depth within the
budget and one over it bracket the answer; inside a bracket the estimate is interpolated
between its ends, and a round after one that left more than half its bracket bisects it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["refine"]


class Measured(Protocol):
    """What the search reads of a :class:`gpipe.planner.measured.Measured` run (which
    imports this module)."""

    fit: Any  # its Fit: the depth run and the budget
    fits: bool
    peak: float


SPAN = 8  # blocks over which the prediction's slope is taken


def refine(
    first: list[Measured],
    measure: Callable[[list[int]], list[Measured]],
    predicted_peak: Callable[[int], float],
    moves: int,
) -> tuple[Measured, Measured | None]:
    """From the runs ``first``, the deepest depth measured within the budget and the next
    size up measured over it, measuring at most ``moves`` more runs (``measure`` takes a
    list of depths). Where it ran out of moves, ``found`` is the deepest measured within
    the budget (or the shallowest over it, if none fit) and the next size up the shallowest
    deeper one measured (which may still fit)."""
    measured = {m.fit.depth: m for m in first}
    stride, width, halve = 1, None, False
    while moves > 0:
        depths = _probes(measured, predicted_peak, stride, halve)[:moves]
        if not depths:
            break
        for run in measure(depths):
            measured[run.fit.depth] = run
        moves -= len(depths)
        stride *= 2
        was, width = width, _bracket(measured)
        halve = was is not None and width is not None and 2 * width > was  # aimed, missed
    runs = sorted(measured.values(), key=lambda m: m.fit.depth)
    if not any(m.fits for m in runs):  # nothing measured fits
        return runs[0], (runs[1] if len(runs) > 1 else None)
    found = [m for m in runs if m.fits][-1]
    deeper = [m for m in runs if m.fit.depth > found.fit.depth]
    return found, (deeper[0] if deeper else measure([found.fit.depth + 1])[0])


def _bracket(measured: dict[int, Measured]) -> int | None:
    """The width of the bracket (the shallowest over less the deepest within), if any."""
    within = [d for d, m in measured.items() if m.fits]
    over = [d for d, m in measured.items() if not m.fits]
    return min(over) - max(within) if within and over else None


def _probes(
    measured: dict[int, Measured],
    predicted_peak: Callable[[int], float],
    stride: int,
    halve: bool,
) -> list[int]:
    """The next round's depths (none: the answer is bracketed to one block, or depth 1 is
    over the budget); ``halve``: the last round's aim left more than half its bracket, so
    this one bisects."""
    within = [d for d, m in measured.items() if m.fits]
    over = [d for d, m in measured.items() if not m.fits]
    budget = next(iter(measured.values())).fit.budget
    if within and over:
        low, high = max(within), min(over)
        if high - low <= 1:
            return []
        p_low, p_high = measured[low].peak, measured[high].peak
        share = (budget - p_low) / (p_high - p_low) if p_high > p_low and not halve else 0.5
        t = min(max(low + math.floor(share * (high - low)), low + 1), high - 1)
        return [d for d in (t, t + 1) if low < d < high]
    nearest = max(within) if within else min(over)
    step = (budget - measured[nearest].peak) / _slope(measured, predicted_peak, nearest)
    if within:  # up: at least the gallop's stride
        if math.floor(step) < 1 and stride == 1:  # aimed just past the deepest within:
            return [nearest + 1]  # it and the deepest decide; one more would be over too
        t = nearest + max(math.floor(step), stride)
    else:  # down
        t = max(nearest + min(math.floor(step), -stride), 1)
    return [d for d in (t, t + 1) if d not in measured]


def _slope(
    measured: dict[int, Measured], predicted_peak: Callable[[int], float], depth: int
) -> float:
    """Bytes per block near ``depth``: measured between the two depths farthest apart (at
    least two blocks) where that rises, else the prediction's over ``SPAN`` blocks."""
    depths = sorted(measured)
    if len(depths) >= 2 and depths[-1] - depths[0] >= 2:
        low, high = measured[depths[0]], measured[depths[-1]]
        rise = (high.peak - low.peak) / (depths[-1] - depths[0])
        if rise > 0:
            return rise
    rise = (predicted_peak(depth + SPAN) - predicted_peak(depth)) / SPAN
    return rise if rise > 0 else math.inf  # flat: no estimate, the gallop's stride
