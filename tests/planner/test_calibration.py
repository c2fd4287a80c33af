"""The calibration's runs and the four terms fitted from their peaks (the runs themselves
are measured in ``test_measured.py``'s fixture)."""

from __future__ import annotations

import pytest

from gpipe.base._utils import MiB
from gpipe.estimate.memory_model import Calibration
from gpipe.planner.calibration import _fitted, _runs
from gpipe.planner.capacity import fit_of
from gpipe.planner.families import gpt_family
from gpipe.planner.measured import Measured

TRUTH = Calibration(process=30 * MiB, per_layer=0.05 * MiB, per_stage_layer=0.2 * MiB,
                    baseline=200 * MiB)  # fmt: skip


def peaks_of(family, processes: int, truth: Calibration) -> list[Measured]:
    """The calibration's runs, each process peaking at its terms plus ``truth``'s."""
    rows = []
    for layout, depth, balance in _runs(family, processes, layers=8):
        fit = fit_of(family, layout, depth, budget=float("inf"), balance=balance)
        n = len(family.kinds(depth))
        peaks = tuple(
            m.total + truth.at(n) + truth.per_stage_layer * layers
            for m, layers in zip(fit.memory, fit.balance, strict=True)
        )
        before = (truth.baseline,) + (truth.baseline - MiB,) * (layout.stages - 1)
        rows.append(Measured(fit, peaks, 2, before=before))
    return rows


def test_the_four_terms_are_recovered_from_the_runs_peaks():
    family = gpt_family(d_model=16, heads=2, seq=8, vocab=64, batch=4)
    rows = peaks_of(family, 2, TRUTH)
    assert [r.fit.layout.stages for r in rows] == [1, 1, 2, 2]
    assert rows[3].fit.balance[-1] == 1  # the last stage holds the last layer alone
    assert len(family.kinds(rows[3].fit.depth)) >= 32  # a long lever: 4 x 8 layers
    fitted = _fitted(family, rows, 2)
    for name in ("process", "per_layer", "per_stage_layer", "baseline"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUTH, name), abs=1e3), name


def test_one_process_charges_the_whole_slope_to_the_stage():
    family = gpt_family(d_model=16, heads=2, seq=8, vocab=64, batch=4)
    rows = peaks_of(family, 1, TRUTH)
    assert len(rows) == 2
    fitted = _fitted(family, rows, 1)
    assert fitted.per_layer == 0.0
    slope = TRUTH.per_layer + TRUTH.per_stage_layer
    assert fitted.per_stage_layer == pytest.approx(slope, abs=1e3)
    assert fitted.baseline == TRUTH.baseline
