"""Re-materialization: which micro-batches recompute, and what a layer sees while they do."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.base import remat
from reference import twin


def test_the_modes_say_which_micro_batches_run_their_forward_twice():
    assert [remat.recomputes("always", m, 3) for m in range(3)] == [True, True, True]
    assert [remat.recomputes("except_last", m, 3) for m in range(3)] == [True, True, False]
    assert [remat.recomputes("never", m, 3) for m in range(3)] == [False, False, False]
    assert remat.recompute_fraction("except_last", 4) == 0.75
    with pytest.raises(ValueError, match="checkpoint must be one of always, except_last, never"):
        remat.recomputes("sometimes", 0, 2)


def test_a_replayed_layer_is_not_recomputing_but_is_rematerializing():
    assert not remat.is_recomputing() and not remat.rematerializing()
    with remat.recomputing():
        assert remat.is_recomputing() and remat.rematerializing()
        with remat.replaying():
            assert not remat.is_recomputing() and remat.rematerializing()
        assert remat.is_recomputing()
    assert not remat.is_recomputing() and not remat.rematerializing()


class Recorder(nn.Module):
    """Identity that records whether each call is a recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bool] = []

    def forward(self, x):
        self.calls.append(gpipe.is_recomputing())
        return x


@pytest.mark.parametrize(
    ("checkpoint", "recomputed"), [("always", 4), ("except_last", 3), ("never", 0)]
)
def test_is_recomputing(checkpoint, recomputed):
    recorder = Recorder()
    model = nn.Sequential(nn.Linear(4, 4), recorder, nn.Linear(4, 2))
    pipe = gpipe.Pipe(model, balance=[2, 1], chunks=4, checkpoint=checkpoint)
    pipe.step(torch.randn(8, 4), torch.randint(0, 2, (8,)), F.cross_entropy)
    assert recorder.calls.count(False) == 4
    assert recorder.calls.count(True) == recomputed
    assert not gpipe.is_recomputing()


def test_recompute_happens_right_before_backward():
    """GPipe order on one stage: all forwards, then per micro-batch recompute + backward."""
    events = []

    class Probe(nn.Module):
        def forward(self, x):
            events.append(("R" if gpipe.is_recomputing() else "F", x.shape[0]))
            return x

    model = nn.Sequential(Probe(), nn.Linear(3, 2))
    pipe = gpipe.Pipe(model, balance=[2], chunks=3, checkpoint="always")
    x = torch.randn(6, 3)
    x[:, 0] = torch.arange(6.0)
    pipe.step(x, torch.randint(0, 2, (6,)), F.cross_entropy)
    assert [kind for kind, _ in events] == ["F", "F", "F", "R", "R", "R"]


def test_plain_batch_norm_is_not_updated_twice_by_recomputation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    never = gpipe.Pipe(twin(model), balance=[2, 1], chunks=2, checkpoint="never")
    always = gpipe.Pipe(twin(model), balance=[2, 1], chunks=2, checkpoint="always")
    never.step(x, y, F.cross_entropy)
    always.step(x, y, F.cross_entropy)
    assert int(always.state_dict()["1.num_batches_tracked"]) == 2  # once per micro-batch
    for key, value in never.state_dict().items():
        assert torch.allclose(always.state_dict()[key], value), key
