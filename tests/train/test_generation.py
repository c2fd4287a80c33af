"""Generation through the pipeline (:func:`gpipe.train.generation.generate`), in one process:
greedy tokens equal the plain model's ``model.generate(do_sample=False)`` with the decode
step's key-value cache (two families, K=1 and 2), and where the step cannot be captured the
window's tokens, with a one-line notice; the sampling filters keep the likeliest tokens."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

import gpipe.train.kv_cache as kv_cache
from gpipe.frontend import CaptureError
from gpipe.train.generation import Sampling, generate, pick

transformers = pytest.importorskip("transformers")

_NOTICE = "without a key-value cache"


def _llama():
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


def _gpt2():  # tied embeddings, learnt positions
    return transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=3, n_head=4, n_positions=64)


def _generated(config, stages: int, *, rows: int = 2, new_tokens: int = 10):
    """(pipeline's tokens, plain model's greedy tokens), float64, a pipe of ``stages``."""
    from gpipe.train.hf import HFModel

    source = HFModel({"config": config.to_dict(), "family": "causal-lm"})
    task = types.SimpleNamespace(model=source, dtype=torch.float64, tokenizer=None,
                                 logits=source.logits)  # fmt: skip
    mesh = types.SimpleNamespace(pipeline=types.SimpleNamespace(broadcast=lambda t, *a, **k: t))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        example = torch.zeros(rows, 16, dtype=torch.int64)
        balance = [5] if stages == 1 else [2, 3]
        pipe = source.pipe(
            example, balance=balance, devices=["cpu"] * stages, chunks=rows, init_seed=0
        )
        torch.manual_seed(0)
        model = source.build().eval()
    finally:
        torch.set_default_dtype(previous)
    prompt = torch.randint(3, 96, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens = generate(pipe, mesh, task, prompt, rows=rows, new_tokens=new_tokens, window=32,
                      sampling=Sampling(temperature=0), seed=0,
                      autocast=contextlib.nullcontext)  # fmt: skip
    start = torch.tensor([prompt] * rows)
    expected = model.generate(
        start, attention_mask=torch.ones_like(start), do_sample=False,
        max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return tokens, expected


@pytest.mark.parametrize(("family", "stages"), [(_llama, 1), (_gpt2, 2)])
def test_greedy_tokens_through_the_cache_are_model_generates(family, stages, capfd, monkeypatch):
    built = []

    def recorded(*args, **kwargs):
        built.append(decoder(*args, **kwargs))
        return built[-1]

    decoder = kv_cache.decoder
    monkeypatch.setattr(kv_cache, "decoder", recorded)
    tokens, expected = _generated(family(), stages)
    assert _NOTICE not in capfd.readouterr().err
    assert torch.equal(tokens, expected)
    for stage in built[0].pipe.stages:  # each stage holds the cache of its own layers only
        layers = {n for unit in stage.layers for n, _ in unit.named_parameters()}
        held = sorted({n.split(".")[3] for n in layers if n.count(".") > 4})
        caches = [n for unit in stage.layers for n, _ in unit.named_buffers() if "cache" in n]
        assert sorted(caches) == sorted(f"{kv}_cache_{i}" for i in held for kv in ("key", "value"))


def test_a_step_that_cannot_be_captured_decodes_the_window_with_a_notice(capfd, monkeypatch):
    def refused(*args, **kwargs):
        raise CaptureError("no capture here\nsecond line")

    monkeypatch.setattr(kv_cache, "decoder", refused)
    tokens, expected = _generated(_llama(), 1, new_tokens=4)
    err = capfd.readouterr().err
    assert f"{_NOTICE}: the decode step cannot be captured (no capture here)" in err
    assert torch.equal(tokens, expected)


def test_top_k_1_and_a_tiny_top_p_are_greedy_and_top_k_keeps_the_k_likeliest():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    greedy = pick(logits, Sampling(temperature=0), generator)
    assert torch.equal(pick(logits, Sampling(temperature=1.0, top_k=1), generator), greedy)
    assert torch.equal(pick(logits, Sampling(temperature=1.0, top_p=1e-6), generator), greedy)
    likeliest = torch.topk(logits, 3).indices
    for _ in range(20):
        chosen = pick(logits, Sampling(temperature=2.0, top_k=3), generator)
        assert (chosen == likeliest).any(dim=1).all()
