"""Module state a forward writes (buffers, a layer's own generator), exact under remat."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.engine.state import ModuleState, running_stats_frozen
from reference import reference_step, relative_error

SCHEDULES = ["gpipe", "1f1b", "zb-h1"]


class Noisy(nn.Module):
    """Adds noise from its own generator, and counts its calls in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.randn(x.shape, generator=self.generator, dtype=x.dtype)


def test_a_recomputation_finds_the_state_the_first_forward_found_and_leaves_the_later():
    noisy, norm = Noisy(), nn.BatchNorm1d(2)
    layers = [nn.Sequential(noisy, norm), nn.Linear(2, 2)]
    state = ModuleState(layers, first_layer=4)
    x = torch.randn(3, 2)
    saved = state.save()  # the first re-materialized forward learns what it writes
    first = layers[0](x)
    saved = state.learned(saved)
    assert {slot.name for slot in saved.values} == {"calls"}  # batch norm is frozen instead
    assert saved.layers == {0}
    layers[0](x)  # a later micro-batch's forward
    with ModuleState.restored(saved) as replayed, running_stats_frozen(layers):
        assert replayed == {0} and int(noisy.calls) == 0 and not norm.track_running_stats
        assert torch.equal(layers[0](x), first)  # the same noise, from the same state
    assert int(noisy.calls) == 2 and norm.track_running_stats and int(norm.num_batches_tracked) == 2
    assert state.learned(state.save()).values.keys() == saved.values.keys()  # learned once


def test_a_stage_that_writes_nothing_saves_nothing():
    state = ModuleState([nn.Linear(2, 2), nn.ReLU()], first_layer=0)
    assert state.learned(state.save()) is None
    assert state.save() is None


# -- through a Pipe: layers that write their own buffers (spectral norm, a moving average) --


class MovingAverage(nn.Module):
    """Subtracts a running mean it updates in forward; skips the update when recomputing,
    as the docs once advised."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not gpipe.is_recomputing():
            with torch.no_grad():
                self.mean.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x - self.mean


class CountCalls(nn.Module):
    """A naive counter buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def stateful_model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    middle = {
        "spectral-norm": lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16)),
        "moving-average": lambda: MovingAverage(16),
    }[kind]()
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), middle, CountCalls(), nn.Tanh(), nn.Linear(16, 4)
    ).double()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
@pytest.mark.parametrize("kind", ["spectral-norm", "moving-average"])
def test_layers_that_write_their_buffers_train_as_in_the_plain_model(kind, checkpoint, schedule):
    """The recomputation starts from the buffers the first forward found, and every forward
    writes them once, in order, as plain gradient accumulation does."""
    plain = stateful_model(kind)
    pipe = gpipe.Pipe(
        copy.deepcopy(plain), balance=[2, 4], chunks=4, checkpoint=checkpoint, schedule=schedule
    )
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 4, (8,), generator=generator)
        reference_step(plain, x, y, F.cross_entropy, chunks=4, seed=step)
        pipe.step(x, y, F.cross_entropy, seed=step)
        for (name, ours), theirs in zip(pipe.named_parameters(), plain.parameters(), strict=True):
            assert relative_error(ours.grad, theirs.grad) < 1e-10, (step, name)
        plain_opt.step()
        optimizer.step()
        plain_opt.zero_grad()
        optimizer.zero_grad()
    theirs = plain.state_dict()
    for name, value in pipe.state_dict().items():
        assert relative_error(value, theirs[name]) < 1e-10, name
    assert int(pipe.state_dict()["3.calls"]) == 3 * 4  # once per micro-batch


class SpectralNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(
            [nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16)) for _ in range(3)]
        )
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


def test_a_captured_spectral_norm_model_trains_as_in_the_plain_model():
    torch.manual_seed(0)
    plain = SpectralNet().double()
    example = (torch.randn(2, 6, dtype=torch.float64),)
    pipe = gpipe.Pipe.from_model(
        copy.deepcopy(plain), example, split="blocks", balance=[2, 3], chunks=4
    )
    generator = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 4, (8,), generator=generator)
        for x_m, y_m in zip(x.tensor_split(4), y.tensor_split(4), strict=True):
            (F.cross_entropy(plain(x_m), y_m) / 4).backward()
        pipe.step(x, y, F.cross_entropy)
        ours = dict(pipe.named_parameters())
        for name, theirs in plain.named_parameters():
            assert relative_error(ours[name].grad, theirs.grad) < 1e-10, (step, name)
            ours[name].grad, theirs.grad = None, None
    theirs = plain.state_dict()
    for name, value in pipe.state_dict().items():
        assert relative_error(value, theirs[name]) < 1e-10, name


class CountsInAParameter(nn.Linear):
    """A step counter kept in a frozen Parameter: gpipe can restore buffers, not this."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


def test_a_forward_that_writes_a_parameter_is_refused_under_remat():
    model = nn.Sequential(nn.Linear(5, 8), CountsInAParameter(8, 8), nn.Linear(8, 3))
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    never = gpipe.Pipe(copy.deepcopy(model), balance=[2, 1], chunks=2, checkpoint="never")
    never.step(x, y, F.cross_entropy)
    assert int(never.state_dict()["1.calls"]) == 2  # the remedy: once per micro-batch
    pipe = gpipe.Pipe(model, balance=[2, 1], chunks=2)
    with pytest.raises(RuntimeError, match=r"writes parameters in place \(1\.calls\).*'never'"):
        pipe.step(x, y, F.cross_entropy)
