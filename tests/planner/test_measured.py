"""A capacity row trained for real: its peaks, the next size up, sharded replicas, and the
refinement and repeats that make a depth exact (on fakes of the measurement)."""

from __future__ import annotations

import math
import os

import pytest

from gpipe.base._utils import MiB
from gpipe.estimate.memory_model import Calibration
from gpipe.layout import Layout
from gpipe.planner import calibrate, capacity, verify_capacity
from gpipe.planner.capacity import fit_of
from gpipe.planner.families import gpt_family
from gpipe.planner.measured import measure_fit


def _bound(processes: int) -> float:
    """Seconds for a test that launches ``processes`` processes of the tiny GPT (the
    calibration fixture's two included), each 4-5 CPU-seconds (a fresh interpreter, its
    build, two steps): 30 s a process with a core to itself, times the run queue per core
    where that is more (at load 12-15 on 2 cores the fixed 180 s and 120 s ran out with
    nothing hung)."""
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return 30.0 * processes * max(1.0, per_core)


def tiny_gpt(batch: int = 4):
    return gpt_family(d_model=16, heads=2, seq=8, vocab=64, batch=batch)


@pytest.fixture(scope="module")
def calibration() -> Calibration:
    """The tiny family's memory beyond the model's terms (one process: the 2-process runs
    below miss its peers' buffers, well within their bounds)."""
    return calibrate(tiny_gpt(batch=8))


# One test, so that one calibration serves both (a module's fixture is computed once per
# xdist worker, and the two halves went to two workers): a row and the next size up, then
# sharded replicas, each trained for real.
@pytest.mark.timeout(_bound(2 + 2 * 2 + 2))
@pytest.mark.slow
def test_verify_measures_the_found_model_the_next_size_up_and_sharded_replicas(calibration):
    family = tiny_gpt(batch=8)
    assert calibration.process > 0 and calibration.per_layer >= 0
    assert calibration.baseline > 100 * MiB  # Python, torch and gloo: a budget pays them
    budget = calibration.baseline + calibration.process + 1.0 * MiB
    result = capacity(
        family,
        memory_budget=budget,
        processes=2,
        overhead=calibration,
        stages=[2],
        replicas=[1],
        chunks=[2],
        schedules=["1f1b"],
        checkpoints=["always"],
    )
    found = result.best
    # one run each (the repeats' scatter is the fakes' subject below), side by side
    check = verify_capacity(family, found, repeats=1, parallel=2)
    assert check.found.fit == found and len(check.found.measured) == 2
    assert all(
        m > b > 100 * MiB for m, b in zip(check.found.measured, check.found.before, strict=True)
    )
    for ratio in _growth_ratios(check.found, calibration):
        assert 0.5 < ratio < 1.5  # measured within 50 % of predicted, beyond the baseline
    bigger = check.next_size
    assert bigger is not None and bigger.fit.depth == found.depth + 1
    assert not bigger.fit.fits and max(bigger.fit.peaks) > budget
    assert len(bigger.measured) == 2
    assert "next size" in check.describe() and "measured" in check.describe()

    layout = Layout(stages=1, replicas=2, shard="all", chunks=2, checkpoint="always")
    budget = calibration.baseline + calibration.process + 4 * MiB
    fit = fit_of(family, layout, 2, budget=budget, overhead=calibration)
    assert fit.fits and fit.terms()["gathered"] > 0
    measured = measure_fit(family, fit)
    assert measured.ran and len(measured.measured) == 2
    assert 0.5 < _growth_ratios(measured, calibration)[0] < 1.5


def _growth_ratios(measured, calibration: Calibration) -> list[float]:
    """Per stage, the measured growth over the predicted one (both beyond the baseline)."""
    k = measured.fit.layout.stages
    growth = [max(measured.growth[s::k]) for s in range(k)]
    return [g / (p - calibration.baseline) for g, p in zip(growth, measured.fit.peaks, strict=True)]


