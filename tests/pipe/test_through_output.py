"""``pipe(x)`` in training, in one process: outputs connected to autograd (the stages' side:
engine/test_autograd_path), its own micro-batch count, and what a failed call leaves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.pipe import through_output
from reference import relative_error, running_stats_of_unsplit_batch, twin


class FailsOnDemand(nn.Module):
    fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("asked to fail")
        return x


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), FailsOnDemand(), nn.Linear(6, 3)
    ).double()


def test_chunks_of_the_call_give_the_unsplit_gradients_and_one_batch_norm_update():
    plain, initial = model(), model()
    pipe = gpipe.Pipe(twin(plain), balance=[3, 2], chunks=4, deferred_batch_norm=True)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    out = through_output.forward(pipe, x, chunks=2)
    F.cross_entropy(out, y).backward()
    for x_m, y_m in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
        (F.cross_entropy(plain(x_m), y_m) * len(x_m) / len(x)).backward()
    ours = dict(pipe.named_parameters())
    for name, theirs in plain.named_parameters():
        assert relative_error(ours[name].grad, theirs.grad) < 1e-10, name
    state = pipe.state_dict()
    for key, value in running_stats_of_unsplit_batch(initial, x, 2).items():
        assert relative_error(state[key], value) < 1e-10, key


def test_a_failed_call_leaves_no_batch_norm_statistics_behind(monkeypatch):
    initial = model()
    pipe = gpipe.Pipe(twin(initial), balance=[3, 2], chunks=2, deferred_batch_norm=True)
    monkeypatch.setattr(FailsOnDemand, "fail", True)  # after stage 0's batch norm has run
    with pytest.raises(RuntimeError, match="asked to fail"):
        pipe(torch.randn(6, 4, dtype=torch.float64))
    monkeypatch.setattr(FailsOnDemand, "fail", False)
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe(x)
    state = pipe.state_dict()
    for key, value in running_stats_of_unsplit_batch(initial, x, 2).items():
        assert relative_error(state[key], value) < 1e-10, key


def test_across_processes_the_call_says_to_train_with_step():
    with pytest.raises(RuntimeError, match=r"rank 1 of a pipeline over processes.*pipe\.step"):
        through_output.forward(SimpleNamespace(rank=1), torch.zeros(2, 4))
