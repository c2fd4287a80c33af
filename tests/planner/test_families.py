"""A family's deeper members from one small profile: the extrapolation against a real one."""

from __future__ import annotations

import pytest
import torch

from gpipe.estimate.profile import profile
from gpipe.planner.families import FamilyCosts, gpt_family, resnet_family


def tiny_gpt(batch: int = 4):
    return gpt_family(d_model=16, heads=2, seq=8, vocab=64, batch=batch)


@pytest.mark.parametrize(
    "family, depth",
    [(tiny_gpt(), 5), (resnet_family(channels=4, image=8, batch=4), 3)],
    ids=["gpt", "resnet"],
)
def test_extrapolated_profile_matches_a_measured_deeper_one(family, depth):
    costs = FamilyCosts(family)
    predicted = costs.at(depth, 2)
    torch.manual_seed(0)
    model = family.build(depth)
    x, y = family.batch(2)
    measured = profile(model, x, target=y, loss_fn=family.loss_fn, repeats=1, warmup=0)
    assert len(predicted) == len(measured)
    fields = ("param_bytes", "buffer_bytes", "input_bytes", "output_bytes", "saved_bytes",
              "saved_input_bytes", "saved_output_bytes")  # fmt: skip
    for p, m in zip(predicted.layers, measured.layers, strict=True):
        assert p.name == m.name
        for name in fields:
            assert getattr(p, name) == pytest.approx(getattr(m, name), rel=0.02), (p.name, name)
    assert costs.parameters(depth) == sum(p.numel() for p in model.parameters())


def test_parameters_are_counted_before_any_profile_is_asked_for():
    family = tiny_gpt()
    model = family.build(7)
    assert FamilyCosts(family).parameters(7) == sum(p.numel() for p in model.parameters())
