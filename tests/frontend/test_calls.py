"""``pipe(x)`` where a call of the model would be: inside ``torch.inference_mode()`` it gives
the model's output, and a backward through it says to train with ``pipe.step``."""

from __future__ import annotations

import torch
from torch import nn

import gpipe
from captured_models import CASES

CASE = CASES["resnet"]  # batch norm: buffers that a train-mode call updates


def pipe_of(model: nn.Module) -> gpipe.Pipe:
    return gpipe.Pipe.from_model(model, CASE.example(), split=CASE.split, chunks=3)


def test_a_call_under_inference_mode_gives_the_models_output_before_and_after_a_step():
    model = CASE.build()
    pipe = pipe_of(model)  # one capture for both calls: it is the costly part
    x, y = CASE.batch()
    for stepped in (False, True):  # the first call of a Pipe, then one after training
        if stepped:
            pipe.step(x, y, CASE.loss)
        pipe.eval()
        with torch.inference_mode():
            out = pipe(x)
            expected = model(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        pipe.train()
    pipe.step(x, y, CASE.loss)  # and training goes on


def test_a_call_without_autograd_or_in_evaluation_builds_no_graph():
    pipe = gpipe.Pipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), chunks=2)
    x = torch.randn(6, 4)
    with torch.no_grad():
        assert not pipe(x).requires_grad
    assert not pipe.eval()(x).requires_grad  # evaluation: a plain tensor


def test_a_captured_models_output_structure_is_kept_and_trains_through_a_backward():
    model = CASES["skips"].build()
    pipe = gpipe.Pipe.from_model(model, CASES["skips"].example(), split=CASES["skips"].split)
    x, _ = CASES["skips"].batch()
    out = pipe(x)  # training, autograd on: connected to autograd (gpipe.pipe.through_output)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=0, atol=1e-12)
    out.sum().backward()
    model(x).sum().backward()
    grads = dict(pipe.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=0, atol=1e-10)
