"""Recording a factory on meta: what a replay cannot reproduce is refused, by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe.materialize import build

OUTSIDE = torch.empty(4, device="meta")


class FromOutside(nn.Module):
    def __init__(self, derived: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(OUTSIDE * 2 if derived else OUTSIDE)


@pytest.mark.parametrize("derived", [False, True])
def test_tensors_build_cannot_reproduce_are_named(derived):
    factory = lambda: nn.Sequential(nn.Linear(4, 4), FromOutside(derived))  # noqa: E731
    with pytest.raises(ValueError) as info:
        build(factory, seed=0, layers=[1])
    message = str(info.value)
    assert "1.weight (a Parameter of FromOutside)" in message
    assert "outside factory()" in message and "Remedy:" in message
    assert "0.weight" not in message
    build(factory, seed=0, layers=[0])  # not local: fine


def test_a_random_value_read_into_python_is_rejected():
    def factory() -> nn.Sequential:
        width = 4 + int(torch.randint(0, 4, (), device="cpu").item())
        return nn.Sequential(nn.Linear(4, width))

    with pytest.raises(ValueError, match=r"reads a randomly drawn value back into Python"):
        build(factory, seed=0)
    with pytest.raises(ValueError, match=r"failed on the meta device.*must not read tensor"):
        build(lambda: nn.Sequential(nn.Linear(2, int(torch.ones(()).item()))), seed=0)
