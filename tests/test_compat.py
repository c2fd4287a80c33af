"""``gpipe.compat.GPipe``: torchgpipe's documented behaviour, each check against the un-split
model or what torchgpipe's documentation and tests say; ``pipe(x)`` refused across processes;
the "after" code of docs/migrating.md runs."""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.compat import GPipe, verify_module
from reference import relative_error, running_stats_of_unsplit_batch

ROOT = Path(__file__).resolve().parents[1]


def linears(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(3, 3) for _ in range(n)]).double()


# -- training is the un-split model's -----------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_backward_of_the_output_gives_the_unsplit_gradients(checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)
    ).double()
    x = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    pipe = GPipe(
        copy.deepcopy(model), [2, 2, 1], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint
    )
    out = pipe(x)
    loss = out.pow(2).mean() + out.sin().sum()
    loss.backward()
    ours_x, x.grad = x.grad, None
    expected = model(x)  # no dropout, no batch norm: the whole batch at once is the same
    assert relative_error(out, expected) <= 1e-12
    (expected.pow(2).mean() + expected.sin().sum()).backward()
    for (name, p), q in zip(pipe.named_parameters(), model.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= 1e-10, name
    assert (ours_x - x.grad).abs().max() <= 1e-10


def test_tuple_inputs_and_outputs_carry_gradients():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, pair):
            return self.a(pair[0]), self.b(pair[1])

    pipe = GPipe(
        nn.Sequential(Two().double(), nn.Identity()), [1, 1], devices=["cpu"] * 2, chunks=2
    )
    a, b = (torch.randn(6, 2, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out_a, out_b = pipe((a, b))
    (out_a + out_b).mean().backward()
    assert a.grad is not None and b.grad is not None
    assert all(p.grad is not None for p in pipe.parameters())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_deferred_batch_norm_updates_running_statistics_once(checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3)).double()
    x = torch.rand(4, 2, 5, 5, dtype=torch.float64)
    expected = running_stats_of_unsplit_batch(model, x, chunks=2)
    pipe = GPipe(
        copy.deepcopy(model),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=2,
        checkpoint=checkpoint,
        deferred_batch_norm=True,
    )
    pipe(x).mean().backward()
    assert isinstance(pipe[1], gpipe.DeferredBatchNorm)
    for key, value in expected.items():
        layer, name = key.split(".", 1)
        assert relative_error(getattr(pipe[int(layer)], name), value) <= 1e-10, key


@pytest.mark.parametrize(
    ("checkpoint", "recomputed"), [("always", 2), ("except_last", 1), ("never", 0)]
)
def test_checkpoint_mode_recomputes_in_training_only(checkpoint, recomputed):
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(gpipe.is_recomputing())
            return x.tanh()

    pipe = GPipe(
        nn.Sequential(nn.Linear(1, 1), Probe()),
        [2],
        devices=["cpu"],
        chunks=2,
        checkpoint=checkpoint,
    )
    pipe(torch.rand(2, 1)).sum().backward()
    assert sum(seen) == recomputed
    seen.clear()
    pipe.eval()
    pipe(torch.rand(2, 1)).sum().backward()  # eval: still differentiable, never recomputed
    assert seen == [False, False]


def test_no_grad_builds_no_graph():
    pipe = GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks=2)
    latent = []
    pipe.partitions[0].register_forward_hook(lambda module, args, out: latent.append(out))
    with torch.no_grad():
        assert not pipe(torch.rand(2, 1)).requires_grad
    assert latent[-1].grad_fn is None


def test_a_batch_smaller_than_chunks_or_indivisible_is_fine(recwarn):
    pipe = GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks=4)
    assert pipe(torch.rand(7, 1)).shape == (7, 1)
    assert pipe(torch.rand(2, 1)).shape == (2, 1)  # two micro-batches, not four
    assert not recwarn.list


# -- torchgpipe's attributes and sequence -------------------------------------------------------


