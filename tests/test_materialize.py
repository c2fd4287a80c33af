"""Tests for gpipe.materialize: the reference is eager construction, ``torch.manual_seed(s);
factory()``, and every cut of :func:`build` must hold its very tensors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from itertools import pairwise

import pytest
import torch
from torch import nn

from gpipe.materialize import build, materialized_bytes
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


def eager(factory, seed: int) -> nn.Sequential:
    """The non-pipelined reference."""
    torch.manual_seed(seed)
    return factory()


def assert_cut_is_eager(factory, cut, seed: int = 7, reference=None, **options) -> nn.Sequential:
    """``build`` of ``cut`` holds eager construction's local tensors; the others are on meta."""
    reference = eager(factory, seed) if reference is None else reference
    model = build(factory, seed=seed, layers=cut, **options)
    assert len(model) == len(reference)
    for i, (layer, expected) in enumerate(zip(model, reference, strict=True)):
        if i in cut:
            assert_same(layer, expected)
        else:
            assert all(t.is_meta for t in state(layer).values()), i
    return model


@pytest.mark.parametrize("name", MODELS)
def test_every_cut_equals_eager_construction(name):
    factory, cuts = MODELS[name]
    reference = eager(factory, 7)
    assert_same(build(factory, seed=7), reference)
    for cut in cuts:
        for start, stop in pairwise(cut):
            assert_cut_is_eager(factory, range(start, stop), reference=reference)
    assert_cut_is_eager(factory, [1, 4], reference=reference)  # not contiguous


def test_non_contiguous_layers_and_dtype():
    factory = MODELS["gpt"][0]
    reference = eager(factory, 3).double()  # built in the factory's dtype, then cast
    assert_same(build(factory, seed=3, dtype=torch.float64), reference)
    model = build(factory, seed=3, layers=[4, 1, 1], dtype=torch.float64)  # virtual stages
    assert model[1].qkv.weight.dtype == torch.float64
    for i in (1, 4):
        assert_same(model[i], reference[i])
    for i in (0, 2, 3):
        assert all(t.device.type == "meta" for t in state(model[i]).values())


def test_seeds_and_layers_get_different_weights():
    factory = MODELS["gpt"][0]
    a, b = build(factory, seed=0), build(factory, seed=1)
    assert not torch.equal(a[1].qkv.weight, b[1].qkv.weight)
    assert not torch.equal(a[1].qkv.weight, a[2].qkv.weight)  # same shape, own seed per layer
    assert_same(a, build(factory, seed=0))  # and the same seed gives the same model


def test_non_local_layers_hold_no_memory():
    factory = MODELS["gpt"][0]
    full = build(factory, seed=0)
    model = build(factory, seed=0, layers=range(1, 3))
    assert materialized_bytes(model) == materialized_bytes(full[1:3])
    assert materialized_bytes(model) < materialized_bytes(full)
    assert model[0].token.weight.is_meta and model[4].out.weight.is_meta
    assert [name for name, _ in model.named_children()] == [str(i) for i in range(5)]


def test_a_model_too_big_to_build_builds_its_slice():
    # 400 linear layers of 2048 x 2048: 6.7 GB in float32, one of them 16 MB. The first layers:
    # a later slice replays every earlier draw, as eager construction makes them (seconds on a
    # CPU; see test_a_late_slice_allocates_its_layers_and_one_scratch_tensor).
    widths = [2048] * 401
    build(lambda: mlp([8] * 3), seed=0, layers=range(0, 1))  # the recorder's first-use cost
    # CPU time, which other processes' load changes little (both sides run on this thread).
    start = time.process_time()
    mlp([2048] * 51)  # the baseline: an eighth of the model, built eagerly (4x the slice's)
    eighth = time.process_time() - start
    start = time.process_time()
    model = build(lambda: mlp(widths), seed=0, layers=range(0, 3))  # Linear, GELU, Linear
    assert time.process_time() - start < eighth  # neither the whole model nor its draws
    assert materialized_bytes(model) == 2 * (2048 * 2048 + 2048) * 4
    assert sum(p.numel() for p in model.parameters()) * 4 > 6e9  # the whole model, on meta
    x = torch.randn(2, 2048)
    assert torch.isfinite(model[0:3](x)).all()


