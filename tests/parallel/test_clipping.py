"""``gpipe.parallel.clipping`` in one process: what the watch measures when an optimizer
steps, and that a refusal comes before the optimizer changes a weight. (Across processes,
with every layout: tests/test_user_patterns.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe.base._utils import gradient_norms
from gpipe.parallel.clipping import (
    OTHER,
    SCALED,
    UNTOUCHED,
    ClippedPerStageError,
    Edit,
    GradientWatch,
    check_edits,
)


def _stepped(edit) -> list[Edit]:
    """A watch over a layer's gradients, ``edit`` applied, then an optimizer step."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    layer(torch.randn(5, 4, dtype=torch.float64)).square().sum().backward()
    seen: list[Edit] = []
    watch = GradientWatch(seen.append)
    params = list(layer.parameters())
    watch.note(params, gradient_norms([p.grad for p in params]), None)
    edit(layer)
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    return seen


@pytest.mark.parametrize(
    ("edit", "kind", "factor"),
    [
        (lambda m: None, UNTOUCHED, None),
        (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3), SCALED, None),
        (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9), SCALED, 1.0),
        (lambda m: [p.grad.div_(4) for p in m.parameters()], SCALED, 0.25),
        (lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3), OTHER, None),
    ],
    ids=["untouched", "clipped", "clip-of-one", "divided", "clipped-by-value"],
)
def test_the_watch_measures_the_edit_when_the_optimizer_steps(edit, kind, factor):
    seen = _stepped(edit)
    assert len(seen) == 1 and seen[0].kind == kind
    if factor is not None:
        assert seen[0].factor == pytest.approx(factor, rel=1e-12) and seen[0].writes == 1


def test_a_refusal_comes_before_the_optimizer_changes_a_weight():
    def refuse(edit: Edit) -> None:
        check_edits(torch.tensor([edit.row(), Edit(SCALED, 0.5, 1, 1e-9).row()]))

    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    layer(torch.randn(5, 4)).sum().backward()
    watch = GradientWatch(refuse)
    watch.note(list(layer.parameters()), gradient_norms([p.grad for p in layer.parameters()]), None)
    torch.nn.utils.clip_grad_norm_(layer.parameters(), 1e-3)
    before = [p.detach().clone() for p in layer.parameters()]
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.raises(ClippedPerStageError, match=r"refused \(no weight changed\).*pipe\.clip"):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before, strict=True))
    optimizer.step()  # checked once per step: the script may go on (and trains as it asks)


@pytest.mark.parametrize(
    ("rows", "refused"),
    [
        ([Edit(SCALED, 0.5, 1, 1e-9), Edit(SCALED, 0.5, 1, 1e-9)], False),  # same factor
        ([Edit(SCALED, 0.5, 1, 1e-9), Edit(SCALED, 0.7, 1, 1e-9)], True),  # per-stage clip
        ([Edit(SCALED, 1.0, 1, 1e-9), Edit(SCALED, 1.0, 1, 1e-9)], True),  # clip of one
        ([Edit(SCALED, 1.0, 0, 1e-9), Edit(SCALED, 1.0, 0, 1e-9)], False),  # scaler only
        ([Edit(UNTOUCHED), Edit(UNTOUCHED)], False),
        ([Edit(OTHER), Edit(OTHER)], False),
    ],
)
def test_check_edits_refuses_a_per_stage_clip_only(rows, refused):
    table = torch.tensor([edit.row() for edit in rows], dtype=torch.float64)
    if refused:
        with pytest.raises(ClippedPerStageError):
            check_edits(table)
    else:
        check_edits(table)