@pytest.mark.parametrize("predicted", [3, 5, 8, 40, 130])
def test_refine_settles_on_the_measured_answer(monkeypatch, predicted):
    # The machine says depth <= 5 fits, with a peak that says nothing of the distance (a
    # step): wherever the prediction starts, refine ends with the found depth measured
    # within the budget and the next one over it; the steps gallop (two runs a round),
    # then the bracket shrinks by at least a quarter a round.
    from gpipe.planner import measured as module

    family = tiny_gpt()
    layout = Layout(stages=1, chunks=1, checkpoint="always")
    ran = []

    def fake(family, fit, **options):
        ran.append(fit.depth)
        peak = fit.budget - 1 if fit.depth <= 5 else fit.budget + 1
        return module.Measured(fit, (peak,), 2, before=(0.0,))

    monkeypatch.setattr(module, "measure_fit", fake)
    fit = fit_of(family, layout, predicted, budget=100 * MiB)
    check = verify_capacity(family, fit, refine=True, moves=32, repeats=1)
    assert check.exact and check.found.fit.depth == 5 and check.next_size.fit.depth == 6
    assert check.predicted_depth == predicted and len(ran) == len(set(ran))  # none twice
    assert len(ran) <= 4 + 4 * math.log2(abs(predicted - 5) + 1), ran
    assert ("off by" in check.describe()) == (predicted != 5)


@pytest.mark.parametrize("answer", [20, 31, 42, 60])
def test_refine_aims_at_the_budget_from_the_measured_peaks(monkeypatch, answer):
    # Peaks that grow with depth as the prediction's do, but offset (the model's usual
    # error, a few MiB per stage): the first round measures the prediction and one block
    # more, the second aims from their peaks and decides; the repeats make a third.
    from gpipe.planner import measured as module

    family = tiny_gpt()
    layout = Layout(stages=1, chunks=1, checkpoint="always")
    fit = fit_of(family, layout, 30, budget=100 * MiB)
    block = fit_of(family, layout, 31, budget=fit.budget).peak - fit.peak
    rounds: list[list[int]] = []

    def fake(family, fit, **options):
        rounds[-1].append(fit.depth)
        peak = fit.budget + block * (fit.depth - answer - 0.5)  # answer fits, answer + 1 not
        return module.Measured(fit, (peak,), 2, before=(0.0,))

    def measure_fits(family, fits, **options):
        rounds.append([])
        return [fake(family, f) for f in fits]

    monkeypatch.setattr(module, "measure_fits", measure_fits)
    check = verify_capacity(family, fit, refine=True, moves=16, repeats=2)
    assert check.exact and check.found.fit.depth == answer, rounds
    assert len(rounds) <= 3 and sum(map(len, rounds)) <= 6, rounds
    assert check.launches == sum(map(len, rounds))  # every run counted, the repeats' too


def test_runs_measured_at_once_measure_what_they_measure_alone(monkeypatch):
    from gpipe.planner import measured as module

    family = tiny_gpt()
    layout = Layout(stages=1, chunks=1, checkpoint="always")
    fits = [fit_of(family, layout, d, budget=100 * MiB) for d in (3, 4, 5)]
    monkeypatch.setattr(
        module, "measure_fit", lambda family, fit, **o: module.Measured(fit, (fit.depth,), 2)
    )
    runs = module.measure_fits(family, fits, parallel=2)
    assert [m.fit.depth for m in runs] == [3, 4, 5]  # in their order


