"""B (input gradient) + W (weight gradients) equals one full backward, at the same cost."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gpipe.engine import split_backward
from gpipe.engine.split_backward import backward_input, backward_weight
from gpipe.models import GPTConfig, convnet, gpt
from reference import relative_error


class TwiceUsed(nn.Module):
    """One weight used at two depths, plus a bias-only branch off the output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.extra = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.linear(torch.tanh(self.linear(x))) + self.extra


def cases():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=16, context=5, d_model=8, n_heads=2, n_layers=2, dropout=0.0)
    block = gpt(config)[1]
    yield "mlp", nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)), (4, 6)
    yield "gpt-block", block, (3, 5, 8)
    yield "cnn", convnet(in_channels=2, channels=4, blocks=1)[1:], (3, 4, 5, 5)
    yield "shared-weight", TwiceUsed(), (4, 6)


@pytest.mark.parametrize(("name", "module", "shape"), list(cases()), ids=lambda c: c)
def test_split_equals_full_backward(name, module, shape):
    module = module.double()
    x = torch.randn(*shape, dtype=torch.float64)
    if name == "cnn":
        x = torch.randn(3, 4, 5, 5, dtype=torch.float64)

    leaf = x.clone().requires_grad_()
    out = module(leaf)
    grad = torch.randn_like(out)
    with FlopCounterMode(display=False) as full_flops:
        out.backward(grad)
    expected_input = leaf.grad.clone()
    expected = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)

    leaf = x.clone().requires_grad_()
    out = module(leaf)
    with FlopCounterMode(display=False) as b_flops:
        (grad_input,), work = backward_input([out], [grad], [leaf], list(module.parameters()))
    assert all(p.grad is None for p in module.parameters()), "B must not touch weights"
    with FlopCounterMode(display=False) as w_flops:
        backward_weight(work)

    assert relative_error(grad_input, expected_input) <= 1e-12
    for n, p in module.named_parameters():
        assert relative_error(p.grad, expected[n]) <= 1e-12, n
    split_cost = b_flops.get_total_flops() + w_flops.get_total_flops()
    if name == "shared-weight":
        # Known cost: W re-derives the activation gradient between the two uses of a
        # weight (here one extra matmul of three), documented in gpipe.split_backward.
        assert split_cost < 1.3 * full_flops.get_total_flops()
    else:
        # No activation gradient is computed twice: B + W cost what one backward costs.
        assert split_cost == full_flops.get_total_flops()
    assert b_flops.get_total_flops() > 0 and w_flops.get_total_flops() > 0


def test_inputs_without_grad_defer_everything_to_w():
    module = nn.Linear(3, 3).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    out = module(x)
    (grad_input,), work = backward_input([out], [torch.ones_like(out)], [x], [module.weight])
    assert grad_input is None and module.weight.grad is None
    backward_weight(work)
    assert torch.allclose(module.weight.grad, torch.ones(3, 2, dtype=torch.float64) @ x)


def test_weights_accumulate_across_microbatches():
    module = nn.Linear(3, 3).double()
    total = torch.zeros_like(module.weight)
    for _ in range(3):
        x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
        out = module(x)
        _, work = backward_input([out], [torch.ones_like(out)], [x], list(module.parameters()))
        backward_weight(work)
        total += torch.ones(3, 2, dtype=torch.float64) @ x.detach()
    assert relative_error(module.weight.grad, total) <= 1e-12


def test_memory_released_as_soon_as_unneeded():
    """After B only what W needs stays; W frees each group's gradients before the next."""
    import weakref

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    logits = module(x)
    saved_above = weakref.ref(logits)  # saved by logsumexp's backward, not by the Linear
    loss = logits.logsumexp(dim=1).sum()  # the part above the top Linear: freed after B
    del logits
    _, work = backward_input([loss], [None], [x], list(module.parameters()))
    del loss
    assert saved_above() is None and work.roots == []

    # Each call of W sees its own recorded gradients and those of the groups to come only.
    recorded = [
        [weakref.ref(g) for g in grads if g is not None]
        for group in work.groups
        for grads in group.grads.values()
    ]
    alive_at_call = []
    original = split_backward._accumulate

    def counting(*args):
        alive_at_call.append(sum(any(r() is not None for r in refs) for refs in recorded))
        return original(*args)

    split_backward._accumulate = counting
    try:
        backward_weight(work)
    finally:
        split_backward._accumulate = original
    assert alive_at_call == [len(recorded) - i for i in range(len(recorded))]
    # Same gradients as one full backward.
    expected = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    module(x).logsumexp(dim=1).sum().backward()
    for got, want in zip(expected, module.parameters(), strict=True):
        assert relative_error(got, want.grad) <= 1e-12


# -- every leaf the graph reaches, along every path -----------------------------------------


