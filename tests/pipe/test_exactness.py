"""``gpipe.check``: exact on a plain model, and an inexact one named with its
cause (the library; the command: cli/test_check.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import gpipe


def tiny() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(5, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    )


def tiny_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(10, 5, generator=generator), torch.randint(0, 3, (10,), generator=generator)


def summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that sums over samples, which gpipe cannot see (no reduction='sum' declared)."""
    return F.cross_entropy(out, target, reduction="sum")


def _double(value):
    return value.double() if value.is_floating_point() else value


def test_a_plain_model_is_exact_with_every_schedule_kind():
    for schedule in ("1f1b", "zb-h1"):
        report = gpipe.check(tiny, F.cross_entropy, None, tiny_batch(), chunks=3, schedule=schedule)
        assert report.exact, report
        assert str(report).startswith("exact (worst |Δ| = ")
        assert f"6 parameters, K=2, M=3, schedule {schedule}" in str(report)


def test_an_undeclared_sum_is_flagged_with_the_parameter_and_the_cause():
    model = tiny()
    model[3].register_forward_hook(lambda module, args, out: out)  # a hook: named as well
    report = gpipe.check(model, summed, None, tiny_batch(), chunks=3, schedule="1f1b")
    assert not report.exact
    text = str(report)
    assert text.startswith("NOT exact") and "5.weight" in text  # the worst parameters by name
    assert report.relative > 0.1
    assert any("reduction='sum'" in cause for cause in report.causes), report.causes
    assert any("forward hook on 3" in cause for cause in report.causes), report.causes
    declared = gpipe.check(tiny, summed, None, tiny_batch(), chunks=3, reduction="sum")
    assert declared.exact, declared


def test_class_weights_and_a_loss_reading_the_model_are_named():
    weights = torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64)
    shown = nn.CrossEntropyLoss(weight=weights)  # gpipe reads the weights off the module
    assert gpipe.check(tiny, shown, None, tiny_batch(), chunks=3).exact

    def weighted(out, target):  # the same weights, hidden inside a function
        return F.cross_entropy(out, target, weight=weights)

    report = gpipe.check(tiny, weighted, None, tiny_batch(), chunks=3)
    assert not report.exact and "class weights" in report.causes[0], report
    model = tiny()

    def regularized(out, target):
        return F.cross_entropy(out, target) + 1e-2 * model[0].weight.pow(2).sum()

    report = gpipe.check(model, regularized, None, tiny_batch(), chunks=3)
    assert not report.exact and "reads the model's own parameters (0.weight)" in str(report)


def test_the_loss_parameters_and_a_private_generator_are_compared():
    class Temperature(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.Parameter(torch.tensor(1.5))

        def forward(self, out, target):
            return F.cross_entropy(out * self.t, target)

    report = gpipe.check(tiny, Temperature(), None, tiny_batch(), chunks=3, schedule="1f1b")
    assert report.exact and report.parameters == 7, report  # the loss's t counted

    class Noise(nn.Module):
        def __init__(self):
            super().__init__()
            self.generator = torch.Generator().manual_seed(0)

        def forward(self, x):
            return x * (torch.rand(x.shape, generator=self.generator, dtype=x.dtype) > 0.3)

    def noisy():
        return nn.Sequential(nn.Linear(5, 8), Noise(), nn.Linear(8, 3))

    report = gpipe.check(noisy, F.cross_entropy, None, tiny_batch(), chunks=2,
                         checkpoint="always")  # fmt: skip
    if not report.exact:  # a recomputation draws again, unless gpipe replays the generator
        assert any("own torch.Generator" in cause for cause in report.causes), report
