"""The last stage's loss: each micro-batch's share (``loss_specs``) and what the loss may read.

Each way of weighing the micro-batches is checked the way the engine is: the weighted sum of
the micro-batches' losses gives every parameter the gradient of the mini-batch's loss.
"""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import captured_models
import gpipe
import user_scripts
from gpipe.engine.loss import (
    ForeignParameters,
    LossSpec,
    check_batch,
    check_loss,
    compute_loss,
    loss_specs,
)
from gpipe.losses import masked_lm
from gpipe.models import gpt
from reference import relative_error

CPU = torch.device("cpu")


def _gradients(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _micro_batch_gradients(model, x, specs) -> dict[str, torch.Tensor]:
    xs = torch.tensor_split(x, len(specs))
    total = 0
    for x_m, spec in zip(xs, specs, strict=True):
        loss = compute_loss(spec, model(x_m))
        total = total + (loss / spec.divisor if spec.divisor is not None else loss * spec.weight)
    return _gradients(model, total)


def _assert_same_gradients(model, plain_loss, x, specs):
    expected = _gradients(model, plain_loss)
    got = _micro_batch_gradients(model, x, specs)
    for name, grad in expected.items():
        assert relative_error(got[name], grad) < 1e-10, name


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_uneven_micro_batches_add_up_to_the_mini_batch_loss(reduction):
    torch.manual_seed(0)
    model = nn.Linear(3, 4).double()
    x, y = torch.randn(7, 3, dtype=torch.float64), torch.randint(0, 4, (7,))
    loss_fn = lambda out, t: F.cross_entropy(out, t, reduction=reduction)  # noqa: E731
    specs = loss_specs(
        loss_fn, list(torch.tensor_split(y, 3)), None, reduction=reduction, count=None, device=CPU
    )
    assert [s.weight for s in specs] == ([3 / 7, 2 / 7, 2 / 7] if reduction == "mean" else [1] * 3)
    _assert_same_gradients(model, loss_fn(model(x), y), x, specs)


def test_count_weighs_each_micro_batch_by_what_its_mean_is_over():
    torch.manual_seed(0)
    model = nn.Linear(3, 5).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 5, (6,))
    y[1] = y[4] = -100  # padding: 1, 2 and 1 labels count
    ys = list(torch.tensor_split(y, 3))
    specs = loss_specs(
        F.cross_entropy, ys, None, reduction="mean", count=lambda t: (t != -100).sum(), device=CPU
    )
    assert [s.weight for s in specs] == [0.25, 0.5, 0.25]
    _assert_same_gradients(model, F.cross_entropy(model(x), y), x, specs)


def test_a_token_loss_divides_its_sum_by_the_mini_batch_count_read_on_the_device():
    torch.manual_seed(0)
    model = nn.Linear(3, 5).double()
    loss_fn = masked_lm()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 5, (6,))
    y[:2] = -100  # nothing counts in the first micro-batch: an exact zero
    specs = loss_specs(
        loss_fn, list(torch.tensor_split(y, 3)), None, reduction="mean", count=loss_fn.count,
        device=CPU,
    )  # fmt: skip
    assert all(s.divisor is specs[0].divisor and s.divisor.item() == 4 for s in specs)
    _assert_same_gradients(model, F.cross_entropy(model(x), y), x, specs)


def test_wrong_settings_name_the_value_and_the_remedy():
    ys = [torch.zeros(2), torch.zeros(2)]
    kwargs = dict(count=None, device=CPU)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
        loss_specs(F.mse_loss, ys, None, reduction="none", **kwargs)
    with pytest.raises(ValueError, match="count= weighs the micro-batches' means"):
        loss_specs(F.mse_loss, ys, None, reduction="sum", count=len, device=CPU)
    with pytest.raises(ValueError, match=r"different batch sizes \(5 and 4\).*one target per"):
        loss_specs(F.mse_loss, ys, [torch.zeros(3), torch.zeros(2)], reduction="mean", **kwargs)
    with pytest.raises(ValueError, match=r"count\(target\) must be >= 0 .* got \[0.0, 0.0\]"):
        loss_specs(F.mse_loss, ys, None, reduction="mean", count=lambda t: 0, device=CPU)
    specs = loss_specs(F.mse_loss, ys, None, reduction="mean", **kwargs)
    check_batch(specs, 4)
    with pytest.raises(ValueError, match=r"the targets hold 4 samples but the inputs .* 5"):
        check_batch(specs, 5)
    with pytest.raises(ValueError, match=r"scalar tensor, got float.*reduction="):
        compute_loss(LossSpec(lambda out, t: 1.0, None), torch.zeros(1))


def test_a_loss_that_reads_another_stages_parameter_is_refused_by_name():
    mine, theirs = nn.Linear(2, 2), nn.Linear(2, 2)
    on_meta = nn.Parameter(torch.empty(1, device="meta"))  # nothing reads those
    foreign = ForeignParameters([("0.weight", theirs.weight), ("meta", on_meta)])
    assert foreign and not ForeignParameters()
    assert foreign.name_of(theirs.weight) == "0.weight" and foreign.name_of(mine.weight) is None
    assert foreign.name_of(on_meta) is None
    stage = SimpleNamespace(
        index=1, foreign=foreign, value_of=lambda v: v, parameters=mine.parameters,
        needs_grad=lambda inputs: True,
    )  # fmt: skip
    x = torch.randn(3, 2)
    out = mine(x)
    check_loss(out.sum(), stage, out, x)  # its own parameters: fine
    with pytest.raises(Exception, match=r"loss_fn reads 0\.weight, which the last stage \(1\)"):
        check_loss(out.sum() + theirs.weight.sum(), stage, out, x)
    with pytest.raises(RuntimeError, match="does not require grad"):
        check_loss(out.sum().detach(), stage, out, x)