def _passed_on(x, lin, p, t):
    bias = p.tanh()  # from the parameter alone: used here and passed on
    return [lin(x) * bias, bias], [None, None]


def _parameter_as_output(x, lin, p, t):
    return [lin(x) + p, p], [None, None]


def _loss_with_a_temperature(x, lin, p, t):
    loss = torch.nn.functional.cross_entropy(lin(x) / t, torch.tensor([0, 1, 2, 3]))
    return [loss + (p * p).sum()], [1.0]


def _weight_at_two_depths_and_passed_on(x, lin, p, t):
    h = lin(torch.tanh(lin(x)) + p)
    return [h, (p * lin.weight.sum()).exp()], [None, None]


def _tensor_hook_on_a_start(x, lin, p, t):
    h = lin(x)
    h.register_hook(lambda g: g * 3)  # run in B; W's start must not apply it again
    return [torch.tanh(h) + p], [None]


def _output_reused_by_another(x, lin, p, t):
    bias = p.tanh()
    return [lin(x) + bias, bias * 2, bias], [None, None, None]


@pytest.mark.parametrize(
    "build",
    [
        _passed_on,
        _parameter_as_output,
        _loss_with_a_temperature,
        _weight_at_two_depths_and_passed_on,
        _tensor_hook_on_a_start,
        _output_reused_by_another,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_w_delivers_every_leaf_as_the_full_backward(build):
    """Only the Linear is named as the stage's parameters: the bias parameter and the
    temperature are found in the graph."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 6).double()
    p = nn.Parameter(torch.randn(6, dtype=torch.float64))
    t = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 6, dtype=torch.float64)
    leaves = [lin.weight, lin.bias, p, t]

    def run(split: bool):
        for leaf in leaves:
            leaf.grad = None
        leaf = x.clone().requires_grad_()
        roots, kinds = build(leaf, lin, p, t)
        torch.manual_seed(1)
        grads = [
            None if k is not None else torch.randn_like(r)
            for r, k in zip(roots, kinds, strict=True)
        ]
        if not split:
            torch.autograd.backward(roots, [g if g is not None else torch.ones(()) for g in grads])
            return leaf.grad, [leaf_.grad for leaf_ in leaves]
        (grad_input,), work = backward_input(roots, grads, [leaf], [lin.weight, lin.bias])
        assert all(leaf_.grad is None for leaf_ in leaves), "B must not touch weights"
        backward_weight(work)
        return grad_input, [leaf_.grad for leaf_ in leaves]

    expected_input, expected = run(split=False)
    grad_input, got = run(split=True)
    assert relative_error(grad_input, expected_input) <= 1e-12
    for name, ours, theirs in zip(["weight", "bias", "p", "t"], got, expected, strict=True):
        assert (ours is None) == (theirs is None), name
        if theirs is not None:
            assert relative_error(ours, theirs) <= 1e-12, name


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.reentrant = reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_graph_autograd_cannot_split_runs_whole_in_b(reentrant):
    """A reentrant checkpoint runs a backward of its own and refuses .grad: B then runs the
    whole backward (and says why), W nothing; the non-reentrant one splits."""
    module = _Checkpointed(reentrant).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    leaf = x.clone().requires_grad_()
    out = module(leaf)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected_input, expected = leaf.grad, [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)

    leaf = x.clone().requires_grad_()
    (grad_input,), work = backward_input([module(leaf)], [grad], [leaf], [])
    assert (work.whole is not None) == reentrant
    if reentrant:
        assert "use_reentrant=False" in work.whole and not work.groups
    backward_weight(work)
    assert relative_error(grad_input, expected_input) <= 1e-12
    for p, theirs in zip(module.parameters(), expected, strict=True):
        assert relative_error(p.grad, theirs) <= 1e-12


def test_run_backward_accumulates_as_autograd_and_refuses_what_it_refuses():
    torch.manual_seed(0)
    layer, x = nn.Linear(3, 2).double(), torch.randn(4, 3, dtype=torch.float64)
    grad = torch.randn(4, 2, dtype=torch.float64)
    torch.autograd.backward([layer(x), layer(x).sum()], [grad, None])
    expected = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    split_backward.run_backward([layer(x), layer(x).sum()], [grad, None])
    assert all(torch.equal(p.grad, e) for p, e in zip(layer.parameters(), expected, strict=True))
    with pytest.raises(RuntimeError, match=r"no gradient for root 0 of shape \(4, 2\)"):
        split_backward.run_backward([layer(x)], [None])  # ones only for a loss
    with pytest.raises(RuntimeError, match=r"only a real one-element root"):
        split_backward.run_backward([layer(x).sum().to(torch.complex128)], [None])
    with pytest.raises(RuntimeError, match=r"gradient of shape \(1, 2\).*root 0 of shape \(4, 2\)"):
        split_backward.run_backward([layer(x)], [grad[:1]])  # broadcastable: still refused
