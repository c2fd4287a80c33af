"""Tests for gpipe.materialize: the reference is always build_full, the one-process build."""

from __future__ import annotations

import time
from itertools import pairwise

import pytest
import torch
from torch import nn

from gpipe.materialize import build, build_full, materialized_bytes
from gpipe.models import GPTConfig, convnet, gpt, mlp

SMALL_GPT = GPTConfig(vocab_size=32, context=8, d_model=16, n_heads=2, n_layers=3, dropout=0.1)

# name -> (factory, cuts of its layers into stages)
MODELS = {
    "gpt": (lambda: gpt(SMALL_GPT), [[0, 5], [0, 2, 5], [0, 1, 3, 4, 5]]),
    "convnet": (lambda: convnet(channels=4), [[0, 8], [0, 2, 8], [0, 3, 4, 6, 8]]),
    "mlp": (lambda: mlp([6, 7, 8, 9, 5]), [[0, 7], [0, 3, 7], [0, 1, 2, 5, 7]]),
}


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def assert_same(stage: nn.Module, reference: nn.Module) -> None:
    got, expected = state(stage), state(reference)
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("name", MODELS)
def test_every_cut_equals_the_one_process_build(name):
    factory, cuts = MODELS[name]
    reference = build_full(factory, seed=7)
    for cut in cuts:
        for start, stop in pairwise(cut):
            model = build(factory, seed=7, layers=range(start, stop))
            assert len(model) == len(reference)
            assert_same(model[start:stop], reference[start:stop])


def test_non_contiguous_layers_and_dtype():
    factory = MODELS["gpt"][0]
    reference = build_full(factory, seed=3, dtype=torch.float64)
    model = build(factory, seed=3, layers=[4, 1, 1], dtype=torch.float64)  # virtual stages
    assert model[1].qkv.weight.dtype == torch.float64
    for i in (1, 4):
        assert_same(model[i], reference[i])
    for i in (0, 2, 3):
        assert all(t.device.type == "meta" for t in state(model[i]).values())


def test_seeds_and_layers_get_different_weights():
    factory = MODELS["gpt"][0]
    a, b = build_full(factory, seed=0), build_full(factory, seed=1)
    assert not torch.equal(a[1].qkv.weight, b[1].qkv.weight)
    assert not torch.equal(a[1].qkv.weight, a[2].qkv.weight)  # same shape, own seed per layer
    assert_same(a, build_full(factory, seed=0))  # and the same seed gives the same model


def test_non_local_layers_hold_no_memory():
    factory = MODELS["gpt"][0]
    full = build_full(factory, seed=0)
    model = build(factory, seed=0, layers=range(1, 3))
    assert materialized_bytes(model) == materialized_bytes(full[1:3])
    assert materialized_bytes(model) < materialized_bytes(full)
    assert model[0].token.weight.is_meta and model[4].out.weight.is_meta
    assert [name for name, _ in model.named_children()] == [str(i) for i in range(5)]


def test_a_model_too_big_to_build_builds_its_slice():
    # 400 linear layers of 2048 x 2048: 6.7 GB in float32, one of them 16 MB.
    widths = [2048] * 401
    start = time.perf_counter()
    model = build(lambda: mlp(widths), seed=0, layers=range(400, 403))  # Linear, GELU, Linear
    assert time.perf_counter() - start < 5
    assert materialized_bytes(model) == 2 * (2048 * 2048 + 2048) * 4
    assert sum(p.numel() for p in model.parameters()) * 4 > 6e9  # the whole model, on meta
    x = torch.randn(2, 2048)
    assert torch.isfinite(model[400:403](x)).all()


def test_local_layers_run_forward():
    model = build(MODELS["gpt"][0], seed=0, layers=range(0, 2)).eval()
    hidden = model[0:2](torch.randint(0, 32, (2, 8)))
    assert hidden.shape == (2, 8, 16) and torch.isfinite(hidden).all()