def test_public_attributes_as_torchgpipe_gives_them():
    class Text:
        def __str__(self):
            return "always"

    pipe = GPipe(
        nn.Sequential(nn.Linear(1, 1)),
        balance=(1,),
        devices=("cpu",),
        chunks=42.0,
        checkpoint=Text(),
    )
    assert pipe.balance == [1] and pipe.devices == [torch.device("cpu")]
    assert pipe.chunks == 42 and isinstance(pipe.chunks, int)
    assert pipe.checkpoint == "always" and isinstance(pipe.checkpoint, str)
    extra = GPipe(linears(3), [1, 1, 1], devices=["cpu"] * 5, chunks=3)
    assert extra.devices == [torch.device("cpu")] * 3  # extra devices are dropped


@pytest.mark.parametrize("balance", [[2], [1, 1]])
def test_layers_as_a_sequence(balance):
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = GPipe(nn.Sequential(a, b), balance, devices=["cpu", "cpu"], chunks=2)
    assert len(pipe) == 2 and list(pipe) == [a, b]
    assert pipe[0] is a and pipe[1] is b and pipe[-1] is b and pipe[-2] is a
    with pytest.raises(IndexError):
        pipe[2]


def test_partitions_keep_the_names_and_own_the_state_dict():
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = GPipe(
        nn.Sequential(OrderedDict([("a", a), ("b", b)])), [1, 1], devices=["cpu", "cpu"], chunks=2
    )
    assert isinstance(pipe.partitions, nn.ModuleList)
    assert all(isinstance(p, nn.Sequential) for p in pipe.partitions)
    names = {name for name, _ in pipe.named_modules()}
    assert {"partitions.0.a", "partitions.1.b"} <= names
    assert list(pipe.state_dict()) == [
        "partitions.0.a.weight", "partitions.0.a.bias", "partitions.1.b.weight",
        "partitions.1.b.bias",
    ]  # fmt: skip
    with pytest.raises(AttributeError):
        pipe.a  # noqa: B018 - a layer is reached through partitions or [i], as in torchgpipe


def test_moving_is_refused_and_casting_allowed():
    pipe = GPipe(linears(2), [1, 1], devices=["cpu", "cpu"], chunks=2)
    moves = [
        lambda: pipe.cuda(), lambda: pipe.cpu(), lambda: pipe.to(torch.device("cuda")),
        lambda: pipe.to(0), lambda: pipe.to("cuda"), lambda: pipe.to(device=0),
        lambda: pipe.to(torch.rand(1)), lambda: pipe.to(tensor=torch.rand(1)),
    ]  # fmt: skip
    for move in moves:
        with pytest.raises(TypeError, match="cannot be moved"):
            move()
    pipe.half()
    pipe.to(torch.double)
    pipe.to(dtype=torch.float)
    assert pipe[0].weight.dtype == torch.float32


def test_an_empty_module_is_the_identity():
    pipe = GPipe(nn.Sequential(), [])
    assert pipe(torch.tensor(42)) == torch.tensor(42)
    assert pipe((torch.tensor(42),)) == (torch.tensor(42),)
    with pytest.raises(TypeError):
        pipe(42)


# -- errors: torchgpipe's types, gpipe's messages ----------------------------------------------


