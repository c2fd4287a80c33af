"""Stored activations per stage, measured with saved-tensor hooks."""

from __future__ import annotations

import torch
from torch import nn

import gpipe
from gpipe.engine.memory import ActivationMeter
from gpipe.models import GPTConfig, gpt, lm_loss

K, M, BATCH, T = 2, 8, 16, 32
CONFIG = GPTConfig(vocab_size=64, context=T, d_model=32, n_heads=4, n_layers=4, dropout=0.1)


def measure(checkpoint: str, chunks: int = M, schedule: str = "gpipe") -> list[int]:
    torch.manual_seed(0)
    pipe = gpipe.Pipe(
        gpt(CONFIG), balance=[3, 3], chunks=chunks, checkpoint=checkpoint, schedule=schedule
    )
    x = torch.randint(0, 64, (BATCH, T))
    with gpipe.measure_activations(pipe) as meter:
        pipe.step(x, x, lm_loss)
    assert meter.live_bytes == [0, 0], "everything stored must be freed after the step"
    return meter.peak_bytes


def test_meter_counts_storage_once_and_skips_parameters():
    layer = nn.Linear(4, 4)
    meter = ActivationMeter(1, layer.parameters())
    x = torch.randn(3, 4, requires_grad=True)
    with meter.saved_tensors(0):
        y = layer(x)
        z = (y * y).sum()  # y saved twice by mul: one storage
    assert meter.live_bytes[0] == x.nbytes + y.nbytes
    z.backward()
    del y, z
    assert meter.live_bytes[0] == 0


def test_rematerialization_keeps_only_boundary_inputs():
    never, except_last, always = measure("never"), measure("except_last"), measure("always")
    hidden = BATCH // M * T * CONFIG.d_model * 4  # one micro-batch's boundary input, float32
    ids = BATCH // M * T * 8  # stage 0's input: int64 token ids
    # One micro-batch's inner activations, measured without pipelining (M = 1, no remat).
    one = [b / BATCH * (BATCH // M) for b in measure("never", chunks=1)]
    for stage, boundary in enumerate([ids, hidden]):
        assert always[stage] < never[stage] / 3
        # M boundary inputs + inner activations of one micro-batch during its backward.
        assert always[stage] <= M * boundary + one[stage] * 1.1
        assert except_last[stage] <= M * boundary + one[stage] * 1.1
        assert never[stage] >= M * one[stage] * 0.9


def test_one_f_one_b_holds_fewer_microbatches_than_gpipe():
    """M = 4K, no re-materialization: 1F1B keeps at most K micro-batches live per stage."""
    fill_drain, one_f_one_b, zero_bubble = (
        measure("never", schedule=name) for name in ("gpipe", "1f1b", "zb-h1")
    )
    one = [b / M for b in measure("never", chunks=1)]  # one micro-batch's activations
    for stage in range(K):
        assert one_f_one_b[stage] < fill_drain[stage] / 2
        assert one_f_one_b[stage] <= (K - stage) * one[stage] * 1.1
        assert zero_bubble[stage] <= K * one[stage] * 1.1


def test_meter_does_not_change_gradients_nor_leak_with_retained_graphs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Sigmoid())
    x = torch.randn(3, 4, requires_grad=True)
    expected = torch.autograd.grad(model(x).exp().sum(), [x, *model.parameters()])
    meter = ActivationMeter(1, model.parameters())
    with meter.saved_tensors(0):
        y = model(x).exp().sum()  # tanh, sigmoid and exp save their outputs
    got = torch.autograd.grad(y, [x, *model.parameters()], retain_graph=True)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    del y
    assert meter.live_bytes == [0]


def test_zero_bubble_frees_everything_after_the_step():
    assert len(measure("always", schedule="zb-h1")) == K  # measure() checks live == 0
