"""One stage's F, B and W, driven by hand, against the plain model trained the ordinary way."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.engine.loss import LossSpec
from gpipe.engine.stage import Stage
from gpipe.models import GPTConfig, convnet, gpt, lm_loss
from reference import (
    assert_step_matches,
    even_balance,
    reference_step,
    relative_error,
    running_stats_of_unsplit_batch,
    twin,
    worst_gradient_error,
)

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


def test_a_gradient_of_another_shape_is_refused_after_good_ones():
    first, _ = two_stages(model())
    for m in range(2):  # good micro-batches first: nothing learned lets a bad one through
        h, _ = first.forward(m, torch.randn(2, 6, requires_grad=True), seed=SEED, remat=False)
        assert first.backward(m, [torch.ones_like(h)])[0].shape == (2, 6)
    for bad in (torch.ones(1, 16), torch.ones(2, 8), torch.ones(2, 16, dtype=torch.complex64)):
        first.forward(2, torch.randn(2, 6, requires_grad=True), seed=SEED, remat=False)
        # (1, 16) broadcasts: autograd's engine alone would sum it into a wrong gradient
        with pytest.raises(RuntimeError, match=r"gradient of shape .* root 0 of shape \(2, 16\)"):
            first.backward(2, [bad])


def test_stages_called_under_no_grad_give_the_plain_gradients():
    plain = model().train()
    staged = twin(plain)
    x, y = torch.randn(10, 6), torch.randint(0, 4, (10,))
    reference_step(plain, x, y, F.cross_entropy, chunks=CHUNKS, seed=SEED)
    with torch.no_grad():  # F and B switch autograd on for themselves
        by_hand(*two_stages(staged), x, y, remat=False, split=False)
    worst, name = worst_gradient_error(staged, plain)
    assert worst < 1e-6, name


def test_clear_forgets_every_pending_micro_batch():
    first, _ = two_stages(model())
    for m in range(2):
        first.forward(m, torch.randn(2, 6, requires_grad=True), seed=SEED, remat=True)
    assert first.pending == [0, 1]
    first.clear()
    assert first.pending == []


# -- checkpoint_layers: a re-materialized backward recomputes a few layers at a time ---------

LAYERED_CASES = [
    # (schedule, devices, virtual stages, chunks)
    ("gpipe", 1, 1, 3),
    ("gpipe", 2, 1, 4),
    ("1f1b", 2, 1, 4),
    ("interleaved-1f1b", 2, 2, 4),
    ("zb-h1", 2, 1, 4),
    ("zb-v", 2, 2, 4),
    ("dualpipe-v", 2, 2, 5),
]
GRANULARITIES = [("always", 1), ("always", 2), ("except_last", 1)]


def layered_case(name: str):
    """float64; the GPT has dropout (replayed masks), the CNN plain batch norm."""
    torch.manual_seed(1)
    if name == "gpt":
        model = gpt(GPTConfig(vocab_size=32, context=8, d_model=16, n_heads=2, n_layers=4))
        x, y, loss_fn = torch.randint(0, 32, (12, 8)), torch.randint(0, 32, (12, 8)), lm_loss
    else:
        model = convnet(channels=4, blocks=2)
        x, y = torch.randn(12, 1, 6, 6, dtype=torch.float64), torch.randint(0, 10, (12,))
        loss_fn = F.cross_entropy
    return model.double().train(), x, y, loss_fn


@pytest.mark.parametrize(("checkpoint", "per"), GRANULARITIES)
@pytest.mark.parametrize(("schedule", "devices", "virtual", "chunks"), LAYERED_CASES)
@pytest.mark.parametrize("name", ["gpt", "cnn", "cnn-deferred"])
def test_recomputing_by_layers_equals_the_unsplit_model(
    name, schedule, devices, virtual, chunks, checkpoint, per
):
    """Every parameter's gradient, the loss and the batch norms' running statistics."""
    model, x, y, loss_fn = layered_case(name.removesuffix("-deferred"))
    reference, initial = twin(model), twin(model)
    pipe = gpipe.Pipe(
        model,
        balance=even_balance(len(model), devices * virtual),
        devices=["cpu"] * devices,
        chunks=chunks,
        checkpoint=checkpoint,
        checkpoint_layers=per,
        schedule=schedule,
        virtual_stages=virtual,
        deferred_batch_norm=name == "cnn-deferred",
    )
    assert_step_matches(pipe, reference, x, y, loss_fn, chunks=chunks, seed=99)
    state = pipe.state_dict()
    if name == "cnn-deferred":  # once per mini-batch, as the un-split model
        stats = running_stats_of_unsplit_batch(initial, x, chunks)
    else:  # plain batch norm: once per micro-batch, as gradient accumulation
        stats = {k: v for k, v in reference.state_dict().items() if "running" in k}
    assert bool(stats) == name.startswith("cnn")
    for key, value in stats.items():
        assert relative_error(state[key], value) <= 1e-10, key
    assert all(not stage.pending for stage in pipe.stages)


def deep_mlp(layers: int = 8, width: int = 64) -> nn.Sequential:
    """Layers that save 9 times their input: the input, and the hidden 4x twice."""
    torch.manual_seed(0)
    body = [
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        for _ in range(layers)
    ]
    return nn.Sequential(*body, nn.Linear(width, 4))


def test_recomputing_by_layers_holds_one_layer_at_a_time():
    """Measured by the activation meter: the whole stage's saved tensors at once, against
    the kept layer inputs and one layer's saved tensors."""
    x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
    peaks = {}
    for per in (None, 1):
        pipe = gpipe.Pipe(deep_mlp(), chunks=2, checkpoint="always", checkpoint_layers=per)
        with gpipe.measure_activations(pipe) as meter:
            pipe.step(x, y, F.cross_entropy)
        peaks[per] = meter.peak_bytes[0]
    micro = 16 * 64 * 4  # one micro-batch's input of one layer
    assert peaks[None] >= 8 * 9 * micro
    # the 9 layers' inputs kept, one layer's saved tensors (9), the loss's (< 1)
    assert peaks[1] <= (9 + 9 + 1) * micro


