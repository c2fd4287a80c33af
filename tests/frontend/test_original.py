"""train() and eval() of a captured model: the Pipe follows the original model's mode at every
call, ``pipe.train()``/``eval()`` set the model's, and dropout is on exactly when the plain
model's is. Dropout with ``p=1`` on a residual branch makes train mode deterministic, so both
modes are compared with the plain model in float64, per parameter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.frontend import CaptureError, capture

BATCH = 12


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.drop = nn.Dropout(p=1.0)  # train(): the branch is dropped entirely
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + self.drop(torch.tanh(block(x)))
        return self.head(self.norm(x))


def build() -> Net:
    torch.manual_seed(0)
    model = Net().double()
    with torch.no_grad():  # statistics unlike a fresh batch's, so that modes differ
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,))


def plain_step(model: nn.Module, x, y, chunks: int = 1) -> dict[str, torch.Tensor]:
    """The plain model's gradients over ``chunks`` micro-batches (batch norm in train mode
    normalizes each by its own statistics, as the pipeline does)."""
    model = copy.deepcopy(model)
    for xs, ys in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks), strict=True):
        (F.cross_entropy(model(xs), ys) * len(ys) / len(y)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def step_error(pipe: gpipe.Pipe, model: nn.Module, x, y) -> float:
    expected = plain_step(model, x, y, pipe.chunks)
    for p in pipe.parameters():
        p.grad = None
    pipe.step(x, y, F.cross_entropy)
    got = dict(pipe.named_parameters())
    return max(float((got[n].grad - g).abs().max()) for n, g in expected.items())


def pipe_of(model: nn.Module) -> gpipe.Pipe:
    x, _ = batch()
    return gpipe.Pipe.from_model(model, x[:2], split="blocks", balance=[2, 3], chunks=3)


def test_the_models_eval_and_train_reach_the_pipe():
    model = build()
    pipe = pipe_of(model)
    x, y = batch()
    model.eval()
    assert step_error(pipe, model, x, y) <= 1e-10
    assert not pipe.training
    with torch.no_grad():
        first, second = pipe(x), pipe(x)
        torch.testing.assert_close(first, model(x), rtol=0, atol=1e-12)
    assert torch.equal(first, second)  # no dropout in evaluation
    model.train()
    assert step_error(pipe, model, x, y) <= 1e-10
    assert pipe.training
    with torch.no_grad():
        assert not torch.allclose(pipe(x), first)  # the dropped branches are dropped again


def test_pipe_train_and_eval_set_the_models_mode():
    model = build()
    pipe = pipe_of(model)
    x, y = batch()
    pipe.eval()
    assert not any(m.training for m in model.modules())
    assert step_error(pipe, model, x, y) <= 1e-10
    pipe.train()
    assert all(m.training for m in model.modules())
    assert step_error(pipe, model, x, y) <= 1e-10
    with torch.no_grad():
        model.eval()
        evaluated = model(x)
        model.train()
        assert not torch.allclose(pipe(x), evaluated)


def test_a_frozen_batch_norm_keeps_its_own_mode():
    model = build()
    pipe = pipe_of(model)
    x, y = batch()
    pipe.eval()
    model.train()
    model.norm.eval()  # fine-tuning with frozen statistics: the model's own module, kept
    statistics = model.norm.running_mean.clone()
    assert step_error(pipe, model, x, y) <= 1e-10
    assert torch.equal(model.norm.running_mean, statistics)
    assert pipe.training and not model.norm.training


def test_a_module_in_another_mode_than_the_model_is_refused():
    model = build()
    pipe = pipe_of(model)
    x, y = batch()
    model.drop.eval()  # inlined in the units' graphs: one mode for all of them
    with pytest.raises(CaptureError, match=r"drop \(Dropout\) is in eval\(\) mode .*\(model.train"):
        pipe.step(x, y, F.cross_entropy)
    model.train()
    assert step_error(pipe, model, x, y) <= 1e-10


def test_capture_leaves_every_module_in_its_mode():
    model = build()
    model.norm.eval()
    capture(model, batch()[0][:2], split="blocks")
    assert model.training and model.drop.training and not model.norm.training


def test_an_inference_only_capture_runs_the_eval_graph_in_both_modes():
    model = build().eval()
    x = batch()[0]
    units = capture(model, x[:2], split="blocks", inference_only=True)
    undropped = copy.deepcopy(model).train()
    undropped.drop.eval()  # the eval() graph has no dropout; batch norm is the module's call
    with torch.no_grad():
        expected = {False: model(x), True: undropped(x)}
        for mode in (False, True):
            units.train(mode)
            torch.testing.assert_close(units(x), expected[mode], rtol=0, atol=1e-12)


def test_a_pipe_captured_for_inference_only_evaluates_and_refuses_to_train():
    model = build().eval()
    x, y = batch()
    pipe = gpipe.Pipe.from_model(
        model, x[:2], split="blocks", balance=[2, 3], chunks=3, inference_only=True
    )
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)
    remedy = r"inference_only=True \(its eval\(\) graph only\): build it with Pipe.from_model"
    with pytest.raises(CaptureError, match=rf"^pipe.step trains, .*{remedy}"):
        pipe.step(x, y, F.cross_entropy)
    model.train()  # a forward with autograd would train on the eval() graph too
    with pytest.raises(CaptureError, match=rf"^a forward in train\(\) mode .*{remedy}"):
        pipe(x)
    assert all(p.grad is None for p in pipe.parameters())
