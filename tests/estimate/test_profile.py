"""Per-layer profile: shapes of the numbers, no side effects, and memory that matches a Pipe."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.estimate.memory_model import (
    Held,
    MemoryModel,
    StageMemoryTable,
    held_microbatches,
    stage_memory,
)
from gpipe.estimate.profile import LayerProfile, Profile
from gpipe.models import GPTConfig, convnet, gpt, lm_loss
from gpipe.schedule import build_schedule


@pytest.fixture(autouse=True)
def one_thread():
    """Timings on one thread: steadier on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_layer_is_measured_with_its_bytes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    prof = gpipe.profile(model, x, repeats=2, warmup=1)
    assert [layer.name for layer in prof.layers] == ["0 (Linear)", "1 (ReLU)", "2 (Linear)"]
    assert prof.batch_size == 5 and prof.device == "cpu"
    first, relu, last = prof.layers
    assert first.param_bytes == (8 * 16 + 16) * 4 and relu.param_bytes == 0
    assert [lay.input_bytes for lay in prof.layers] == [5 * 8 * 4, 5 * 16 * 4, 5 * 16 * 4]
    assert [lay.output_bytes for lay in prof.layers] == [5 * 16 * 4, 5 * 16 * 4, 5 * 4 * 4]
    # Linear saves its input; ReLU its output; nothing else.
    assert first.saved_bytes == first.saved_input_bytes == 5 * 8 * 4
    assert relu.saved_bytes == relu.saved_output_bytes == 5 * 16 * 4
    assert last.saved_bytes == last.saved_input_bytes == 5 * 16 * 4
    assert all(lay.inner_bytes == 0 for lay in prof.layers)
    for lay in prof.layers:
        assert lay.forward > 0 and lay.backward > 0
        assert lay.backward_input >= 0 and lay.backward_weight >= 0
    assert first.backward_input < first.backward  # the model's input needs no gradient
    assert "fwd ms" in prof.table()
    sizes = Profile.sizes_of(model)  # the same names and bytes, nothing run
    assert [(lay.name, lay.param_bytes) for lay in sizes.layers] == [
        (lay.name, lay.param_bytes) for lay in prof.layers
    ]
    assert sum(lay.forward + lay.saved_bytes for lay in sizes.layers) == 0


def test_profiling_leaves_the_model_and_generators_alone():
    torch.manual_seed(0)
    model = convnet(channels=4, blocks=1)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 1, 6, 6)
    rng_state = torch.get_rng_state()
    gpipe.profile(model, x, repeats=1, warmup=0)
    assert torch.equal(torch.get_rng_state(), rng_state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # running statistics too
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert all(p.grad is None for p in model[1:].parameters())


def test_loss_is_profiled_with_the_last_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 32))
    x, y = torch.randn(6, 4), torch.randint(0, 32, (6,))
    plain = gpipe.profile(model, x, repeats=1, warmup=0)
    with_loss = gpipe.profile(model, x, target=y, loss_fn=F.cross_entropy, repeats=1, warmup=0)
    # cross-entropy saves its log-softmax: one more logits-sized tensor
    assert with_loss.layers[1].saved_bytes >= plain.layers[1].saved_bytes + 6 * 32 * 4
    # ... which a split backward frees right after B: W starts at the Linear's weight
    assert with_loss.layers[1].freed_after_input_grad_bytes >= 6 * 32 * 4
    assert plain.layers[1].freed_after_input_grad_bytes == 0  # a Linear keeps what W needs
    assert with_loss.layers[0].freed_after_input_grad_bytes == 0  # no input gradient: no B
    with pytest.raises(ValueError, match="both target and loss_fn"):
        gpipe.profile(model, x, target=y)


def test_scaled_profile_is_linear_except_parameters():
    prof = Profile.from_costs([1.0, 2.0], param_bytes=[10, 20], activation_bytes=8, batch_size=4)
    double = prof.scaled(2)
    assert double.batch_size == 8
    layers = double.layers
    assert [lay.forward for lay in layers] == [2.0, 4.0]
    assert [lay.backward for lay in layers] == [4.0, 8.0]
    assert [lay.param_bytes for lay in layers] == [10, 20]
    assert [lay.output_bytes for lay in layers] == [16, 16]


