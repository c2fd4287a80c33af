"""gpipe.base.rng: which layers are seeded, and that sparing the others changes no mask."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.base import rng
from reference import reference_step, relative_error, twin, worst_gradient_error


class Noise(nn.Module):
    """A custom layer that draws: gpipe cannot see that it does, so it must seed it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn_like(x)


class MyLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(super().forward(x), 0.3, self.training)


@pytest.mark.parametrize(
    ("module", "draws"),
    [
        (nn.Linear(4, 4), False),
        (nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.LayerNorm(4)), False),
        (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), True),
        (nn.RReLU(), True),  # random slopes in training
        (nn.MultiheadAttention(4, 2, dropout=0.1), True),  # dropout without a Dropout module
        (MyLinear(4, 4), True),  # a subclass may override forward
        (Noise(), True),
    ],
)
def test_only_layers_known_to_draw_nothing_are_spared(module, draws):
    assert rng.draws_nothing(module) is not draws


def test_masks_match_the_seeded_reference_when_some_layers_are_spared():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Dropout(0.5), nn.ReLU(), Noise(), nn.Linear(8, 8),
        MyLinear(8, 8), nn.Tanh(), nn.Linear(8, 3),
    )  # fmt: skip
    reference = twin(model)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    for schedule, checkpoint in [("gpipe", "always"), ("1f1b", "never"), ("zb-h1", "always")]:
        pipe = gpipe.Pipe(
            twin(model), balance=[3, 2, 3], devices=["cpu"] * 3, chunks=4,
            schedule=schedule, checkpoint=checkpoint,
        )  # fmt: skip
        loss = pipe.step(x, y, F.mse_loss, seed=11)
        reference.zero_grad(set_to_none=True)
        expected = reference_step(reference, x, y, F.mse_loss, chunks=4, seed=11)
        assert relative_error(loss, expected) <= 1e-10, schedule
        worst, where = worst_gradient_error(pipe, reference)
        assert worst <= 1e-6, (schedule, where)
