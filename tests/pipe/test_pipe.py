"""Pipe against the un-split model: loss and every parameter's gradient must match."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.models import GPTConfig, convnet, gpt, lm_loss, mlp
from reference import (
    assert_step_matches,
    even_balance,
    full_batch_step,
    reference_step,
    relative_error,
    running_stats_of_unsplit_batch,
    twin,
    worst_gradient_error,
)

CHECKPOINTS = ["always", "except_last", "never"]
BATCH = 10  # uneven for M=3 (4,3,3) and M=8 (2,2,1,1,1,1,1,1)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def make_case(name: str, dtype: torch.dtype, seed: int = 0):
    """(model, inputs, targets, loss_fn) for one of the test models."""
    torch.manual_seed(seed)
    if name == "mlp":
        model = mlp([16, 32, 32, 32, 8])
        x, y = torch.randn(BATCH, 16), torch.randint(0, 8, (BATCH,))
        loss_fn = F.cross_entropy
    elif name == "gpt":
        config = GPTConfig(vocab_size=32, context=8, d_model=16, n_heads=2, n_layers=2)
        model = gpt(config)
        x = torch.randint(0, 32, (BATCH, 8))
        y = torch.randint(0, 32, (BATCH, 8))
        loss_fn = lm_loss
    elif name == "cnn":
        model = convnet(channels=4, blocks=2)
        x, y = torch.randn(BATCH, 1, 6, 6), torch.randint(0, 10, (BATCH,))
        loss_fn = F.cross_entropy
    else:
        raise ValueError(name)
    model = model.to(dtype)
    if x.is_floating_point():
        x = x.to(dtype)
    return model, x, y, loss_fn


def check_step(name, stages, chunks, checkpoint, dtype=torch.float64):
    model, x, y, loss_fn = make_case(name, dtype)
    reference, initial = twin(model), twin(model)
    deferred = name == "cnn"
    pipe = gpipe.Pipe(
        model,
        balance=even_balance(len(model), stages),
        chunks=chunks,
        checkpoint=checkpoint,
        deferred_batch_norm=deferred,
    )
    loss = pipe.step(x, y, loss_fn, seed=1234)
    expected = reference_step(reference, x, y, loss_fn, chunks=chunks, seed=1234)
    assert relative_error(loss, expected) <= TOLERANCE[dtype]
    worst, where = worst_gradient_error(pipe, reference)
    assert worst <= TOLERANCE[dtype], f"worst gradient error {worst:.3g} at {where}"
    if deferred:
        expected_stats = running_stats_of_unsplit_batch(initial, x, chunks)
        assert expected_stats
        state = pipe.state_dict()
        for key, value in expected_stats.items():
            assert relative_error(state[key], value) <= TOLERANCE[dtype], key
    return worst


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_gradients_equal_unsplit_model_float64(name, stages, chunks, checkpoint):
    check_step(name, stages, chunks, checkpoint)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_gradients_equal_unsplit_model_float32(name, checkpoint):
    check_step(name, 3, 3, checkpoint, dtype=torch.float32)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_without_dropout_equals_one_full_batch(checkpoint):
    """No randomness, no batch norm: the pipe equals a single full-batch step."""
    model, x, y, loss_fn = make_case("mlp", torch.float64)
    reference = twin(model)
    pipe = gpipe.Pipe(model, balance=[2, 3, 2], chunks=3, checkpoint=checkpoint)
    loss = pipe.step(x, y, loss_fn)
    expected = full_batch_step(reference, x, y, loss_fn)
    assert relative_error(loss, expected) <= 1e-12
    assert worst_gradient_error(pipe, reference)[0] <= 1e-10


def test_sum_reduction():
    model, x, y, _ = make_case("mlp", torch.float64)
    reference = twin(model)

    def loss_fn(out, target):
        return F.cross_entropy(out, target, reduction="sum")

    pipe = gpipe.Pipe(model, balance=[4, 3], chunks=4)
    loss = pipe.step(x, y, loss_fn, reduction="sum")
    expected = full_batch_step(reference, x, y, loss_fn)
    assert relative_error(loss, expected) <= 1e-12
    assert worst_gradient_error(pipe, reference)[0] <= 1e-10


def test_custom_normalization_with_sum_reduction():
    """Token-mean over a padded batch: divide by the mini-batch's token count, reduce 'sum'."""
    model, x, y, _ = make_case("gpt", torch.float64)
    y[:3, 5:] = -1  # padding
    n_tokens = int((y != -1).sum())

    def loss_fn(logits, target):
        flat = F.cross_entropy(
            logits.flatten(0, 1), target.flatten(), ignore_index=-1, reduction="sum"
        )
        return flat / n_tokens

    model.eval()  # no dropout: compare with one full-batch step
    reference = twin(model)
    pipe = gpipe.Pipe(model, balance=[2, 2], chunks=3)
    loss = pipe.step(x, y, loss_fn, reduction="sum")
    expected = full_batch_step(reference, x, y, loss_fn)
    assert relative_error(loss, expected) <= 1e-12
    assert worst_gradient_error(pipe, reference)[0] <= 1e-10