def test_batch_norm_buffers_are_reset():
    model = build(MODELS["convnet"][0], seed=0, layers=[1])
    bn = model[1]
    assert torch.equal(bn.running_mean, torch.zeros(4))
    assert torch.equal(bn.running_var, torch.ones(4))
    assert bn.num_batches_tracked.item() == 0


def test_global_rng_state_is_unchanged():
    before = torch.get_rng_state()
    build_full(MODELS["convnet"][0], seed=5)
    assert torch.equal(torch.get_rng_state(), before)


class Scaled(nn.Module):
    """Initializes nothing of its own: no reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("inv_freq", torch.arange(4.0))
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool))
        self.offset = torch.zeros(4)  # a plain attribute, left on meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_what_no_reset_initializes_is_named():
    with pytest.raises(ValueError) as info:
        build(lambda: nn.Sequential(nn.Linear(4, 4), Scaled()), seed=0)
    message = str(info.value)
    for line in (
        "1.scale (a Parameter of Scaled) was not initialized",
        "1.inv_freq (a buffer of Scaled) was not initialized",
        "1.mask (a buffer of Scaled) was not initialized",
        "1.offset (a plain tensor attribute of Scaled) is still on meta",
        "give that module a reset_parameters() that initializes it, "
        "or build the model without meta (one process)",
    ):
        assert line in message
    assert "0.weight" not in message
    build(lambda: nn.Sequential(nn.Linear(4, 4), Scaled()), seed=0, layers=[0])  # not local: fine


class ScaledWithReset(Scaled):
    def __init__(self) -> None:
        super().__init__()
        del self.offset

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)
        self.inv_freq.copy_(torch.arange(4.0))
        self.mask.fill_(True)


def test_a_module_with_its_own_reset_builds_and_runs():
    model = build(lambda: nn.Sequential(nn.Linear(4, 4), ScaledWithReset()), seed=0)
    assert torch.equal(model[1].inv_freq, torch.arange(4.0)) and bool(model[1].mask.all())
    assert torch.isfinite(model(torch.randn(3, 4))).all()


class Block(nn.Module):
    """Its own reset_parameters overrides its child's: children must be reset first."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.proj.weight)


def test_children_are_reset_before_parents():
    model = build_full(lambda: nn.Sequential(Block()), seed=0)
    assert torch.equal(model[0].proj.weight, torch.zeros(4, 4))
    assert not torch.equal(model[0].proj.bias, torch.zeros(4))  # Linear's own default


def test_torch_attention_is_initialized():
    # MultiheadAttention only has a private _reset_parameters; it also zeroes out_proj.bias.
    def factory() -> nn.Sequential:
        return nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))

    model = build_full(factory, seed=0)
    attention = model[0].self_attn
    assert torch.equal(attention.out_proj.bias, torch.zeros(8))
    assert torch.isfinite(model(torch.randn(2, 3, 8))).all()


def tied() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    return model


def test_ties_survive_within_the_slice_and_are_rejected_across_the_cut():
    model = build_full(tied, seed=0)
    assert model[0].weight is model[2].weight
    assert materialized_bytes(model) == (16 + 4 + 4) * 4
    with pytest.raises(ValueError, match=r"tied across .*0\.weight = 2\.weight"):
        build(tied, seed=0, layers=range(0, 2))


def test_configuration_errors():
    with pytest.raises(TypeError, match=r"returned Linear, not an nn.Sequential.*nn.Sequential\("):
        build(lambda: nn.Linear(2, 2), seed=0)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match=r"0\.\.2 .*got \[3, -1\]"):
        build(lambda: mlp([2, 2, 2]), seed=0, layers=[0, 3, -1])
    with pytest.raises(ValueError, match=r"off the meta device.*0\.weight on cpu"):
        build(lambda: nn.Sequential(nn.Linear(2, 2, device="cpu")), seed=0)
    with pytest.raises(ValueError, match="meta"):
        build(lambda: mlp([2, 2]), seed=0, device="meta")
