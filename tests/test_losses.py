"""``gpipe.losses``: what a loss's reduction tells ``Pipe.step``, and a mixture of experts'
auxiliary loss, each against the plain model's whole-batch step in float64, per parameter.

Before: a sum-reduced ``nn`` loss gave 1/M of the gradient, class-weighted cross-entropy
8e-2 off, an ``ignore_index`` other than -100 0.14 off with no warning, and a MoE trained by
``causal_lm()`` without its load-balancing loss (gradients 1.0 off)."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import captured_models
import gpipe
from reference import relative_error

CLASSES = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CLASSES)
    ).double()


def _batch(ignore: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (12,), generator=g)
    y[:3] = 0  # the first micro-batch holds one class only: weights and counts differ
    if ignore is not None:
        y[[1, 2, 7]] = ignore
    return x, y


def _assert_whole_batch_step(loss_fn, *, ignore: int | None = None, **step) -> None:
    plain = _model()
    pipe = gpipe.Pipe(copy.deepcopy(plain), balance=[2, 3], chunks=4)
    x, y = _batch(ignore)
    expected = loss_fn(plain(x), y)
    expected.backward()
    loss = pipe.step(x, y, loss_fn, **step)
    assert relative_error(loss, expected.detach()) < 1e-10
    ours = dict(pipe.named_parameters())
    for name, theirs in plain.named_parameters():
        assert relative_error(ours[name].grad, theirs.grad) < 1e-10, name


WEIGHT = torch.tensor([0.2, 1.0, 3.0, 0.5], dtype=torch.float64)
READ_OFF = {
    "sum": nn.CrossEntropyLoss(reduction="sum"),
    "class-weights": nn.CrossEntropyLoss(weight=WEIGHT),
    "weights-and-ignore": nn.CrossEntropyLoss(weight=WEIGHT, ignore_index=2),
    "ignore-index": nn.CrossEntropyLoss(ignore_index=-1),
    "nll-ignore-index": nn.Sequential(nn.LogSoftmax(-1), nn.NLLLoss(ignore_index=3)),
    "partial": functools.partial(F.cross_entropy, weight=WEIGHT, ignore_index=-7),
    "label-smoothing": nn.CrossEntropyLoss(weight=WEIGHT, label_smoothing=0.1),
    "mse-sum": nn.MSELoss(reduction="sum"),
}


@pytest.mark.parametrize("name", list(READ_OFF))
def test_a_loss_that_shows_its_reduction_is_exact_without_count(name):
    loss_fn = READ_OFF[name]
    ignore = {"ignore-index": -1, "nll-ignore-index": 3, "partial": -7, "weights-and-ignore": 2}
    if isinstance(loss_fn, nn.Sequential):  # log-softmax then NLL: read the NLL's settings
        loss_fn = _LogSoftmaxThen(loss_fn[1])
    if name == "mse-sum":
        loss_fn = _OneHot(loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: gpipe read what it needs
        _assert_whole_batch_step(loss_fn, ignore=ignore.get(name))


class _LogSoftmaxThen(nn.NLLLoss):
    """An ``nn.NLLLoss`` (its settings shown) over log-probabilities it takes itself."""

    def __init__(self, nll: nn.NLLLoss) -> None:
        super().__init__(ignore_index=nll.ignore_index)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(logits.log_softmax(-1), target)


class _OneHot(nn.MSELoss):
    def __init__(self, mse: nn.MSELoss) -> None:
        super().__init__(reduction=mse.reduction)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(logits, F.one_hot(target, CLASSES).double())


def test_a_contradicting_reduction_or_count_is_refused():
    x, y = _batch()
    pipe = gpipe.Pipe(_model(), balance=[2, 3], chunks=4)
    with pytest.raises(ValueError, match=r"reduces by 'sum'.*reduction='mean'"):
        pipe.step(x, y, nn.CrossEntropyLoss(reduction="sum"), reduction="mean")
    with pytest.raises(ValueError, match=r"reduces by 'none'"):
        pipe.step(x, y, nn.CrossEntropyLoss(reduction="none"))
    with pytest.raises(ValueError, match=r"counts its own tokens.*drop step\(\)'s count="):
        labels = torch.zeros(12, 3, dtype=torch.long)
        pipe.step(x, labels, gpipe.losses.causal_lm(), count=lambda t: (t != -100).sum())


def test_an_unseen_ignore_index_below_zero_warns_with_the_recipe():
    """A loss gpipe cannot see into: any negative label is an ignore index."""
    pipe = gpipe.Pipe(_model(), balance=[2, 3], chunks=4)
    x, y = _batch(ignore=-1)

    def loss_fn(out, target):
        return F.cross_entropy(out, target, ignore_index=-1)

    with pytest.warns(UserWarning, match=r"labels below 0.*count=lambda y: \(y != -100\)"):
        pipe.step(x, y, loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.step(x, y, loss_fn, count=lambda t: (t != -1).sum())  # declared: exact, silent


# -- a mixture of experts' load-balancing loss ----------------------------------------------


def _moe(family: str) -> nn.Module:
    transformers = captured_models.transformers
    torch.manual_seed(0)
    common = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2,
        max_position_embeddings=32, output_router_logits=True, router_aux_loss_coef=0.3,
        experts_implementation="batched_mm",  # export-able (grouped_mm: no float64 on CPU)
    )  # fmt: skip
    if family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, **common)
        return transformers.MixtralForCausalLM(config).double()
    config = transformers.Qwen2MoeConfig(
        num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=16, **common
    )
    return transformers.Qwen2MoeForCausalLM(config).double()


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (8, 8), generator=g)
    labels = ids.clone()
    labels[1, 5:] = -100
    return ids, labels


@pytest.mark.skipif(captured_models.transformers is None, reason="needs transformers")
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_causal_lm_gives_a_mixture_of_experts_its_own_loss(family):
    """With chunks=1 the model's own loss, load balancing included, exactly; with chunks=2
    what gradient accumulation gives (the load-balancing loss is a product of means over all
    tokens), said once in a warning; no coefficient: refused, never dropped."""
    plain = _moe(family)
    ids, labels = _tokens()
    loss_fn = gpipe.losses.causal_lm(aux_loss_coef=plain.config.router_aux_loss_coef)
    own = plain(input_ids=ids, labels=labels).loss  # its aux loss is float32, in any dtype
    expected = loss_fn(plain(input_ids=ids), labels)
    assert relative_error(expected.detach(), own.detach()) < 1e-6
    expected.backward()
    # One capture (an export per mode, most of the time here) for both Pipes; each gets a copy.
    captured = gpipe.frontend.capture(copy.deepcopy(plain), (ids[:2],))
    pipe = gpipe.Pipe(copy.deepcopy(captured), tied=captured.tied, balance=[2, 2])
    with pytest.raises(ValueError, match=r"carries aux_loss.*causal_lm\(aux_loss_coef="):
        pipe.step(ids, labels, gpipe.losses.causal_lm())
    loss = pipe.step(ids, labels, loss_fn)
    assert relative_error(loss, expected.detach()) < 1e-10
    ours = dict(pipe.named_parameters())
    for name, theirs in plain.named_parameters():
        assert relative_error(ours[name].grad, theirs.grad) < 1e-10, name

    plain.zero_grad()
    total = loss_fn.count(labels)
    for ids_m, labels_m in zip(ids.tensor_split(2), labels.tensor_split(2), strict=True):
        (loss_fn(plain(input_ids=ids_m), labels_m) * loss_fn.count(labels_m) / total).backward()
    pipe = gpipe.Pipe(captured, tied=captured.tied, balance=[2, 2], chunks=2)
    with pytest.warns(UserWarning, match=r"chunks=2 the auxiliary loss.*exact with chunks=1"):
        pipe.step(ids, labels, loss_fn)
    ours = dict(pipe.named_parameters())
    for name, theirs in plain.named_parameters():
        assert relative_error(ours[name].grad, theirs.grad) < 1e-10, name