class WritesInput(nn.Module):
    """Subtracts its mean in place: the kept group input must not change."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sub_(x.mean())


@pytest.mark.parametrize("per", [1, 2])
def test_a_layer_that_writes_its_input_in_place_recomputes_from_the_kept_input(per):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), WritesInput(), nn.ReLU(inplace=True), nn.Linear(8, 8),
        nn.Dropout(0.2), WritesInput(), nn.Linear(8, 3),
    ).double()  # fmt: skip
    reference = twin(model)
    x, y = torch.randn(9, 6, dtype=torch.float64), torch.randint(0, 3, (9,))
    pipe = gpipe.Pipe(model, chunks=3, checkpoint="always", checkpoint_layers=per)
    for step in range(2):  # the second knows which groups write their input
        pipe.step(x, y, F.cross_entropy, seed=step)
        reference_step(reference, x, y, F.cross_entropy, chunks=3, seed=step)
        worst, where = worst_gradient_error(pipe, reference)
        assert worst <= 1e-10, (step, where)
        pipe.zero_grad()
        reference.zero_grad()


class Counter(nn.Module):
    """A buffer its forward writes, and a moving average it reads and writes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(width, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        with torch.no_grad():
            self.mean.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x * self.calls - self.mean


@pytest.mark.parametrize("per", [1, 2])
def test_buffers_a_forward_writes_are_restored_for_each_group(per):
    """Each group recomputes from the buffers its first forward found, and every
    micro-batch writes them once, in order."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), Counter(8), nn.Tanh(), Counter(8),
        nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)), Counter(8), nn.Linear(8, 3),
    ).double()  # fmt: skip
    reference = twin(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    pipe = gpipe.Pipe(model, chunks=4, checkpoint="always", checkpoint_layers=per)
    for step in range(2):
        pipe.step(x, y, F.cross_entropy, seed=step)
        reference_step(reference, x, y, F.cross_entropy, chunks=4, seed=step)
        worst, where = worst_gradient_error(pipe, reference)
        assert worst <= 1e-10, (step, where)
        pipe.zero_grad()
        reference.zero_grad()
    theirs = reference.state_dict()
    for key, value in pipe.state_dict().items():
        assert relative_error(value, theirs[key]) <= 1e-10, key
    assert int(pipe.state_dict()["1.calls"]) == 2 * 4


# -- layers that write to their input --------------------------------------------------------


class Shift(nn.Module):
    """In-model preprocessing that changes its input in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sub_(0.5)


def in_place_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        Shift(),
        nn.Linear(6, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, 16),
        nn.Dropout(0.2),
        nn.ReLU(inplace=True),
        nn.Linear(16, 4),
    ).double()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[2, 3, 2], [2, 1, 4], [1, 4, 2]])  # ReLU(inplace) first
def test_layers_that_write_to_their_input_train_as_in_the_plain_model(
    schedule, checkpoint, balance
):
    plain = in_place_model()
    pipe = gpipe.Pipe(
        copy.deepcopy(plain), balance=balance, chunks=4, checkpoint=checkpoint, schedule=schedule
    )
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 4, (8,), generator=generator)
        caller = x.clone()
        loss = pipe.step(caller, y, F.cross_entropy, seed=step)
        assert torch.equal(caller, x)  # the caller's batch is not changed, let alone twice
        expected = reference_step(plain, x.clone(), y, F.cross_entropy, chunks=4, seed=step)
        assert relative_error(loss, expected) < 1e-10
        for (name, ours), theirs in zip(pipe.named_parameters(), plain.parameters(), strict=True):
            assert relative_error(ours.grad, theirs.grad) < 1e-10, (step, name)
            ours.grad, theirs.grad = None, None