@pytest.mark.parametrize(("over", "exact"), [(3.0, True), (0.5, False)])
def test_exact_means_the_next_size_up_is_over_by_more_than_the_scatter(monkeypatch, over, exact):
    # Peaks move by 1 MiB between runs of one depth: a next size up 0.5 MiB over the budget
    # may fit in another run, so the row is the range 5-6, not "exact".
    from gpipe.planner import measured as module

    family = tiny_gpt()
    runs: dict[int, int] = {}

    def fake(family, fit, **options):
        runs[fit.depth] = runs.get(fit.depth, 0) + 1
        wobble = MiB * (runs[fit.depth] - 1)  # 0, then 1 MiB more
        peak = fit.budget - 2 * MiB if fit.depth <= 5 else fit.budget + over * MiB
        return module.Measured(fit, (peak + wobble,), 2, before=(0.0,))

    monkeypatch.setattr(module, "measure_fit", fake)
    layout = Layout(stages=1, chunks=1, checkpoint="always")
    fit = fit_of(family, layout, 5, budget=100 * MiB)
    check = verify_capacity(family, fit, refine=True, moves=16)
    assert runs == {5: 2, 6: 2}  # each depth measured again
    assert check.scatter == MiB and check.exact == exact
    assert check.depths == ((5, 5) if exact else (5, 6))
    assert ("exact: depth 5" if exact else "depth 5-6") in check.describe()


def test_a_found_depth_over_the_budget_in_a_repeat_is_the_range_below_it(monkeypatch):
    # Depth 5 fits by 0.5 MiB, then peaks 0.5 MiB over when run again: the runs decide 4-5.
    from gpipe.planner import measured as module

    family = tiny_gpt()
    runs: dict[int, int] = {}

    def fake(family, fit, **options):
        runs[fit.depth] = runs.get(fit.depth, 0) + 1
        wobble = MiB * (runs[fit.depth] - 1)
        peak = fit.budget - 0.5 * MiB if fit.depth <= 5 else fit.budget + 3 * MiB
        return module.Measured(fit, (peak + wobble,), 2, before=(0.0,))

    monkeypatch.setattr(module, "measure_fit", fake)
    layout = Layout(stages=1, chunks=1, checkpoint="always")
    check = verify_capacity(family, fit_of(family, layout, 5, budget=100 * MiB), refine=True)
    assert not check.exact and check.found.fit.depth == 5 and check.depths == (4, 5)
    assert "depth 4-5: a run of the found depth went over the budget" in check.describe()


def _check(found: list[tuple[float, ...]], bigger: list[tuple[float, ...]], budget: float = 100.0):
    """A check of depth 5 and the next size up, each run's peaks (MiB) by process."""
    from gpipe.planner.measured import CapacityCheck, Measured

    family = tiny_gpt()
    layout = Layout(stages=len(found[0]), chunks=1, checkpoint="always")
    fits = [fit_of(family, layout, d, budget=budget * MiB) for d in (5, 6)]
    runs = [[Measured(fits[i], tuple(p * MiB for p in peaks), 2) for peaks in each]
            for i, each in enumerate((found, bigger))]  # fmt: skip
    return CapacityCheck(runs[0][0], runs[1][0], fits[0], (*runs[0][1:], *runs[1][1:]))


def test_the_scatter_is_one_process_s_largest_spread_between_runs():
    # The runs' largest peaks spread 0.5 MiB (98.0, 98.5), process 0's 2 MiB (98.0, 96.0):
    # another run, or another launch, may read 98.5 + 2 = 100.5 at depth 5, over the budget
    # of 100. On the largest peaks' spread depth 5 would have been exact.
    check = _check([(98.0, 97.0), (96.0, 98.5)], [(103.0, 101.0), (103.5, 101.0)])
    assert check.scatter == 2 * MiB
    assert not check.exact and check.depths == (4, 5)


def test_exact_needs_the_found_depth_within_the_budget_by_more_than_the_scatter():
    clear = _check([(97.0, 95.0), (97.5, 95.0)], [(101.0, 99.0), (101.5, 99.0)])
    assert clear.scatter == 0.5 * MiB and clear.exact and clear.depths == (5, 5)
    close = _check([(99.8, 95.0), (99.3, 95.0)], [(103.0, 99.0), (103.5, 99.0)])
    assert not close.exact and close.depths == (4, 5)  # 99.8 is 0.2 under; another run
    assert "the found depth is not within the budget by more than it" in close.describe()
    both = _check([(99.8, 95.0), (99.3, 95.0)], [(100.2, 99.0), (100.5, 99.0)])
    assert both.depths == (4, 6)  # neither side decided: three depths
