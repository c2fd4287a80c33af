"""Models and losses whose gradients take every path a split backward must follow, trained
plain and pipelined (one process in tests/engine/test_gradient_paths.py; the processes it
launches run :func:`rank_steps`).

* ``passed-on``: a stage computes a bias from its parameter alone, uses it and passes it on
  to the next stages (a relative position bias shared down the stack);
* ``temperature``: a loss with a learnable temperature of its own (a closure's tensor);
* ``adaptive``: ``nn.AdaptiveLogSoftmaxWithLoss`` as the criterion (a loss module);
* ``own-regularizer``: a loss that reads the last stage's own weight;
* ``input-grad``: the user's input requires grad (``x.grad`` as the plain model's);
* ``generator``: a layer drawing from its own ``torch.Generator`` (re-materialized: drawn
  again from the state its first forward found).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gpipe
from reference import reference_step, relative_error

WIDTH = 6
BALANCE = [2, 2, 1, 1]  # the bias is made on stage 1, used there and on stages 2 and 3
CASES = ["passed-on", "temperature", "adaptive", "own-regularizer", "input-grad", "generator"]
# (schedule, devices, virtual stages) that run the four stages of BALANCE
SCHEDULES = [
    ("gpipe", 4, None),
    ("1f1b", 4, None),
    ("zb-h1", 4, None),
    ("zb-v", 2, None),
    ("dualpipe-v", 2, None),
    ("zb-auto", 4, 1),
]


class PositionBias(nn.Module):
    """A bias from the parameter alone: used here and passed on with the activation."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x):
        bias = self.p.tanh() * 2
        return x + bias, bias


class UsesBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, packet):
        h, bias = packet
        return torch.tanh(self.linear(h) * bias), bias


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, packet):
        h, bias = packet if isinstance(packet, tuple) else (packet, 0)
        return self.linear(h + bias)


class OwnDropout(nn.Module):
    """Dropout from a generator of its own (not gpipe's per-layer seeding)."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x):
        keep = torch.rand(x.shape, generator=self.generator, dtype=x.dtype) > 0.4
        return x * keep / 0.6


class Reentrant(nn.Module):
    """A checkpoint that runs its own backward inside B (no split possible)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True)


def model_of(case: str) -> nn.Sequential:
    torch.manual_seed(0)
    if case == "reentrant":
        layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), Reentrant(), nn.Tanh(), Reentrant()]
    elif case == "passed-on":
        layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), PositionBias(), UsesBias(), UsesBias()]
    elif case == "generator":
        layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), OwnDropout(), nn.Linear(WIDTH, WIDTH)]
        layers.append(nn.Tanh())
    else:
        layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        layers.append(nn.Linear(WIDTH, WIDTH))
    return nn.Sequential(*layers, Head()).double()


def loss_of(case: str, model: nn.Module):
    """``loss_fn`` and the tensors it owns."""
    if case == "temperature":
        temperature = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
        return lambda out, y: F.cross_entropy(out / temperature, y), [temperature]
    if case == "adaptive":
        torch.manual_seed(1)
        criterion = nn.AdaptiveLogSoftmaxWithLoss(WIDTH, 10, cutoffs=[4]).double()
        return lambda out, y: criterion(out, y).loss, list(criterion.parameters())
    head = dict(model.named_children()).get(str(sum(BALANCE) - 1))  # None: on another rank
    if case == "own-regularizer" and head is not None:
        weight = head.linear.weight
        return lambda out, y: F.cross_entropy(out, y) + 0.1 * weight.square().sum(), []
    return F.cross_entropy, []


def regularized(model: nn.Module):
    """A loss reading the second stage's weight: refused (an untrained copy elsewhere)."""
    return lambda out, y: F.cross_entropy(out, y) + 0.1 * model[2].weight.square().sum()


def batch(step: int):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(8, WIDTH, dtype=torch.float64, generator=generator)
    return x, torch.randint(0, WIDTH, (8,), generator=generator)


def plain(case: str, steps: int, chunks: int) -> dict:
    """The gradients of ``steps`` plain steps (accumulated), by name; the loss's own as
    ``loss.<i>`` and the input's as ``input``."""
    model = model_of(case)
    loss_fn, owned = loss_of(case, model)
    grads = {}
    for step in range(steps):
        x, y = batch(step)
        if case == "input-grad":
            x.requires_grad_()
        reference_step(model, x, y, loss_fn, chunks=chunks, seed=100 + step)
        if x.requires_grad:
            grads[f"input{step}"] = x.grad
    grads.update({name: p.grad for name, p in model.named_parameters()})
    grads.update({f"loss.{i}": t.grad for i, t in enumerate(owned)})
    return grads


def pipelined(case: str, steps: int, chunks: int, group=None, **options) -> dict:
    """The same from ``steps`` pipelined steps (this rank's part when multi-process)."""
    model = model_of(case)
    pipe = gpipe.Pipe(copy.deepcopy(model), balance=BALANCE, chunks=chunks, group=group, **options)
    loss_fn, owned = loss_of(case, pipe)
    grads = {}
    for step in range(steps):
        x, y = batch(step)
        if case == "input-grad":
            x.requires_grad_()
        pipe.step(x, y, loss_fn, seed=100 + step)
        if x.grad is not None:
            grads[f"input{step}"] = x.grad
    grads.update({name: p.grad for name, p in pipe.named_parameters()})
    grads.update({f"loss.{i}": t.grad for i, t in enumerate(owned) if t.grad is not None})
    return grads


def worst_error(ours: dict, theirs: dict) -> tuple[float, str]:
    """The largest relative error over the gradients ``ours`` holds (each one must)."""
    worst, where = 0.0, ""
    for name, grad in ours.items():
        assert grad is not None, f"{name} has no gradient"
        error = relative_error(grad, theirs[name])
        if error > worst:
            worst, where = error, name
    return worst, where


def rank_steps(rank, cases) -> list:
    """Each (case, options): the gradients this rank holds, or the error it raised."""
    torch.set_num_threads(1)
    results = []
    for case, options in cases:
        try:
            if case == "regularizer":
                model = model_of("plain")
                pipe = gpipe.Pipe(model, balance=BALANCE, group=dist.group.WORLD, **options)
                pipe.step(*batch(0), regularized(model))
                results.append({"grads": {}})
            else:
                grads = pipelined(case, 2, options.pop("chunks"), dist.group.WORLD, **options)
                results.append({"grads": grads})
        except Exception as error:  # the rank of the last stage refuses, its peer follows
            results.append({"error": f"{type(error).__name__}: {error}"})
    return results
