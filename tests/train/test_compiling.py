"""``--compile``: a pipeline of compiled layers against the un-split eager model, per parameter.

Float64, so that a kernel that fuses and sums in another order differs by ~1e-16 and anything
wrong (another dropout mask, a stale recomputation, a lost gradient) by far more than the
1e-10 every engine test allows. Dropout is on and stages re-materialize, so the masks of the
first forward, of its recomputation and of the reference must agree.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import gpipe
from gpipe.models import GPTConfig, gpt, lm_loss
from gpipe.train.compiling import compile_stages, reset
from reference import reference_step, worst_gradient_error


@pytest.fixture(autouse=True)
def _float64_and_fresh_graphs():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
    reset()


def _steps(model, x, y, loss_fn, *, backend, steps=2, **options):
    """``steps`` pipeline steps with compiled layers against the eager reference; the worst
    gradient error and the largest loss difference."""
    reference = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, chunks=4, **options)
    assert compile_stages(pipe.stages, backend=backend) == len(reference)
    counters.clear()
    worst, loss_gap = 0.0, 0.0
    for seed in range(steps):
        for p in (*pipe.parameters(), *reference.parameters()):
            p.grad = None
        loss = pipe.step(x, y, loss_fn, seed=seed)
        expected = reference_step(reference, x, y, loss_fn, chunks=4, seed=seed)
        worst = max(worst, worst_gradient_error(pipe, reference)[0])
        loss_gap = max(loss_gap, abs(float(loss) - float(expected)))
    # Every layer ran compiled: dynamo captured a graph for each frame it was given (one that
    # it gives up on runs eagerly, which would pass the comparison without testing anything).
    frames = counters["frames"]
    assert frames["total"] == frames["ok"] >= len({type(layer) for layer in reference})
    return worst, loss_gap


@pytest.mark.parametrize(
    ("schedule", "remat"),
    [("gpipe", "always"), ("1f1b", "never"), ("zb-h1", "except_last")],
)
def test_compiled_layers_give_the_eager_models_gradients(schedule, remat):
    # aot_eager: torch.compile's capture and autograd (dynamo, AOTAutograd, decompositions)
    # without inductor's code generation, which costs a minute on CPU (tested below).
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, context=8, d_model=16, n_heads=2, n_layers=2, dropout=0.1)
    x, y = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    worst, loss_gap = _steps(
        gpt(config), x, y, lm_loss, backend="aot_eager",
        balance=[2, 2], schedule=schedule, checkpoint=remat,
    )  # fmt: skip
    assert worst <= 1e-10 and loss_gap <= 1e-10


@pytest.mark.slow  # inductor generates and compiles C++: tens of seconds on 2 cores
@pytest.mark.timeout(240)
def test_inductor_compiled_layers_give_the_eager_models_gradients():
    # Two kinds of layer, each compiled for a forward with and without a graph (re-
    # materialization): four graphs, the fewest that show inductor's dropout is eager's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    worst, loss_gap = _steps(
        model, x, y, nn.functional.mse_loss, backend="inductor",
        balance=[2, 2], schedule="gpipe", checkpoint="always",
    )  # fmt: skip
    assert worst <= 1e-10 and loss_gap <= 1e-10