def test_verify_module():
    with pytest.raises(TypeError, match=r"must be nn\.Sequential"):
        verify_module(nn.Module())
    conv = nn.Conv2d(3, 3, 1)
    with pytest.raises(ValueError, match="duplicate children"):
        verify_module(nn.Sequential(conv, conv))

    class Holder(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(ValueError, match="duplicate parameters in distinct children"):
        verify_module(nn.Sequential(Holder(conv), Holder(conv)))
    with pytest.raises(TypeError):
        GPipe(nn.Linear(1, 1), [1])


@pytest.mark.parametrize(
    ("balance", "match"),
    [(None, "balance is required"), ([1], "sums to 1"), ([3], "sums to 3"),
     ([0, 2], "positive"), ([-1, 3], "positive")],
)  # fmt: skip
def test_a_wrong_balance_is_a_value_error_recommending_the_balancer(balance, match):
    with pytest.raises(ValueError, match=match) as raised:
        GPipe(linears(2), balance, devices=["cpu", "cpu"])
    assert "gpipe.balance_by_time" in str(raised.value)


def test_configuration_errors_keep_torchgpipes_types():
    for chunks in (0, -1):
        with pytest.raises(ValueError, match="chunks must be a positive int"):
            GPipe(linears(1), [1], devices=["cpu"], chunks=chunks)
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        GPipe(linears(1), [1], devices=["cpu"], checkpoint="INVALID")
    with pytest.raises(IndexError, match="devices: 1, partitions: 4"):
        GPipe(linears(4), [1, 1, 1, 1], devices=["cpu"])
    with pytest.raises(ValueError, match="module is empty"):
        GPipe(nn.Sequential(), [1])


def test_inputs_and_outputs_must_be_tensors():
    class Says(nn.Module):
        def __init__(self, value):
            super().__init__()
            self.value = value

        def forward(self, x):
            return self.value(x)

    pipe = GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"])
    with pytest.raises(TypeError):
        pipe(torch.rand(1), torch.rand(1))  # one input, as torchgpipe's forward
    with pytest.raises(TypeError, match="input must be a tensor or a tuple of tensors"):
        pipe("hello")
    with pytest.raises(TypeError, match="got a tuple of Tensor, str"):
        pipe((torch.rand(2, 1), "hello"))
    for value in (lambda x: "hello", lambda x: (x, "hello")):
        pipe = GPipe(nn.Sequential(Says(value)), [1], devices=["cpu"])
        with pytest.raises(TypeError, match="output must be"):
            pipe(torch.rand(2, 1))


def test_a_layer_error_reaches_the_caller():
    class Boom(Exception):
        pass

    class Raise(nn.Module):
        def forward(self, x):
            raise Boom

    pipe = GPipe(nn.Sequential(nn.Identity(), Raise()), [1, 1], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(Boom):
        pipe(torch.rand(2, 1))


# -- across processes, pipe(x) is refused -------------------------------------------------------


def refused_across_processes(rank: int) -> str:
    pipe = gpipe.Pipe(linears(2), balance=[1, 1], chunks=2, group=dist.group.WORLD, timeout=30)
    with torch.no_grad():  # inference still runs
        out = pipe(torch.randn(4, 3, dtype=torch.float64))
    assert (out is not None) == (rank == 1)
    try:
        pipe(torch.randn(4, 3, dtype=torch.float64))
    except RuntimeError as error:
        return str(error)
    return "not refused"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pipe_x_with_autograd_is_refused_across_processes():
    messages = gpipe.launch(refused_across_processes, 2, timeout=30)
    for rank, message in enumerate(messages):
        assert f"rank {rank} of a pipeline over processes" in message
        assert "pipe.step(x, y, loss_fn)" in message


# -- docs/migrating.md ------------------------------------------------------------------------

BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "migrating.md").read_text(), re.S)
AFTER = [block for block in BLOCKS if not block.startswith("# before")]


def test_each_migration_has_a_before_and_an_after():
    assert len(AFTER) == 3 and len(BLOCKS) == 6


@pytest.mark.parametrize("code", AFTER, ids=["torchgpipe", "pipeline.sync", "pipelining"])
def test_the_after_code_of_docs_migrating_runs(code):
    exec(compile(code, str(ROOT / "docs" / "migrating.md"), "exec"), {"__name__": "__main__"})


def test_the_un_split_model_trains_the_same_way():
    """The torchgpipe example's loop, un-split, reaches the same weights (float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
    plain, pipe = copy.deepcopy(model), GPipe(model, [2, 1], devices=["cpu"] * 2, chunks=4)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, pipe)]
    for _ in range(3):
        x, y = torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 4, (16,))
        for module, optimizer in zip((plain, pipe), optimizers, strict=True):
            F.cross_entropy(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        assert relative_error(p, q) <= 1e-10
