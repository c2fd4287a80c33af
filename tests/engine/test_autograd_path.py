"""``loss(pipe(x)).backward()``: the outputs of ``pipe(x)`` in training carry autograd through
every stage (gpipe.engine.autograd_path, gpipe.pipe.through_output), and every parameter's gradient
is the un-split model's on the same micro-batches, float64 within 1e-10."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_leaves, tree_map

import gpipe
from gpipe.base import microbatch, rng
from gpipe.models import convnet, unet
from reference import relative_error, running_stats_of_unsplit_batch

REMAT = ["always", "except_last", "never"]
CHUNKS = 4


class Heads(nn.Module):
    """The last layer: a tensor, a tuple or a dict of two outputs."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.a, self.b = kind, nn.Linear(6, 3), nn.Linear(6, 2)

    def forward(self, x):
        if self.kind == "tensor":
            return self.a(x)
        a, b = self.a(x), torch.tanh(self.b(x))
        return (a, b) if self.kind == "tuple" else {"a": a, "b": b}


def mlp(kind: str = "tensor") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 6), nn.Tanh(), nn.Dropout(0.25), nn.Linear(6, 6), nn.GELU(), Heads(kind)
    ).double()


def pipelined(model, *, seed: int, x, **options):
    """``pipe(x)`` with the step seed ``seed`` draws from torch's generator."""
    pipe = gpipe.Pipe(copy.deepcopy(model), **options)
    torch.manual_seed(seed)
    return pipe, pipe(x)


def unsplit(model, inputs, *, seed: int, chunks: int = CHUNKS):
    """The plain model on the same micro-batches, each layer seeded as gpipe.base.rng says."""
    torch.manual_seed(seed)
    step_seed = rng.draw_step_seed()
    outputs = []
    for m, x_m in enumerate(microbatch.split(inputs, chunks)):
        # a copy: micro-batches are views of one tensor, whose version an in-place layer bumps
        x_m = tree_map(torch.clone, x_m)
        for i, layer in enumerate(model):
            with rng.seeded(rng.layer_seed(step_seed, i, m), "cpu"):
                x_m = layer(x_m)
        outputs.append(x_m)
    return microbatch.join(outputs)


def worst(pipe, reference) -> float:
    """Largest |difference| over every parameter's gradient (None where the model's is)."""
    ours, errors = dict(pipe.named_parameters()), [0.0]
    for name, p in reference.named_parameters():
        if p.grad is None:
            assert ours[name].grad is None, name
        else:
            errors.append((ours[name].grad - p.grad).abs().max().item())
    return max(errors)


def two_losses(out):
    values = (
        [out]
        if isinstance(out, torch.Tensor)
        else list(out.values() if isinstance(out, dict) else out)
    )
    first = sum((v**2).mean() for v in values)
    second = sum(v.sin().sum() for v in values)
    return first, second


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict"])
@pytest.mark.parametrize("checkpoint", REMAT)
def test_two_losses_backward_twice_give_the_unsplit_gradients(kind, checkpoint):
    model = mlp(kind)
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)  # uneven micro-batches
    pipe, out = pipelined(
        model, seed=7, x=x, balance=[2, 2, 2], devices=["cpu"] * 3, chunks=CHUNKS,
        checkpoint=checkpoint,
    )  # fmt: skip
    first, second = two_losses(out)
    first.backward(retain_graph=True)
    second.backward()
    ours_x = x.grad.clone()

    x.grad = None
    expected = unsplit(model, x, seed=7)
    for got, want in zip(tree_leaves(out), tree_leaves(expected), strict=True):
        assert relative_error(got, want) <= 1e-12
    sum(two_losses(expected)).backward()
    assert worst(pipe, model) <= 1e-10
    assert (ours_x - x.grad).abs().max() <= 1e-10


