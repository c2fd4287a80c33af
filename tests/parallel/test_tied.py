"""Tied weights: one tensor used by two stages (a GPT's embedding and output head)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpipe
from gpipe.base.errors import PartitionError
from gpipe.models import GPTConfig, gpt, gpt_tied_names, lm_loss
from gpipe.parallel.tied import TiedError
from reference import reference_step, relative_error, twin

CONFIG = GPTConfig(vocab_size=32, context=8, d_model=16, n_heads=2, n_layers=3)
TIED = gpt_tied_names(CONFIG)


def case(seed=0):
    torch.manual_seed(seed)
    model = gpt(CONFIG, tie_embeddings=True).double()
    x = torch.randint(0, 32, (8, 8))
    y = torch.randint(0, 32, (8, 8))
    return model, x, y


def check_gradients(pipe, reference):
    ours = dict(pipe.named_parameters())
    theirs = dict(reference.named_parameters())  # the tied tensor appears once, as in ours
    assert set(ours) == set(theirs)
    for name, param in theirs.items():
        assert relative_error(ours[name].grad, param.grad) <= 1e-10, name
    every = dict(pipe.named_parameters(remove_duplicate=False))
    assert every[TIED[0]] is every[TIED[1]]  # stages on one device share the tensor


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize(
    ("schedule", "devices", "virtual", "balance"),
    [
        ("gpipe", 3, 1, [2, 1, 2]),
        ("1f1b", 3, 1, [2, 1, 2]),
        ("zb-h1", 2, 1, [3, 2]),
        ("interleaved-1f1b", 2, 2, [1, 2, 1, 1]),
    ],
)
def test_tied_gradients_are_the_sum_over_both_uses(schedule, devices, virtual, balance, checkpoint):
    model, x, y = case()
    reference = twin(model)
    pipe = gpipe.Pipe(
        model,
        balance=balance,
        devices=["cpu"] * devices,
        chunks=4,
        schedule=schedule,
        virtual_stages=virtual,
        checkpoint=checkpoint,
        tied=[TIED],
    )
    loss = pipe.step(x, y, lm_loss, seed=3)
    expected = reference_step(reference, x, y, lm_loss, chunks=4, seed=3)
    assert relative_error(loss, expected) <= 1e-10
    check_gradients(pipe, reference)


def test_copies_stay_identical_through_ten_adamw_steps():
    model, x, y = case()
    reference = twin(model)
    pipe = gpipe.Pipe(model, balance=[2, 1, 2], devices=["cpu"] * 3, chunks=2, tied=[TIED])
    ours = dict(pipe.named_parameters(remove_duplicate=False))
    theirs = dict(reference.named_parameters())
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(10):
        pipe.step(x, y, lm_loss, seed=step)
        reference_step(reference, x, y, lm_loss, chunks=2, seed=step)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert torch.equal(ours[TIED[0]], ours[TIED[1]])
    for name, param in theirs.items():
        assert relative_error(ours[name], param) <= 1e-10, name
    # The plain model's state dict (both names) loads back into the Pipe, copies equal.
    pipe.load_state_dict(reference.state_dict())
    assert torch.equal(ours[TIED[0]], ours[TIED[1]])


def test_sharing_across_stages_must_be_declared():
    model, _, _ = case()
    with pytest.raises(PartitionError, match=r"declare it tied: tied=\[\(name, other_name\)\]"):
        gpipe.Pipe(model, balance=[2, 1, 2], devices=["cpu"] * 3)


def test_bad_tied_declarations():
    model, _, _ = case()
    with pytest.raises(TiedError) as info:
        gpipe.Pipe(
            model,
            balance=[2, 1, 2],
            devices=["cpu"] * 3,
            tied=[TIED, ("0.token.weight", "nope.weight"), ("0.token.weight", "1.qkv.bias")],
        )
    assert "['nope.weight'] are not parameters" in str(info.value)
    assert "different shapes" in str(info.value)


def test_tie_within_one_stage_needs_no_copy():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(4, 2)).double()
    reference = twin(model)
    pipe = gpipe.Pipe(model, balance=[3, 1], chunks=2, tied=[("0.weight", "2.weight")])
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 2, (4,))
    pipe.step(x, y, nn.functional.cross_entropy, seed=0)
    reference_step(reference, x, y, nn.functional.cross_entropy, chunks=2, seed=0)
    ours = dict(pipe.named_parameters())
    for name, param in reference.named_parameters():
        assert relative_error(ours[name].grad, param.grad) <= 1e-10


def test_clip_grad_norm_counts_a_tied_tensor_once():
    model, x, y = case()
    reference = twin(model)
    pipe = gpipe.Pipe(model, balance=[2, 1, 2], devices=["cpu"] * 3, chunks=2, tied=[TIED])
    pipe.step(x, y, lm_loss, seed=0)
    reference_step(reference, x, y, lm_loss, chunks=2, seed=0)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    norm = pipe.clip_grad_norm_(0.1)
    assert relative_error(norm.double(), expected) <= 1e-6
    ours = dict(pipe.named_parameters())
    for name, param in reference.named_parameters():
        assert relative_error(ours[name].grad, param.grad) <= 1e-9, name


def test_a_copy_on_another_device_is_gpipes_and_follows_every_optimizer_step(monkeypatch):
    """Stages on two devices in one process (here 'cpu' and 'cpu:0', told apart): the second
    holds gpipe's copy, which is no parameter of the Pipe, gives its gradient to the
    caller's, is equal to it after every optimizer step and keeps no gradient when frozen."""
    from gpipe.parallel import tied

    monkeypatch.setattr(tied, "_placed", torch.device)  # "cpu:0" is not "cpu" here
    model, x, y = case()
    reference = twin(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # first
    pipe = gpipe.Pipe(model, balance=[2, 1, 2], devices=["cpu", "cpu", "cpu:0"], chunks=2,
                      tied=[TIED])  # fmt: skip
    every = dict(pipe.named_parameters(remove_duplicate=False))
    assert every[TIED[0]] is not every[TIED[1]]
    assert set(dict(pipe.named_parameters())) == {n for n, _ in reference.named_parameters()}
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        if step == 2:  # frozen from here on, in both
            for m in (model, reference):
                m[0].token.weight.requires_grad_(False)
        pipe.step(x, y, lm_loss, seed=step)
        reference_step(reference, x, y, lm_loss, chunks=2, seed=step)
        norm = torch.nn.utils.clip_grad_norm_(pipe.parameters(), 0.5)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        assert relative_error(norm, expected) <= 1e-10
        assert every[TIED[1]].grad is None
        assert (every[TIED[0]].grad is None) == (step == 2)
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
        assert torch.equal(every[TIED[0]], every[TIED[1]])  # no forward since the step
    theirs = reference.state_dict()
    for name, value in pipe.state_dict().items():
        assert relative_error(value, theirs[name]) <= 1e-10, name
