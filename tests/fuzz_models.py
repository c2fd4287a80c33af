"""The pieces the case generator (``fuzz_cases``) draws from: small layers, whole models and
losses, each carrying one of the patterns that make a pipelined step differ from the plain
one if any path is lost (issue 41's classes).

Every layer takes and returns a *state*: a tensor, or ``(h, side)`` / ``{"h": h, "side":
side}`` when the case carries tuples or dicts between stages. ``side`` is a second value
that travels down the stack: a copy of the activations, or, after a ``BiasSource``, a tensor
computed from a parameter alone (a shared position bias).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

WIDTH, IN, OUT = 6, 5, 4


def unpack(state):
    if isinstance(state, tuple):
        return state
    if isinstance(state, dict):
        return state["h"], state["side"]
    return state, None


def pack(h, side, carry: str):
    if carry == "tuple":
        return (h, side)
    if carry == "dict":
        return {"h": h, "side": side}
    return h


class Lift(nn.Module):
    """The first layer: inputs to the width of the stack; starts the side value."""

    def __init__(self, carry: str) -> None:
        super().__init__()
        self.carry, self.lin = carry, nn.Linear(IN, WIDTH)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return pack(h, 0.5 * h, self.carry)


class Dense(nn.Module):
    def __init__(self, carry: str) -> None:
        super().__init__()
        self.carry, self.lin = carry, nn.Linear(WIDTH, WIDTH)

    def forward(self, state):
        h, side = unpack(state)
        z = self.lin(h)
        return pack(torch.tanh(z if side is None else z + 0.5 * side), side, self.carry)


class BiasSource(nn.Module):
    """A tensor computed from a parameter alone, used here and passed on down the stack."""

    def __init__(self, carry: str) -> None:
        super().__init__()
        self.carry, self.pos = carry, nn.Parameter(torch.randn(WIDTH) * 0.5)

    def forward(self, state):
        h, _ = unpack(state)
        bias = torch.tanh(self.pos)
        return pack(h + bias, bias.expand_as(h), self.carry)


class Drop(nn.Module):
    """Dropout (the global generator, which gpipe seeds per layer and micro-batch)."""

    def __init__(self, carry: str) -> None:
        super().__init__()
        self.carry, self.drop = carry, nn.Dropout(0.3)

    def forward(self, state):
        h, side = unpack(state)
        return pack(self.drop(h), side, self.carry)


class PrivateNoise(nn.Module):
    """A mask drawn from the layer's own ``torch.Generator`` (in training only)."""

    def __init__(self, carry: str, seed: int) -> None:
        super().__init__()
        self.carry, self.generator = carry, torch.Generator().manual_seed(seed)

    def forward(self, state):
        h, side = unpack(state)
        if self.training:
            keep = torch.rand(h.shape, generator=self.generator, dtype=h.dtype) > 0.3
            h = h * keep / 0.7
        return pack(h, side, self.carry)


class Counter(nn.Module):
    """Buffers written in forward (a call count and a running mean) and read back."""

    def __init__(self, carry: str) -> None:
        super().__init__()
        self.carry = carry
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(WIDTH))

    def forward(self, state):
        h, side = unpack(state)
        out = h + 0.1 * self.mean
        if self.training:
            self.calls += 1
            self.mean.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return pack(out, side, self.carry)


class Norm(nn.Module):
    def __init__(self, carry: str) -> None:
        super().__init__()
        self.carry, self.bn = carry, nn.BatchNorm1d(WIDTH)

    def forward(self, state):
        h, side = unpack(state)
        return pack(self.bn(h), side, self.carry)


class Head(nn.Module):
    def __init__(self, carry: str) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, OUT)

    def forward(self, state):
        h, side = unpack(state)
        return self.lin(h if side is None else h + 0.1 * side)


LAYERS = {"dense": Dense, "bias": BiasSource, "drop": Drop, "counter": Counter, "norm": Norm}


