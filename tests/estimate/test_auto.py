"""``Pipe(balance="auto")``: profile on a sample, cut where it is fastest."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.base.errors import PartitionError
from gpipe.estimate.auto import auto_balance
from reference import twin


def test_what_auto_balance_needs_is_named_with_the_remedy():
    model, sample = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), torch.randn(2, 2)
    plan = dict(chunks=1, checkpoint="never", schedule="gpipe", virtual_stages=1)

    def auto(module=model, balance="auto", sample=sample, devices=("cpu", "cpu"), **options):
        return auto_balance(module, balance, sample, devices, lambda run: run(), **options, **plan)

    assert auto() == [1, 1]
    with pytest.raises(PartitionError, match="a list of ints or 'auto', got 'fast'"):
        auto(balance="fast")
    with pytest.raises(PartitionError, match="pass sample=<one micro-batch of inputs>"):
        auto(sample=None)
    with pytest.raises(PartitionError, match="needs the built model, not a factory"):
        auto(module=lambda: model)
    with pytest.raises(PartitionError, match=r"pass devices=\[\.\.\.\], one per stage"):
        auto(devices=None)
    with pytest.raises(PartitionError, match="sample_loss must be a pair"):
        auto(sample_loss=(sample, None))


def test_pipe_auto_balance_times_the_loss_the_last_stage_adds():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(128, 128) for _ in range(8)))
    x, y = torch.randn(64, 128), torch.randn(64, 128)

    def costly_loss(out, target):
        # A loss that costs at least 20 ms (the profile's wall clock), over ten times the
        # whole model's forward and backward: no busy machine's scheduling can hide it.
        time.sleep(0.02)
        return F.mse_loss(out, target)

    options = dict(balance="auto", sample=x, devices=["cpu"] * 2, chunks=2)
    without = gpipe.Pipe(twin(model), **options).balance
    with_loss = gpipe.Pipe(twin(model), sample_loss=(y, costly_loss), **options).balance
    # Without the loss, equal layers cut near the middle (how near, a busy machine decides).
    assert with_loss == [7, 1] and without[-1] > 1, (without, with_loss)
    with pytest.raises(PartitionError, match=r"sample_loss must be a pair \(target, loss_fn\)"):
        gpipe.Pipe(twin(model), sample_loss=y, **options)
