"""A captured model's parameters, buffers and state dict in the model's own order, not the
order its forward uses them: an optimizer's state dict (kept by position) and
``AveragedModel`` move between the model and the Pipe. Compared with the plain model in
float64, per parameter."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel

import gpipe

BATCH = 12


class Net(nn.Module):
    """Registered in another order than used: the head first, the embedding after the blocks;
    the head's weight is the embedding's (tied); buffers used and unused, one not persistent,
    and a plain tensor attribute (export lifts it as a constant: no buffer of the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 8, bias=False)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.scale = nn.Parameter(torch.ones(8))
        self.embed = nn.Embedding(8, 8)
        self.head.weight = self.embed.weight
        self.register_buffer("offset", torch.full((8,), 0.1))
        self.register_buffer("unused", torch.zeros(2), persistent=False)
        self.register_buffer("table", torch.arange(8.0), persistent=False)
        self.shift = torch.linspace(0.0, 1.0, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.offset + self.table + self.shift.to(self.offset.dtype)
        for block in self.blocks:
            x = torch.tanh(block(x)) + x
        return self.head(x * self.scale)


def build() -> Net:
    torch.manual_seed(0)
    return Net().double()


def batch(step: int = 0):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 8, (BATCH, 5), generator=g)
    return ids, torch.randint(0, 8, (BATCH, 5), generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def pipe_of(model: nn.Module, **options) -> gpipe.Pipe:
    ids, _ = batch()
    options = {"balance": [2, 3], "chunks": 3, **options}
    return gpipe.Pipe.from_model(model, ids[:2], split="blocks", **options)


def test_parameters_buffers_and_state_dict_in_the_models_order():
    model = build()
    pipe = pipe_of(model, devices=["cpu", "cpu"])
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in pipe.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert list(pipe.state_dict()) == list(model.state_dict())
    every = [n for n, _ in pipe.named_parameters(remove_duplicate=False)]
    assert every == [n for n, _ in model.named_parameters(remove_duplicate=False)]
    ours, theirs = list(pipe.parameters()), list(model.parameters())
    assert all(a is b for a, b in zip(ours, theirs, strict=True))  # the model's own tensors


def _adam_steps(params, model_step, steps: range, state=None) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(params, lr=0.05)
    if state is not None:
        optimizer.load_state_dict(state)
    for step in steps:
        model_step(*batch(step))
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def test_an_optimizer_state_dict_moves_between_the_model_and_the_pipe():
    plain = build()
    # The plain model trains two steps and saves; a Pipe of the same start resumes from it.
    saved = copy.deepcopy(plain)

    def plain_step(x, y):
        loss_fn(plain(x), y).backward()

    optimizer = _adam_steps(plain.parameters(), plain_step, range(2))
    state = copy.deepcopy(optimizer.state_dict())
    saved.load_state_dict(plain.state_dict())
    _adam_steps(plain.parameters(), plain_step, range(2, 3), optimizer.state_dict())
    pipe = pipe_of(saved)

    def pipe_step(x, y):
        pipe.step(x, y, loss_fn)

    _adam_steps(pipe.parameters(), pipe_step, range(2, 3), state)
    expected = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        assert float((p - expected[name]).detach().abs().max()) <= 1e-10, name


def test_averaged_model_updates_from_the_pipe():
    model = build()
    pipe = pipe_of(model)
    pipe.step(*batch(), loss_fn)
    average = AveragedModel(copy.deepcopy(model), use_buffers=True)
    expected = AveragedModel(copy.deepcopy(model), use_buffers=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    average.update_parameters(pipe)
    expected.update_parameters(model)
    for (name, a), (_, b) in zip(
        average.module.state_dict().items(), expected.module.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
