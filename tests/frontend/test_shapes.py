"""The shapes a captured graph assumed are checked on every input: a size outside the range
torch.export captured for raises, naming it, instead of replaying the other branch silently.

Reference: the plain model, on the same inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.frontend import capture


class LengthBranch(nn.Module):
    """A forward that branches on the sequence length (a short-sequence path, a window)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x, mask):  # x (batch, length, 4), mask (batch, length)
        x = x * mask[..., None]
        for block in self.blocks:
            x = torch.tanh(block(x))
        if x.shape[1] > 8:
            return x.sum(1)
        return x.mean(1) * 3


def _batch(length: int, size: int = 6):
    g = torch.Generator().manual_seed(length)
    x = torch.randn(size, length, 4, generator=g, dtype=torch.float64)
    return (x, torch.ones(size, length, dtype=torch.float64)), torch.randn(
        size, 4, generator=g, dtype=torch.float64
    )


def _pipe(model: nn.Module, length: int) -> gpipe.Pipe:
    (x, mask), _ = _batch(length, size=2)
    units = capture(copy.deepcopy(model), (x, mask), split="blocks")
    return gpipe.Pipe(units, balance=[2, 2], chunks=2)


def _assert_trains_as(pipe, model, length: int) -> None:
    inputs, target = _batch(length)
    pipe.zero_grad()
    pipe.step(inputs, target, F.mse_loss)
    plain = copy.deepcopy(model)
    for m in range(2):
        piece = slice(3 * m, 3 * m + 3)
        loss = F.mse_loss(plain(inputs[0][piece], inputs[1][piece]), target[piece]) / 2
        loss.backward()
    ours = dict(pipe.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("captured_at", "inside", "outside"), [(8, [5, 8, 1], 12), (12, [9, 20], 8)]
)
def test_a_size_outside_the_captured_range_is_refused(captured_at, inside, outside):
    """Before, the graph of one branch replayed at the other's lengths (outputs 5.9 off)."""
    torch.manual_seed(0)
    model = LengthBranch().double()
    pipe = _pipe(model, captured_at)
    for length in inside:
        _assert_trains_as(pipe, model, length)
    (x, mask), target = _batch(outside)
    range_ = r"in \[2, 8\]" if captured_at == 8 else "at least 9"
    said = (
        rf"input 0 \(positional\) has size {outside} in dimension 1, but the model was "
        rf"captured with that dimension {range_} .*branches on this size.*"
        r"Capture again with an example of this size"
    )
    with pytest.raises(ValueError, match=said):
        pipe.step((x, mask), target, F.mse_loss)
    with pytest.raises(ValueError, match=said):
        pipe((x, mask))  # eval's graph too
    assert all(p.grad is None or p.grad.isfinite().all() for p in pipe.parameters())


def test_sizes_export_found_equal_must_stay_equal():
    """x * mask[..., None] makes export unify their lengths; a mask of length 1 would
    broadcast silently."""
    torch.manual_seed(0)
    model = LengthBranch().double()
    pipe = _pipe(model, 8)
    (x, _), target = _batch(6)
    with pytest.raises(
        ValueError,
        match=r"input 1 \(positional\) has size 1 in dimension 1.*equal to dimension 1 of "
        r"input 0 \(positional\) \(6 here\)",
    ):
        pipe.step((x, torch.ones(6, 1, dtype=torch.float64)), target, F.mse_loss)


class Chunked(nn.Module):
    """A state-space mixer's chunking (Bamba, Falcon-H1, Granite-4 hybrids): the length padded
    to a multiple of the chunk, and a path for one chunk. Export keeps that path under a guard
    that is no range of the length (its range stays [2, oo))."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x, mask):  # x (batch, length, 4)
        for block in self.blocks:
            x = torch.tanh(block(x * mask[..., None]))
        pad = (4 - x.shape[1] % 4) % 4
        chunks = F.pad(x, (0, 0, 0, pad)).reshape(x.shape[0], -1, 4, 4)  # (b, chunks, 4, 4)
        if chunks.shape[1] == 1:
            return chunks.sum((1, 2))
        return chunks.mean((1, 2)) * 3


def test_an_assumption_that_is_no_range_is_refused_up_front():
    """Before, two chunks ran the one-chunk path silently (Bamba's mixer, captured at 8 tokens,
    failed inside the graph at 24: 'The expanded size of the tensor (2) must match ...')."""
    torch.manual_seed(0)
    model = Chunked().double()
    pipe = _pipe(model, 3)
    for length in (3, 4):  # one chunk, as captured
        (x, mask), _ = _batch(length)
        target = torch.randn(6, 4, dtype=torch.float64)
        pipe.zero_grad()
        pipe.step((x, mask), target, F.mse_loss)
        plain = copy.deepcopy(model)
        for m in range(2):
            piece = slice(3 * m, 3 * m + 3)
            F.mse_loss(plain(x[piece], mask[piece]), target[piece]).div(2).backward()
        ours = dict(pipe.named_parameters())
        for name, p in plain.named_parameters():
            torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-10, atol=1e-12)
    (x, mask), _ = _batch(5)
    said = (
        r"input 0 \(positional\) dimension 1 = 5: the model was captured assuming "
        r"\(\(inputs\[0\]\.shape\[1\] .* // 4\) == 1 .*Capture again with an example"
    )
    with pytest.raises(ValueError, match=said):
        pipe.step((x, mask), torch.randn(6, 4, dtype=torch.float64), F.mse_loss)
    with pytest.raises(ValueError, match=said):
        pipe((x, mask))