class Counter(nn.Module):
    """Writes a buffer in forward and reads it: a recomputation must replay what it read."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.calls += 1
        return x * (1 + 0.1 * self.calls)


class Probe(nn.Module):
    """Counts the recomputations it sees (a Python counter: no buffer to restore)."""

    def __init__(self) -> None:
        super().__init__()
        self.recomputed = 0

    def forward(self, x):
        self.recomputed += gpipe.is_recomputing()
        return x


@pytest.mark.parametrize(
    ("checkpoint", "recomputed"), [("always", 4), ("except_last", 3), ("never", 0)]
)
def test_each_mode_recomputes_its_microbatches_at_each_backward(checkpoint, recomputed):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Counter(), Probe(), nn.Tanh(), nn.Linear(4, 2))
    model = model.double()
    x = torch.randn(8, 3, dtype=torch.float64)
    pipe, out = pipelined(
        model, seed=1, x=x, balance=[4, 1], devices=["cpu", "cpu"], chunks=CHUNKS,
        checkpoint=checkpoint,
    )  # fmt: skip
    counter, probe = pipe.stages[0].layers[1:3]
    assert probe.recomputed == 0 and counter.calls == CHUNKS  # every forward once
    loss = out.pow(2).sum()
    loss.backward(retain_graph=True)
    assert probe.recomputed == recomputed
    loss.backward()  # the same graph again: recomputed again, from the same buffers
    assert probe.recomputed == 2 * recomputed
    assert counter.calls == CHUNKS  # written once per micro-batch, as in the un-split model

    expected = unsplit(model, x, seed=1).pow(2).sum() * 2
    expected.backward()
    assert worst(pipe, model) <= 1e-10


@pytest.mark.parametrize("checkpoint", REMAT)
def test_deferred_batch_norm_commits_once_and_trains_as_unsplit(checkpoint):
    torch.manual_seed(0)
    model = convnet(channels=4, blocks=2).double()
    x = torch.randn(10, 1, 8, 8, dtype=torch.float64)
    stats = running_stats_of_unsplit_batch(model, x, chunks=CHUNKS)
    pipe, out = pipelined(
        model, seed=2, x=x, balance=[4, 4], devices=["cpu", "cpu"], chunks=CHUNKS,
        checkpoint=checkpoint, deferred_batch_norm=True,
    )  # fmt: skip
    F.cross_entropy(out, torch.arange(10) % out.shape[1]).backward()
    state = pipe.state_dict()
    for key, value in stats.items():
        assert relative_error(state[key], value) <= 1e-10, key
    expected = unsplit(model, x, seed=2)
    F.cross_entropy(expected, torch.arange(10) % out.shape[1]).backward()
    assert worst(pipe, model) <= 1e-10


def test_skip_connections_carry_their_gradients_across_stages():
    torch.manual_seed(0)
    model = unet(channels=4).double()
    x = torch.randn(8, 1, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (8, 8, 8))
    pipe, out = pipelined(
        model, seed=3, x=x, balance=[2, 2, 1, 2], devices=["cpu"] * 4, chunks=CHUNKS,
        checkpoint="except_last",
    )  # fmt: skip
    F.cross_entropy(out, y).backward()
    F.cross_entropy(unsplit(model, x, seed=3), y).backward()
    assert worst(pipe, model) <= 1e-10


def test_a_layer_writing_its_input_gets_a_copy():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1)
    ).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    before = x.clone()
    pipe, out = pipelined(
        model, seed=0, x=x, balance=[2, 2], devices=["cpu", "cpu"], chunks=3, checkpoint="always"
    )
    out.sum().backward()
    assert torch.equal(x, before)  # the caller's batch is left alone
    unsplit(model, x.clone(), seed=0, chunks=3).sum().backward()
    assert worst(pipe, model) <= 1e-10


@pytest.mark.parametrize("checkpoint", REMAT)
def test_a_tied_copy_on_another_device_adds_its_gradient_to_the_reference(checkpoint):
    """Stages on two devices hold two copies of a tied tensor (gpipe.parallel.tied); here the
    second copy is made by hand, as on another device. The stage reads the reference moved to
    its device in the copy's place, so autograd sums both uses into the reference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    model[2].weight = model[0].weight  # one tensor, used twice
    pipe = gpipe.Pipe(
        copy.deepcopy(model), balance=[2, 1], devices=["cpu", "cpu"], chunks=2,
        checkpoint=checkpoint, tied=[("0.weight", "2.weight")],
    )  # fmt: skip
    tie = pipe._tied.ties[0]
    tie.copies[1] = pipe.stages[1].layers[0].weight = nn.Parameter(torch.zeros(4, 4).double())
    assert pipe._tied.extra_copies() == {id(tie.copies[1])}
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe(x).pow(2).sum().backward()
    assert tie.copies[1].grad is None  # its uses went to the reference
    model(x).pow(2).sum().backward()
    assert worst(pipe, model) <= 1e-10


def test_a_captured_model_trains_through_its_output():
    from captured_models import CASES, reference_gradients, worst_error

    case = CASES["skips"]
    model = case.build()
    inputs, targets = case.batch(size=11)
    pipe = gpipe.Pipe.from_model(
        copy.deepcopy(model), case.example(), split=case.split, balance=[2, 3],
        devices=["cpu", "cpu"], chunks=3, checkpoint="always",
    )  # fmt: skip
    out = pipe(inputs)
    # per micro-batch means weighted by size, as the reference accumulates them
    sum(
        case.loss(o, y) * len(y) / 11
        for o, y in zip(microbatch.split(out, 3), microbatch.split(targets, 3), strict=True)
    ).backward()
    _, grads, _ = reference_gradients(case, model, inputs, targets, chunks=3)
    error, where = worst_error(pipe.named_parameters(remove_duplicate=False), grads)
    assert error <= 1e-10, (where, error)


def test_inference_builds_no_graph_and_gives_the_same_outputs():
    model = mlp()
    x = torch.randn(8, 5, dtype=torch.float64)
    pipe, trained = pipelined(
        model, seed=4, x=x, balance=[3, 3], devices=["cpu", "cpu"], chunks=CHUNKS
    )
    assert trained.requires_grad
    torch.manual_seed(4)
    with torch.no_grad():
        assert torch.equal(pipe(x), trained)
    pipe.eval()
    assert not pipe(x).requires_grad
    assert relative_error(pipe(x), model.eval()(x)) <= 1e-12