def sequential(kinds: list[str], carry: str, tie: tuple[int, int] | None) -> nn.Sequential:
    """``Lift``, a layer per kind ("private" draws a generator seeded by its position),
    ``Head``; ``tie``: two ``Dense`` positions that share one weight."""
    layers: list[nn.Module] = [Lift(carry)]
    for i, kind in enumerate(kinds):
        layers.append(PrivateNoise(carry, 17 + i) if kind == "private" else LAYERS[kind](carry))
    model = nn.Sequential(*layers, Head(carry)).double()
    if tie is not None:
        model[tie[1]].lin.weight = model[tie[0]].lin.weight
    return model


class Block(nn.Module):
    def __init__(self, kinds: frozenset[str]) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.3) if "drop" in kinds else None
        self.counter = Counter("tensor") if "counter" in kinds else None
        self.norm = nn.BatchNorm1d(WIDTH) if "norm" in kinds else None

    def forward(self, h, bias):
        z = self.lin(h)
        h = torch.tanh(z if bias is None else z + bias)
        if self.drop is not None:
            h = self.drop(h)
        if self.counter is not None:
            h = self.counter(h)
        return self.norm(h) if self.norm is not None else h


class Net(nn.Module):
    """A model that is not a sequence: a position bias computed once from a parameter and
    given to every block, a head that may reuse the input projection's weight (tied), and
    a dict or a tensor out. ``Pipe.from_model`` cuts it between its blocks."""

    def __init__(self, blocks: list[frozenset[str]], *, bias: bool, tied: bool, out: str):
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH)
        self.pos = nn.Parameter(torch.randn(WIDTH) * 0.5) if bias else None
        self.blocks = nn.ModuleList(Block(kinds) for kinds in blocks)
        self.head = None if tied else nn.Linear(WIDTH, IN)
        self.out = out

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        bias = torch.tanh(self.pos) if self.pos is not None else None
        if bias is not None:
            h = h + bias
        for block in self.blocks:
            h = block(h, bias)
        y = self.head(h) if self.head is not None else h @ self.inp.weight
        return {"out": y} if self.out == "dict" else y


# -- losses -----------------------------------------------------------------------------------


def _output(out):
    return out["out"] if isinstance(out, dict) else out


class Loss(nn.Module):
    """``mse`` or ``ce`` of the model's output; with ``temperature`` a parameter of the loss
    scales the output; with ``regularized`` (a parameter of the model) a weight decay term
    over it is added, as a script closing over its model's parameters writes it."""

    def __init__(self, kind: str, *, temperature: bool, regularized: nn.Parameter | None):
        super().__init__()
        self.kind = kind
        one = torch.tensor(1.3, dtype=torch.float64)
        self.temperature = nn.Parameter(one) if temperature else None
        self.regularized = [regularized] if regularized is not None else []  # not a submodule

    def forward(self, out, y):
        out = _output(out)
        if self.temperature is not None:
            out = out * self.temperature
        loss = F.mse_loss(out, y) if self.kind == "mse" else F.cross_entropy(out, y)
        for p in self.regularized:
            loss = loss + 1e-2 * p.pow(2).sum()
        return loss


# -- hooks ------------------------------------------------------------------------------------


def _scale_output(module, args, out):
    return out * 1.5


def _halve_input(module, args):
    return (args[0] * 0.5, *args[1:])


def _double_grad_input(module, grad_input, grad_output):
    return tuple(g * 2 if g is not None else None for g in grad_input)


def _triple(grad):
    return grad * 3


def add_hooks(linear: nn.Linear, kinds: list[str]) -> None:
    """Hooks of the given kinds on ``linear``: a forward hook, a forward pre-hook, a full
    backward hook and a hook on its weight tensor, each changing what passes."""
    for kind in kinds:
        if kind == "forward":
            linear.register_forward_hook(_scale_output)
        elif kind == "pre":
            linear.register_forward_pre_hook(_halve_input)
        elif kind == "backward":
            linear.register_full_backward_hook(_double_grad_input)
        else:
            linear.weight.register_hook(_triple)
