"""Every bad configuration of a Pipe gets one clear error naming the values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpipe
from gpipe.base.errors import PartitionError


def model(n: int = 4) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(3, 3) for _ in range(n)))


def test_not_sequential():
    with pytest.raises(TypeError, match=r"nn\.Sequential.*got Linear"):
        gpipe.Pipe(nn.Linear(3, 3), balance=[1])


def test_balance_sum_differs():
    with pytest.raises(PartitionError, match=r"sums to 3 layers, but the model has 4.*=\[2, 2\]"):
        gpipe.Pipe(model(), balance=[2, 1])


@pytest.mark.parametrize("balance", [[2, 0, 2], [5, -1], [2.0, 2]])
def test_balance_entries_must_be_positive_ints(balance):
    with pytest.raises(PartitionError, match="positive int"):
        gpipe.Pipe(model(), balance=balance)


def test_empty_balance():
    with pytest.raises(PartitionError, match="balance is empty"):
        gpipe.Pipe(model(), balance=[])


def test_devices_and_balance_lengths():
    with pytest.raises(PartitionError, match=r"has 2 entries, but 3 devices make 3 stages"):
        gpipe.Pipe(model(), balance=[2, 2], devices=["cpu"] * 3)


def test_bad_device_name():
    with pytest.raises(PartitionError, match="'gpu7' is not a device"):
        gpipe.Pipe(model(), balance=[2, 2], devices=["cpu", "gpu7"])


def test_problems_are_reported_together():
    with pytest.raises(PartitionError) as info:
        gpipe.Pipe(model(), balance=[1, 1], devices=["cpu"], chunks=0, checkpoint="sometimes")
    message = str(info.value)
    for expected in ("sums to 2 layers", "1 devices make 1 stages", "chunks must be", "sometimes"):
        assert expected in message


def test_unknown_schedule_lists_known_ones():
    with pytest.raises(PartitionError, match=r"unknown schedule 'zigzag'; known: gpipe"):
        gpipe.Pipe(model(), balance=[2, 2], schedule="zigzag")


def test_parameter_shared_by_two_stages():
    shared = nn.Linear(3, 3)
    with pytest.raises(PartitionError, match=r"parameter 0\.weight \(stage 0\) is also 2\.weight"):
        gpipe.Pipe(nn.Sequential(shared, nn.ReLU(), shared), balance=[2, 1])


def test_parameter_shared_within_one_stage_is_fine():
    shared = nn.Linear(3, 3)
    pipe = gpipe.Pipe(nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(3, 2)), balance=[3, 1])
    assert len(list(pipe.parameters())) == 4


@pytest.mark.parametrize("move", [lambda p: p.to("cpu"), lambda p: p.cuda(), lambda p: p.cpu()])
def test_moving_a_pipe_is_refused(move):
    pipe = gpipe.Pipe(model(), balance=[2, 2])
    with pytest.raises(TypeError, match="devices="):
        move(pipe)


def test_dtype_conversion_is_allowed():
    pipe = gpipe.Pipe(model(), balance=[2, 2]).to(torch.float64)
    assert all(p.dtype == torch.float64 for p in pipe.parameters())


def test_schedule_for_other_shape_is_rejected():
    from gpipe.schedule import fill_drain

    with pytest.raises(PartitionError, match="3 stages on 3 ranks and 2 micro-batches"):
        gpipe.Pipe(model(), balance=[2, 2], chunks=4, schedule=fill_drain(3, 2))


class TestStepInputs:
    def setup_method(self):
        self.pipe = gpipe.Pipe(model(), balance=[2, 2], chunks=4)

    def loss(self, out, y):
        return nn.functional.mse_loss(out, y)

    def test_more_chunks_than_samples(self):
        with pytest.raises(ValueError, match="4"):
            self.pipe.step(torch.randn(3, 3), torch.randn(3, 3), self.loss)

    def test_targets_of_other_batch_size(self):
        with pytest.raises(ValueError, match=r"different batch sizes \(8 and 9\)"):
            self.pipe.step(torch.randn(8, 3), torch.randn(9, 3), self.loss)

    def test_unknown_reduction(self):
        with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
            self.pipe.step(torch.randn(8, 3), torch.randn(8, 3), self.loss, reduction="none")

    def test_loss_not_scalar(self):
        with pytest.raises(ValueError, match=r"scalar tensor, got \(2, 3\)"):
            self.pipe.step(
                torch.randn(8, 3),
                torch.randn(8, 3),
                lambda out, y: nn.functional.mse_loss(out, y, reduction="none"),
            )
