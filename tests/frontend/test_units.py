"""A captured model as units: an ``nn.Sequential`` that Pipe takes, each named by where it runs."""

from __future__ import annotations

import torch

from captured_models import Blocks
from gpipe.frontend import capture


def test_units_are_named_by_where_they_run():
    model = Blocks().double()
    units = capture(model, (torch.randn(3, 4, dtype=torch.float64),), split="blocks")
    assert [u.unit_name for u in units] == ["blocks.0", "blocks.1", "after blocks.1"]
    assert repr(units[0]) == "Unit('blocks.0', 20 parameters)"
    x = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(units(x), model(x))
