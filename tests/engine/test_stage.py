"""One stage's F, B and W, driven by hand, against the plain model trained the ordinary way."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe.engine.stage import LossSpec, Stage
from reference import reference_step, twin, worst_gradient_error

CHUNKS, SEED = 3, 1234


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.GELU(), nn.Dropout(0.3), nn.LayerNorm(16), nn.Linear(16, 4)
    )


def two_stages(plain: nn.Sequential, cut: int = 3) -> tuple[Stage, Stage]:
    cpu = torch.device("cpu")
    first = Stage(0, list(plain)[:cut], first_layer=0, device=cpu, is_last=False)
    last = Stage(1, list(plain)[cut:], first_layer=cut, device=cpu, is_last=True)
    return first, last


def by_hand(first: Stage, last: Stage, x, y, *, remat: bool, split: bool) -> None:
    """GPipe's order: every F, then every B (last stage first), then every W."""
    xs, ys = torch.tensor_split(x, CHUNKS), torch.tensor_split(y, CHUNKS)
    for m, (x_m, y_m) in enumerate(zip(xs, ys, strict=True)):
        h, _ = first.forward(m, x_m, seed=SEED, remat=remat)
        loss = LossSpec(F.cross_entropy, y_m, weight=len(x_m) / len(x))
        last.forward(m, h, seed=SEED, remat=remat, loss=loss)
    for m in reversed(range(CHUNKS)):
        grad_inputs = last.backward(m, None, split=split)
        first.backward(m, grad_inputs, split=split)
    if split:
        for m in range(CHUNKS):
            last.backward_weight(m)
            first.backward_weight(m)
    assert first.pending == last.pending == []


@pytest.mark.parametrize("remat", [False, True], ids=["stored", "remat"])
@pytest.mark.parametrize("split", [False, True], ids=["whole-B", "split-B-then-W"])
def test_stages_by_hand_give_the_plain_gradients(remat, split):
    plain = model().train()
    staged = twin(plain)
    x, y = torch.randn(10, 6), torch.randint(0, 4, (10,))
    reference_step(plain, x, y, F.cross_entropy, chunks=CHUNKS, seed=SEED)
    by_hand(*two_stages(staged), x, y, remat=remat, split=split)
    worst, name = worst_gradient_error(staged, plain)
    assert worst < 1e-6, name


def test_a_first_stage_input_without_grad_gets_no_gradient_and_the_output_needs_one():
    first, _ = two_stages(model())
    out, loss = first.forward(0, torch.randn(2, 6), seed=SEED, remat=True)
    assert loss is None and out.requires_grad and out.grad_fn is None  # a leaf for stage 1
    assert first.backward(0, [torch.ones_like(out)]) == [None]


def test_inference_keeps_nothing():
    first, _ = two_stages(model())
    out, _ = first.forward(0, torch.randn(2, 6), seed=SEED, remat=False, keep=False)
    assert not out.requires_grad and first.pending == []


def test_misordered_actions_are_clear_errors():
    first, last = two_stages(model())
    with pytest.raises(RuntimeError, match="no stored forward of micro-batch 0"):
        first.backward(0, [torch.ones(2, 16)])
    with pytest.raises(RuntimeError, match="no split backward of micro-batch 1"):
        first.backward_weight(1)
    spec = LossSpec(F.cross_entropy, torch.zeros(2, dtype=torch.int64), weight=1.0)
    with pytest.raises(RuntimeError, match="stage 0 is not the last stage"):
        first.forward(0, torch.randn(2, 6), seed=SEED, remat=False, loss=spec)
    h, _ = first.forward(0, torch.randn(2, 6), seed=SEED, remat=False)
    with pytest.raises(RuntimeError, match=r"produced 1 output tensors .* received 2 gradients"):
        first.backward(0, [torch.ones(2, 16), torch.ones(2, 16)])
    per_sample = LossSpec(lambda out, t: F.cross_entropy(out, t, reduction="none"), spec.target, 1)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor, got \(2,\)"):
        last.forward(0, h, seed=SEED, remat=False, loss=per_sample)


def test_clear_forgets_every_pending_micro_batch():
    first, _ = two_stages(model())
    for m in range(2):
        first.forward(m, torch.randn(2, 6, requires_grad=True), seed=SEED, remat=True)
    assert first.pending == [0, 1]
    first.clear()
    assert first.pending == []
