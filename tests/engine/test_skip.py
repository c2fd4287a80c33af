"""Networks that are not a plain chain: tuples between stages and skip connections."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.engine.skip import SkipError, SkipLayout
from gpipe.models import unet
from gpipe.schedule import Action, Kind
from gpipe.schedule.routes import Channel, Message, Routes
from reference import reference_step, relative_error, twin, worst_gradient_error

SCHEDULES = [
    ("gpipe", 4, 1, [2, 2, 1, 2]),
    ("1f1b", 4, 1, [2, 2, 1, 2]),
    ("zb-h1", 4, 1, [2, 2, 1, 2]),
    ("interleaved-1f1b", 2, 2, [2, 2, 1, 2]),
]


def pixel_loss(out, y):
    return F.cross_entropy(out, y)


def unet_case(seed=0):
    torch.manual_seed(seed)
    model = unet(channels=4).double()
    x = torch.randn(8, 1, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (8, 8, 8))
    return model, x, y


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize(("schedule", "devices", "virtual", "balance"), SCHEDULES)
def test_unet_skips_across_three_stages_match_unsplit_model(
    schedule, devices, virtual, balance, checkpoint
):
    model, x, y = unet_case()
    reference = twin(model)
    pipe = gpipe.Pipe(
        model,
        balance=balance,
        devices=["cpu"] * devices,
        chunks=4,
        checkpoint=checkpoint,
        schedule=schedule,
        virtual_stages=virtual,
    )
    loss = pipe.step(x, y, pixel_loss, seed=7)
    expected = reference_step(reference, x, y, pixel_loss, chunks=4, seed=7)
    assert relative_error(loss, expected) <= 1e-10
    worst, where = worst_gradient_error(pipe, reference)
    assert worst <= 1e-10, where
    assert all(not stage.pending for stage in pipe.stages)


def test_skip_travels_straight_to_the_stage_that_pops_it():
    layout = SkipLayout.of(list(unet()))
    stage_of_layer = [0, 0, 1, 1, 2, 3, 3]
    skips = {s: layout.stage_view(stage_of_layer, s) for s in range(4)}
    routes = Routes(4, skips)
    sent = routes.outgoing(Action(Kind.FORWARD, 0, 5))
    assert sent == (Message(Channel.ACTIVATION, 1, 5), Message(Channel.SKIP, 3, 5, "skip1"))
    assert routes.incoming(Action(Kind.FORWARD, 1, 5)) == (Message(Channel.ACTIVATION, 1, 5),)
    assert Message(Channel.SKIP_GRADIENT, 0, 5, "skip1") in routes.outgoing(
        Action(Kind.BACKWARD, 3, 5)
    )
    assert routes.sender(Message(Channel.SKIP, 3, 5, "skip1")) == 0


def test_skip_within_one_stage_stays_local():
    model, x, y = unet_case()
    reference = twin(model)
    pipe = gpipe.Pipe(model, balance=[6, 1], chunks=2)
    assert pipe.stages[0].skips.local == {"skip1", "skip2"}
    pipe.step(x, y, pixel_loss, seed=1)
    reference_step(reference, x, y, pixel_loss, chunks=2, seed=1)
    assert worst_gradient_error(pipe, reference)[0] <= 1e-10


def test_inference_with_skips():
    model, x, _ = unet_case()
    model.eval()
    expected = twin(model)(x)
    pipe = gpipe.Pipe(model, balance=[2, 2, 1, 2], devices=["cpu"] * 4, chunks=2).eval()
    assert relative_error(pipe(x), expected) <= 1e-12


def test_misuse_is_one_error_listing_every_problem():
    @gpipe.skippable(stash=["a"])
    class StashA(nn.Identity):
        pass

    @gpipe.skippable(pop=["b"])
    class PopB(nn.Identity):
        pass

    @gpipe.skippable(pop=["c"])
    class PopC(nn.Identity):
        pass

    @gpipe.skippable(stash=["c"])
    class StashC(nn.Identity):
        pass

    model = nn.Sequential(StashA(), StashA(), PopB(), PopC(), StashC())
    with pytest.raises(SkipError) as info:
        gpipe.Pipe(model, balance=[2, 3])
    message = str(info.value)
    assert "'a' is stashed by layers [0, 1]; stash each name once" in message
    assert "'a' is stashed by layer 0 but never popped" in message
    assert "'b' is popped by layer 2 but never stashed" in message
    assert "'c' is popped by layer 3 before layer 4 stashes it" in message


def test_a_declared_stash_that_does_not_happen_is_reported():
    @gpipe.skippable(stash=["x"])
    class Forgets(nn.Linear):
        pass

    @gpipe.skippable(pop=["x"])
    class Pops(nn.Module):
        def forward(self, h):
            return h + gpipe.pop("x")

    pipe = gpipe.Pipe(nn.Sequential(Forgets(2, 2), Pops()), balance=[1, 1], chunks=1)
    with pytest.raises(SkipError, match=r"declared stashes \['x'\] but its layers did not"):
        pipe.step(torch.randn(2, 2), torch.randn(2, 2), F.mse_loss)


class Embed(nn.Module):
    """ids -> (hidden, mask, None, positions): floats, bools, ints and None across stages."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 6)

    def forward(self, ids):
        mask = ids != 0
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return self.embedding(ids), mask, None, positions


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, packet):
        hidden, mask, nothing, positions = packet
        assert nothing is None and not mask.requires_grad and not positions.is_floating_point()
        hidden = (
            torch.tanh(self.linear(hidden)) * mask.unsqueeze(-1) + positions.unsqueeze(-1) * 0.01
        )
        return hidden, mask, None, positions


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 2)

    def forward(self, packet):
        hidden, mask, _, _ = packet
        return self.out((hidden * mask.unsqueeze(-1)).sum(1))


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_tuples_with_masks_ints_and_none_cross_stages(schedule, checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(Embed(), Mix(), Mix(), Pool()).double()
    reference = twin(model)
    ids = torch.randint(0, 10, (6, 5))
    y = torch.randint(0, 2, (6,))
    pipe = gpipe.Pipe(model, balance=[1, 1, 2], chunks=3, checkpoint=checkpoint, schedule=schedule)
    pipe.step(ids, y, F.cross_entropy, seed=0)
    reference_step(reference, ids, y, F.cross_entropy, chunks=3, seed=0)
    assert worst_gradient_error(pipe, reference)[0] <= 1e-10