# -- through a Pipe: a token mean over a padded batch -----------------------------------------


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_padded_token_mean_is_exact_with_count(schedule):
    config = user_scripts.TIED_GPT
    torch.manual_seed(0)
    plain = gpt(config).double()
    pipe = gpipe.Pipe(copy.deepcopy(plain), balance=[2, 2], chunks=4, schedule=schedule)
    generator = torch.Generator().manual_seed(5)
    x = torch.randint(0, 32, (8, 8), generator=generator)
    y = torch.randint(0, 32, (8, 8), generator=generator)
    lengths = torch.tensor([8, 1, 2, 8, 5, 3, 8, 7])  # micro-batch 1 is mostly padding
    y[torch.arange(8)[None, :] >= lengths[:, None]] = -100
    y[2:4] = -100  # and micro-batch 1 holds no token at all
    token_loss(plain(x), y).backward()
    loss = pipe.step(x, y, token_loss, count=lambda t: (t != -100).sum())
    assert torch.isfinite(loss)
    for (name, ours), theirs in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        assert relative_error(ours.grad, theirs.grad) < 1e-10, name


def test_count_is_checked():
    pipe = gpipe.Pipe(user_scripts.mlp(), balance=[2, 3], chunks=2)
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match=r"count.* > 0 in all"):
        pipe.step(x, y, F.cross_entropy, count=lambda t: 0)
    with pytest.raises(ValueError, match="use reduction='mean'"):
        pipe.step(x, y, F.cross_entropy, reduction="sum", count=len)


# -- through a Pipe: gpipe.losses' token means over padded batches -----------------------------


def _padded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (8, 8), generator=generator)
    labels = torch.randint(0, 32, (8, 8), generator=generator)
    lengths = torch.tensor([8, 1, 2, 8, 5, 3, 8, 7])
    labels[torch.arange(8)[None, :] >= lengths[:, None]] = -100
    labels[2:4] = -100  # micro-batch 1 (of 4) holds no label that counts
    return x, labels


@pytest.mark.parametrize("name", ["causal_lm", "masked_lm"])
def test_padded_token_means_of_gpipe_losses_train_as_in_the_plain_model(name):
    loss_fn = getattr(gpipe.losses, name)()
    torch.manual_seed(0)
    plain = gpt(user_scripts.TIED_GPT).double()
    pipe = gpipe.Pipe(copy.deepcopy(plain), balance=[2, 2], chunks=4)
    optimizer, plain_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (pipe, plain))
    for step in range(2):
        x, labels = _padded_batch(step)
        expected = loss_fn(plain(x), labels)  # the whole batch's token mean
        expected.backward()
        loss = pipe.step(x, labels, loss_fn)
        assert relative_error(loss, expected.detach()) < 1e-10
        for (name_, ours), theirs in zip(pipe.named_parameters(), plain.parameters(), strict=True):
            assert relative_error(ours.grad, theirs.grad) < 1e-10, (step, name_)
        plain_opt.step()
        optimizer.step()
        plain_opt.zero_grad()
        optimizer.zero_grad()


@pytest.mark.skipif(captured_models.transformers is None, reason="needs transformers")
def test_causal_lm_gives_a_hugging_face_models_own_labels_loss():
    case = captured_models.CASES["hf-llama"]
    plain = case.build()
    pipe = gpipe.Pipe.from_model(
        copy.deepcopy(plain), case.example(), split=case.split, balance=[2, 3], chunks=4
    )
    x, labels = _padded_batch(0)
    own = plain(input_ids=x, labels=labels).loss  # shifted inside, averaged in float32
    expected = gpipe.losses.causal_lm()(plain(input_ids=x), labels)  # the same, in float64
    assert relative_error(expected.detach(), own.detach()) < 1e-6
    expected.backward()
    loss = pipe.step(x, labels, gpipe.losses.causal_lm())
    assert relative_error(loss, expected.detach()) < 1e-10
    ours = dict(pipe.named_parameters())
    for name, theirs in plain.named_parameters():
        assert relative_error(ours[name].grad, theirs.grad) < 1e-10, name


def test_a_padded_mean_without_count_warns_once_and_an_empty_micro_batch_says_why():
    torch.manual_seed(0)
    pipe = gpipe.Pipe(gpt(user_scripts.TIED_GPT).double(), balance=[2, 2], chunks=4)
    x, labels = _padded_batch(0)
    full = labels.clone()
    full[full == -100] = 0  # nothing ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.step(x, full, token_loss)  # no -100: a sample mean is the token mean
        pipe.step(x, labels, token_loss, count=lambda t: (t != -100).sum())
    labels[2:4] = 5  # every micro-batch counts something
    with pytest.warns(UserWarning, match=r"count=lambda y: \(y != -100\)\.sum\(\).*gpipe\.losses"):
        pipe.step(x, labels, token_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.step(x, labels, token_loss)  # once per Pipe
    x, labels = _padded_batch(0)
    with pytest.raises(
        gpipe.NonFiniteError, match=r"micro-batch 1's targets are all below 0.*count="
    ):
        pipe.step(x, labels, token_loss)