def test_twenty_adamw_steps_match_reference():
    model, x, y, loss_fn = make_case("gpt", torch.float64)
    reference = twin(model)
    pipe = gpipe.Pipe(model, balance=[1, 2, 1], chunks=4, checkpoint="except_last")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(20):
        losses.append(pipe.step(x, y, loss_fn, seed=step).item())
        ref_losses.append(reference_step(reference, x, y, loss_fn, chunks=4, seed=step).item())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    assert losses[-1] < losses[0] * 0.8, "training should reduce the loss"
    for ours, theirs in zip(losses, ref_losses, strict=True):
        assert abs(ours - theirs) <= 1e-10 * abs(theirs)
    params = dict(pipe.named_parameters())
    for name, param in reference.named_parameters():
        assert relative_error(params[name], param) <= 1e-10, name


def test_inference_matches_model():
    model, x, _, _ = make_case("cnn", torch.float64)
    model.eval()
    expected = twin(model)(x)
    pipe = gpipe.Pipe(model, balance=[3, 3, 2], chunks=4, deferred_batch_norm=True).eval()
    out = pipe(x)
    assert not out.requires_grad
    assert relative_error(out, expected) <= 1e-12


def test_inference_in_training_mode_updates_running_stats_once():
    model, x, _, _ = make_case("cnn", torch.float64)
    expected = running_stats_of_unsplit_batch(model, x, chunks=3)
    pipe = gpipe.Pipe(model, balance=[4, 4], chunks=3, deferred_batch_norm=True)
    pipe(x)
    state = pipe.state_dict()
    for key, value in expected.items():
        assert relative_error(state[key], value) <= 1e-10, key


def test_state_dict_uses_whole_model_names_and_round_trips():
    model, *_ = make_case("gpt", torch.float64)
    plain = twin(model)
    pipe = gpipe.Pipe(model, balance=[1, 2, 1], chunks=2)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert "1.qkv.weight" in dict(pipe.named_parameters())
    other = twin(plain)
    for p in other.parameters():
        nn.init.normal_(p)
    pipe.load_state_dict(other.state_dict())
    plain.load_state_dict(pipe.state_dict())
    for (_, a), (_, b) in zip(plain.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b)


SCHEDULE_CASES = [
    # (schedule, devices, virtual stages, chunks)
    ("gpipe", 3, 1, 5),
    ("1f1b", 3, 1, 5),
    ("1f1b", 4, 1, 2),  # fewer micro-batches than stages
    ("zb-h1", 3, 1, 5),
    ("zb-h1", 4, 1, 8),
    ("interleaved-1f1b", 2, 2, 4),
    ("interleaved-1f1b", 2, 3, 6),
]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize(("schedule", "devices", "virtual", "chunks"), SCHEDULE_CASES)
@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_every_schedule_equals_unsplit_model(name, schedule, devices, virtual, chunks, checkpoint):
    """Dropout (gpt) and deferred batch norm (cnn) included; float64."""
    model, x, y, loss_fn = make_case(name, torch.float64, seed=1)
    if name == "gpt":  # enough layers for 6 stages
        torch.manual_seed(1)
        config = GPTConfig(vocab_size=32, context=8, d_model=16, n_heads=2, n_layers=4)
        model = gpt(config).double()
    x = torch.cat([x, x[:2]])  # batch 12
    y = torch.cat([y, y[:2]])
    reference, initial = twin(model), twin(model)
    pipe = gpipe.Pipe(
        model,
        balance=even_balance(len(model), devices * virtual),
        devices=["cpu"] * devices,
        chunks=chunks,
        checkpoint=checkpoint,
        schedule=schedule,
        virtual_stages=virtual,
        deferred_batch_norm=name == "cnn",
    )
    assert_step_matches(pipe, reference, x, y, loss_fn, chunks=chunks, seed=99)
    if name == "cnn":
        state = pipe.state_dict()
        for key, value in running_stats_of_unsplit_batch(initial, x, chunks).items():
            assert relative_error(state[key], value) <= 1e-10, key
    assert all(not stage.pending for stage in pipe.stages)
