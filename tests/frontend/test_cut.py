"""Cutting a captured graph into units at named modules, carrying what crosses each cut."""

from __future__ import annotations

import pytest
from torch import nn

from captured_models import CASES, captured
from gpipe.frontend import CaptureError, capture


def test_a_value_that_jumps_cuts_is_carried():
    _, units = captured("skips")
    # enc1's output crosses the cuts before enc2, mid, dec2 and dec1.
    assert [u.unit_name for u in units] == CASES["skips"].split
    carried, sizes = CASES["skips"].batch()[0], []
    for unit in units[:-1]:
        carried = unit(carried)
        sizes.append(len(carried))
    # a = tanh(enc1(x)) rides along until dec1 adds it: (a), (a, b, drop(b)), (a, c + b),
    # (d + a); dropout is not a split module, so it runs with enc2, before the cut.
    assert sizes == [1, 3, 2, 1]


def test_split_modules_out_of_order_or_never_run_are_refused():
    case = CASES["skips"]
    model = case.build()
    with pytest.raises(CaptureError, match="runs enc1 before enc2 has finished"):
        capture(model, case.example(), split=["enc2", "enc1"])
    model.unused = nn.Linear(2, 2)
    with pytest.raises(CaptureError, match=r"\['unused'\] do no work"):
        capture(model, case.example(), split=["enc1", "unused"])