@pytest.mark.slow
def test_a_late_slice_allocates_its_layers_and_one_scratch_tensor():
    # 20 linear layers of 2048 x 2048 (320 MB). The last one is built after every draw of the
    # others, each made into a scratch tensor (16 MB) freed at once; the peak resident memory
    # of a fresh process shows it.
    code = """
        import resource
        from gpipe.materialize import build, materialized_bytes
        from gpipe.models import mlp

        build(lambda: mlp([8, 8, 8]), seed=0, layers=[2])  # warm up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        model = build(lambda: mlp([2048] * 21), seed=0, layers=[38])
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(grown * 1024, materialized_bytes(model))
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    grown, local = map(int, result.stdout.split())
    tensor = 2048 * 2048 * 4
    assert local == tensor + 2048 * 4
    assert grown < local + 2 * tensor  # the layer, a scratch tensor, slack; not 320 MB


def test_local_layers_run_forward():
    model = build(MODELS["gpt"][0], seed=0, layers=range(0, 2)).eval()
    hidden = model[0:2](torch.randint(0, 32, (2, 8)))
    assert hidden.shape == (2, 8, 16) and torch.isfinite(hidden).all()


def test_batch_norm_buffers_are_built():
    model = build(MODELS["convnet"][0], seed=0, layers=[1])
    bn = model[1]
    assert torch.equal(bn.running_mean, torch.zeros(4))
    assert torch.equal(bn.running_var, torch.ones(4))
    assert bn.num_batches_tracked.item() == 0


def test_global_rng_state_is_unchanged():
    torch.manual_seed(99)
    before = torch.get_rng_state()
    build(MODELS["convnet"][0], seed=5)
    build(nn_init_zoo, seed=5, layers=[3])  # reseeds and restores inside
    assert torch.equal(torch.get_rng_state(), before)


class Scaled(nn.Module):
    """Initializes nothing in a reset_parameters(): every tensor is made in __init__."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))
        self.mix = nn.Parameter(torch.randn(n, n) * 0.1)
        self.register_buffer("causal", torch.tril(torch.ones(n, n, dtype=torch.bool)))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, n, 2.0) / n))
        self.register_buffer("table", torch.tensor([1.0, 2.0, 3.0, 4.0][:n]), persistent=False)
        self.offset = torch.zeros(n) + torch.rand(n)  # a plain attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.mix) * self.scale + self.offset


def scaled_model() -> nn.Sequential:
    return nn.Sequential(Scaled(), nn.Linear(4, 4), Scaled(), nn.GELU(), Scaled(), nn.Linear(4, 4))


def test_parameters_and_buffers_made_in_init_are_built_as_eager():
    # The old contract (reset_parameters() only) rejected every tensor of Scaled.
    reference = eager(scaled_model, 11)
    for cut in (range(0, 2), range(2, 5), [1, 4], [0]):
        model = assert_cut_is_eager(scaled_model, cut, seed=11, reference=reference)
        for i in cut:
            if isinstance(reference[i], Scaled):
                assert torch.equal(model[i].offset, reference[i].offset)
    assert model[2].offset.is_meta  # plain attributes of other layers stay on meta
    assert torch.equal(reference[0].scale, torch.ones(4)) and bool(reference[0].causal[1, 0])
    assert torch.isfinite(build(scaled_model, seed=0)(torch.randn(3, 4))).all()


def hf_style() -> nn.Sequential:
    """Construction, then an HF-style _init_weights over every module."""
    model = gpt(SMALL_GPT)

    def init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
        if isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(1.0)

    model.apply(init_weights)
    return model


def test_a_factory_s_own_init_is_kept():
    reference = eager(hf_style, 5)
    for cut in (range(0, 2), range(2, 5), [1, 4]):
        assert_cut_is_eager(hf_style, cut, seed=5, reference=reference)
    embedding = build(hf_style, seed=5, layers=[0])[0].token.weight
    assert abs(embedding.std().item() - 0.02) < 0.002  # the bug: 1.03, nn.Embedding's default


