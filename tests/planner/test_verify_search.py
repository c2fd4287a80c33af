"""Which depths the capacity refinement measures: aimed at the budget from the measured
peaks, a gallop where they say nothing, a bracket that shrinks (on fake measurements)."""

from __future__ import annotations

import pytest

from gpipe.base._utils import MiB
from gpipe.layout import Layout
from gpipe.planner.capacity import fit_of
from gpipe.planner.families import gpt_family
from gpipe.planner.measured import Measured
from gpipe.planner.verify_search import refine

LAYOUT = Layout(stages=1, chunks=1, checkpoint="always")
FAMILY = gpt_family(d_model=16, heads=2, seq=8, vocab=64, batch=4)
BUDGET = 100 * MiB


def _run(depth: int, peak) -> Measured:
    fit = fit_of(FAMILY, LAYOUT, depth, budget=BUDGET)
    return Measured(fit, (peak(depth),), 2, before=(0.0,))


@pytest.mark.parametrize(("start", "answer"), [(30, 30), (30, 47), (30, 12), (200, 180)])
def test_a_round_aims_at_the_budget_from_the_peaks(start, answer):
    # 1 MiB a block, as measured; the prediction's slope 20 % less: the second round aims
    # from the first's peak and the prediction's slope, the third (where that was not
    # close enough) from the measured slope between the depths farthest apart.
    def peak(depth: int) -> float:
        return BUDGET + MiB * (depth - answer - 0.5)

    rounds: list[list[int]] = []

    def measure(depths: list[int]) -> list[Measured]:
        rounds.append(depths)
        return [_run(d, peak) for d in depths]

    first = measure([start, start + 1])
    found, bigger = refine(first, measure, lambda d: 0.8 * MiB * d, moves=16)
    assert (found.fit.depth, bigger.fit.depth) == (answer, answer + 1), rounds
    assert len(rounds) <= 3 and found.fits and not bigger.fits


def test_a_flat_prediction_and_a_step_gallop_then_bracket():
    # Peaks that say nothing of the distance (a step at 5) and a flat prediction: the steps
    # double from the start, and the bracket then shrinks to one block.
    def peak(depth: int) -> float:
        return BUDGET - 1 if depth <= 5 else BUDGET + 1

    ran: list[int] = []

    def measure(depths: list[int]) -> list[Measured]:
        ran.extend(depths)
        return [_run(d, peak) for d in depths]

    found, bigger = refine(measure([60, 61]), measure, lambda d: 0.0, moves=32)
    assert (found.fit.depth, bigger.fit.depth) == (5, 6)
    assert len(ran) == len(set(ran)) and len(ran) <= 20, ran


def test_out_of_moves_gives_the_deepest_within_and_the_next_measured():
    def peak(depth: int) -> float:
        return BUDGET + MiB * (depth - 40.5)

    found, bigger = refine([_run(10, peak)], lambda ds: [_run(d, peak) for d in ds],
                           lambda d: 0.01 * MiB * d, moves=0)  # fmt: skip
    assert found.fit.depth == 10 and bigger.fit.depth == 11 and bigger.fits  # not decided


@pytest.mark.parametrize("answer", [31, 32])
def test_the_depth_just_past_the_deepest_within_is_run_alone(answer):
    # Both first depths fit, the deeper by less than a block's rise as predicted: the aim is
    # the next depth, which with the deepest within decides, so it runs alone (one run, not
    # two). Where it fits after all (the prediction's slope twice the measured), the search
    # goes on from there.
    def peak(depth: int) -> float:
        return BUDGET + 3 * MiB * (depth - answer - 0.9)

    rounds: list[list[int]] = []

    def measure(depths: list[int]) -> list[Measured]:
        rounds.append(depths)
        return [_run(d, peak) for d in depths]

    found, bigger = refine([_run(30, peak), _run(31, peak)], measure, lambda d: 6 * MiB * d,
                           moves=16)  # fmt: skip
    assert (found.fit.depth, bigger.fit.depth) == (answer, answer + 1)
    assert rounds[0] == [32] and (len(rounds) == 1) == (answer == 31), rounds
