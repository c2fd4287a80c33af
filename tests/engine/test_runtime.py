"""The runtime: order of execution, traces, and failures inside a stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.schedule import Kind
from reference import full_batch_step, twin, worst_gradient_error


class Faulty(nn.Module):
    """Identity that raises on its n-th forward (or backward) while armed."""

    def __init__(self, at_call: int, in_backward: bool = False) -> None:
        super().__init__()
        self.at_call, self.in_backward, self.calls, self.armed = at_call, in_backward, 0, True

    def forward(self, x):
        if self.in_backward:
            return _RaiseInBackward.apply(x, self)
        if gpipe.is_recomputing():
            return x
        self.calls += 1
        if self.armed and self.calls == self.at_call:
            raise KeyError(f"boom in forward call {self.calls}")
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        owner = ctx.owner
        owner.calls += 1
        if owner.armed and owner.calls == owner.at_call:
            raise ArithmeticError("boom in backward")
        return grad, None


def model_with(faulty: nn.Module, position: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 6) for _ in range(5)]
    layers.insert(position, faulty)
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize(
    ("position", "in_backward"), [(0, False), (3, False), (5, False), (3, True)]
)
def test_exception_in_a_stage_surfaces_and_pipe_stays_usable(position, in_backward, checkpoint):
    faulty = Faulty(at_call=3, in_backward=in_backward)
    model = model_with(faulty, position)
    reference = twin(model)
    pipe = gpipe.Pipe(model, balance=[2, 2, 2], chunks=4, checkpoint=checkpoint)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    expected = (ArithmeticError, "boom in backward") if in_backward else (KeyError, "call 3")
    with pytest.raises(expected[0], match=expected[1]):
        pipe.step(x, y, F.mse_loss)
    assert all(not stage.pending for stage in pipe.stages)

    faulty.armed = False
    pipe.zero_grad()
    pipe.step(x, y, F.mse_loss)
    full_batch_step(reference, x, y, F.mse_loss)
    assert worst_gradient_error(pipe, reference)[0] <= 1e-10


def test_exception_in_loss_fn_surfaces():
    pipe = gpipe.Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), balance=[1, 1], chunks=2)

    def loss_fn(out, y):
        raise ZeroDivisionError("bad loss")

    with pytest.raises(ZeroDivisionError, match="bad loss"):
        pipe.step(torch.randn(4, 2), torch.randn(4, 2), loss_fn)


def test_trace_records_every_action_in_schedule_order():
    pipe = gpipe.Pipe(
        nn.Sequential(*(nn.Linear(4, 4) for _ in range(3))), balance=[1, 1, 1], chunks=4
    )
    pipe.step(torch.randn(8, 4), torch.randn(8, 4), F.mse_loss, trace=True)
    trace = pipe.last_trace
    assert len(trace) == 2 * 3 * 4
    for rank in range(3):
        actions = [t.action for t in trace if t.rank == rank]
        assert actions == list(pipe.schedule.actions[rank])
    for timed in trace:
        assert 0 <= timed.start <= timed.end
    # Fill-drain: every forward ends before the first backward of the last stage starts.
    first_backward = min(t.start for t in trace if t.action.kind is Kind.BACKWARD)
    assert all(
        t.end <= first_backward
        for t in trace
        if t.action.kind is Kind.FORWARD and t.action.stage == 2
    )


def test_round_robin_runs_stages_in_clock_cycles():
    """Stage 1 starts micro-batch 0 before stage 0 has started micro-batch 2."""
    pipe = gpipe.Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), balance=[1, 1], chunks=3)
    pipe.step(torch.randn(6, 4), torch.randn(6, 4), F.mse_loss, trace=True)
    order = [(t.action.kind.value, t.action.stage, t.action.microbatch) for t in pipe.last_trace]
    assert order.index(("F", 1, 0)) < order.index(("F", 0, 2))