def test_bad_arguments_are_reported():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        gpipe.profile(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(ValueError, match="repeats"):
        gpipe.profile(model, torch.randn(1, 2), repeats=0)
    with pytest.raises(ValueError, match="meta"):
        gpipe.profile(model, torch.randn(1, 2), device="meta")


CONFIG = GPTConfig(vocab_size=64, context=16, d_model=32, n_heads=2, n_layers=4)


@pytest.fixture(scope="module")
def gpt_case():
    torch.manual_seed(0)
    model = gpt(CONFIG)
    x, y = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
    prof = gpipe.profile(model, x[:2], target=y[:2], loss_fn=lm_loss, repeats=1, warmup=0)
    return model, x, y, prof


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_memory_model_matches_the_activations_a_pipe_stores(gpt_case, schedule, checkpoint):
    """Boundary inputs × held + inner activations × held, against the meter of a real step."""
    model, x, y, prof = gpt_case
    K, M, balance = 2, 4, [3, 3]
    held = held_microbatches(build_schedule(schedule, num_ranks=K, num_microbatches=M), checkpoint)
    predicted = [m.boundary + m.inner for m in stage_memory(prof, balance, held)]
    pipe = gpipe.Pipe(model, balance=balance, chunks=M, checkpoint=checkpoint, schedule=schedule)
    with gpipe.measure_activations(pipe) as meter:
        pipe.step(x, y, lm_loss)
    pipe.zero_grad(set_to_none=True)
    for measured, expected in zip(meter.peak_bytes, predicted, strict=True):
        assert measured == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("per", [1, 2])
def test_memory_model_matches_a_pipe_recomputing_a_few_layers_at_a_time(gpt_case, schedule, per):
    """checkpoint_layers: the kept group inputs and the largest group's activations."""
    _, x, y, _ = gpt_case
    K, M, balance = 2, 4, [4, 4]
    deep = gpt(GPTConfig(**{**CONFIG.__dict__, "n_layers": 6}))
    prof = gpipe.profile(deep, x[:2], target=y[:2], loss_fn=lm_loss, repeats=1, warmup=0)
    held = held_microbatches(build_schedule(schedule, num_ranks=K, num_microbatches=M), "always")
    stages = stage_memory(prof, balance, held, checkpoint_layers=per)
    whole = stage_memory(prof, balance, held)
    pipe = gpipe.Pipe(
        deep, balance=balance, chunks=M, checkpoint="always", checkpoint_layers=per,
        schedule=schedule,
    )  # fmt: skip
    with gpipe.measure_activations(pipe) as meter:
        pipe.step(x, y, lm_loss)
    for measured, expected, stage in zip(meter.peak_bytes, stages, whole, strict=True):
        assert measured == pytest.approx(expected.boundary + expected.inner, rel=0.02)
        assert expected.inner < stage.inner


def test_recomputing_by_groups_is_the_largest_group_and_the_kept_inputs_by_hand():
    """Layers of different sizes: every stage and group size against the sum written out."""
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 50, (11, 4), generator=generator).tolist()
    layers = [
        LayerProfile(f"{i}", 0, 0, 0, 0, 0, 0, input_bytes=a, output_bytes=a,
                     saved_bytes=b + c + d, saved_input_bytes=c, saved_output_bytes=d)
        for i, (a, b, c, d) in enumerate(sizes)
    ]  # fmt: skip
    whole = StageMemoryTable(layers, [Held(1, 1, 0, 0, 1)], MemoryModel())
    for g in (1, 2, 3, 5):
        table = StageMemoryTable(layers, [Held(1, 1, 0, 0, 1)], MemoryModel(), checkpoint_layers=g)
        for i in range(len(layers)):
            for j in range(i + 1, len(layers) + 1):
                starts = list(range(i, j, g))
                kept = sum(layers[start].input_bytes for start in starts[1:])
                largest = max(whole._inner(a, min(a + g, j)) for a in starts)
                assert table(0, i, j).inner == kept + largest, (g, i, j)
    split = StageMemoryTable(
        layers, [Held(1, 1, 0, 0, 1)], MemoryModel(), splits_backward=True, checkpoint_layers=1
    )
    assert split(0, 2, 9).inner == whole(0, 2, 9).inner  # W needs the whole stage's graph


def test_a_layer_that_writes_its_input_is_profiled_as_its_out_of_place_twin():
    """``ReLU(inplace=True)`` runs on a copy, as a stage runs it: the same saved bytes and
    their split into input and output as ``ReLU()``; autograd refused it before."""

    def model(inplace: bool) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=inplace), nn.Linear(8, 3))

    x = torch.randn(4, 6)
    written, plain = gpipe.profile(model(True), x), gpipe.profile(model(False), x)
    fields = ("saved_bytes", "saved_input_bytes", "saved_output_bytes", "input_bytes",
              "output_bytes", "param_bytes")  # fmt: skip
    for a, b in zip(written.layers, plain.layers, strict=True):
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields], a.name
