"""gpipe.base._utils: moving a stage boundary, an input kept from a layer that writes it,
a step's gradients set aside, and its one read."""

from __future__ import annotations

import pytest
import torch

from gpipe.base._utils import (
    add_earlier_gradients,
    first_nonfinite,
    gradient_norms,
    norm_part,
    poison,
    read_verdict,
    restore_gradients,
    run_keeping_input,
    seconds,
    set_aside_gradients,
    storage_key,
    tensors_of,
    to_device,
)

CPU = torch.device("cpu")


def test_a_boundarys_tensors_and_their_copies_as_a_stages_inputs():
    a, b = torch.ones(2, requires_grad=True), torch.zeros(3)
    value = {"x": a, "rest": (b, 7)}
    assert sorted(map(id, tensors_of(value))) == sorted([id(a), id(b)])
    assert tensors_of(a)[0] is a
    leaves = to_device(value, CPU, as_leaves=True)
    assert leaves["rest"][1] == 7 and leaves["x"].is_leaf and leaves["x"].requires_grad
    assert not leaves["rest"][0].requires_grad
    assert leaves["x"] is not a and a.grad_fn is None  # detached: the caller's own stays as is
    same = to_device(a * 2, CPU, differentiable=True)
    assert same.grad_fn is not None  # the user's input keeps its graph
    assert storage_key(a[1:]) == storage_key(a)  # views share their memory
    grads = to_device([a, None, b], CPU, as_leaves=True)  # a flat list as the pytree's
    assert grads[1] is None and grads[0] is not a and grads[0].requires_grad
    flat = to_device([a, b], CPU)  # a stage's gradients: a list of tensors, moved as such
    assert type(flat) is list and flat[0] is not a and torch.equal(flat[1], b)


def test_an_input_is_kept_from_a_function_that_writes_it():
    x = {"a": torch.ones(3), "b": 2}
    out, writes = run_keeping_input(lambda v, k: v["a"].mul_(k), x, 5.0, writes=None)
    assert writes and torch.equal(out, torch.full((3,), 5.0))
    assert torch.equal(x["a"], torch.ones(3))  # ran on a copy, and will again
    out, writes = run_keeping_input(lambda v, k: v["a"].mul_(k), x, 5.0, writes=writes)
    assert writes and torch.equal(x["a"], torch.ones(3))
    leaf = torch.ones(3, requires_grad=True)  # autograd would refuse the write itself
    out, writes = run_keeping_input(torch.relu_, leaf, writes=None)
    assert writes and out.grad_fn is not None


def test_an_unwritten_input_is_learned_once_then_used_as_it_is():
    x = torch.ones(3)
    with torch.enable_grad():
        out, writes = run_keeping_input(torch.exp, x, writes=None, share=True)
    assert writes is False and torch.equal(out, torch.exp(x))
    seen = []
    out, writes = run_keeping_input(seen.append, x, writes=writes)
    assert writes is False and seen[0] is x  # known: no copy any more


def test_earlier_gradients_are_set_aside_added_back_or_restored():
    p, q = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    p.grad = torch.ones(2)
    earlier = set_aside_gradients([p, q])
    assert p.grad is None and set(earlier) == {p}
    p.grad, q.grad = torch.full((2,), 2.0), torch.full((2,), 5.0)  # this step's
    add_earlier_gradients(earlier)
    assert p.grad.tolist() == [3.0, 3.0] and q.grad.tolist() == [5.0, 5.0]
    restore_gradients([p, q], earlier)  # a failed step: as before it
    assert p.grad.tolist() == [1.0, 1.0] and q.grad is None


def test_norms_and_the_first_gradient_that_is_not_finite():
    grads = [
        torch.tensor([3.0, 4.0]),
        torch.tensor([1.0]),
        torch.full((4,), 3e38, dtype=torch.float32),
    ]
    norms = gradient_norms(grads)
    assert norms.dtype == torch.float64 and norms.tolist() == pytest.approx([5.0, 1.0, 6e38])
    assert norm_part(grads[:2], 2.0, CPU).item() == pytest.approx(26.0)  # sum of squares
    assert norm_part(grads[:2], float("inf"), CPU).item() == 4.0  # the largest entry
    # a norm past float32's range reads as infinite there: told apart from a gradient's inf
    fast = gradient_norms(grads, precise=False)
    verdict = read_verdict(torch.tensor(0.5), fast, torch.tensor([True, False]))
    assert verdict.loss == 0.5 and verdict.finite == [True, True, False] and verdict.ignored
    assert first_nonfinite(["a", "b", "c"], verdict.finite, grads, fast) is None
    assert fast[2].item() == pytest.approx(6e38)  # summed again in float64
    poison(grads[1])
    finite = read_verdict(None, gradient_norms(grads), None).finite
    assert first_nonfinite(["a", "b", "c"], finite, grads) == "b"


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "5"])
def test_a_duration_is_a_finite_number_of_seconds(bad):
    assert seconds(2, "timeout") == 2.0
    with pytest.raises(
        ValueError, match=rf"timeout must be a finite number of seconds > 0, got {bad!r}"
    ):
        seconds(bad, "timeout")