class Probed(nn.Module):
    """Runs a forward through dropout in __init__ (to size its head): it draws at construction."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5))
        self.head = nn.Linear(self.body(torch.zeros(1, 4)).shape[-1], 4)


def nn_init_zoo() -> nn.Sequential:
    """Generator control inside the factory, nn.init functions that return early on meta (and
    draw as many numbers as their values ask), deep copies, dropout."""
    torch.manual_seed(123)
    a = nn.Linear(8, 8)
    nn.init.trunc_normal_(a.weight, std=0.02)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        b = nn.Linear(8, 8)
        nn.init.orthogonal_(b.weight)
    c = nn.Conv2d(8, 8, 3)
    nn.init.dirac_(c.weight)
    rng = torch.get_rng_state()
    d = nn.Linear(8, 8)
    nn.init.sparse_(d.weight, sparsity=0.5)
    torch.set_rng_state(rng)
    e = nn.Embedding(10, 8, padding_idx=0)
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True),
        2,
        enable_nested_tensor=False,
    )
    return nn.Sequential(a, b, c, d, e, Probed(), *encoder.layers, mlp([8, 8], dropout=0.1))


def test_dropout_models_and_non_contiguous_cuts():
    factory = lambda: mlp([6, 7, 8, 9, 5], dropout=0.2)  # noqa: E731
    reference = eager(factory, 2)
    for cut in (range(0, 2), range(2, 5), [1, 4], [9]):
        assert_cut_is_eager(factory, cut, seed=2, reference=reference)


def test_reset_parameters_runs_only_if_the_factory_calls_it():
    # The old contract called every reset_parameters() (children first); eager construction
    # calls only those the factory does.
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def reset_parameters(self) -> None:
            nn.init.zeros_(self.proj.weight)

    model = assert_cut_is_eager(lambda: nn.Sequential(Block(), Block()), [1], seed=0)
    assert not torch.equal(model[1].proj.weight, torch.zeros(4, 4))


def test_torch_attention_is_initialized():
    # MultiheadAttention only has a private _reset_parameters; it also zeroes out_proj.bias.
    def factory() -> nn.Sequential:
        return nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))

    model = assert_cut_is_eager(factory, [0], seed=0)
    attention = model[0].self_attn
    assert torch.equal(attention.out_proj.bias, torch.zeros(8))
    assert torch.isfinite(model(torch.randn(2, 3, 8))).all()


def test_an_rnn_runs_on_its_built_weights():
    # LSTM keeps its own list of its weights (_flat_weights), updated through __setattr__.
    factory = lambda: nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 4, batch_first=True))  # noqa: E731
    model = assert_cut_is_eager(factory, [1], seed=0)
    assert all(w.device.type == "cpu" for w in model[1]._flat_weights)
    output, _ = model[1](torch.randn(2, 3, 4))
    assert output.device.type == "cpu" and torch.isfinite(output).all()


def tied() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    return model


def test_ties_survive_within_the_slice_and_are_rejected_across_the_cut():
    model = build(tied, seed=0)
    assert model[0].weight is model[2].weight
    assert materialized_bytes(model) == (16 + 4 + 4) * 4
    with pytest.raises(ValueError, match=r"tied across .*0\.weight = 2\.weight"):
        build(tied, seed=0, layers=range(0, 2))
    # Allowed (Pipe(tied=...)): each side holds the tensor as built, so the copies start equal.
    reference = eager(tied, 0)
    for cut in ([0], [2]):
        assert_cut_is_eager(tied, cut, seed=0, reference=reference, tied=True)
    factory = lambda: gpt(SMALL_GPT, tie_embeddings=True)  # noqa: E731
    assert_cut_is_eager(factory, [1, 4], seed=0, tied=True)


def test_configuration_errors():
    with pytest.raises(TypeError, match=r"returned Linear, not an nn.Sequential.*Pipe\.from_model"):
        build(lambda: nn.Linear(2, 2), seed=0)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match=r"0\.\.2 .*got \[3, -1\]"):
        build(lambda: mlp([2, 2, 2]), seed=0, layers=[0, 3, -1])
    with pytest.raises(ValueError, match=r"off the meta device.*0\.weight on cpu"):
        build(lambda: nn.Sequential(nn.Linear(2, 2, device="cpu")), seed=0)
    with pytest.raises(ValueError, match="meta"):
        build(lambda: mlp([2, 2]), seed=0, device="meta")
