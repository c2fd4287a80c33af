"""Generation through the pipeline (:func:`gpipe.train.generation.generate`), in one process:
greedy tokens equal the plain model's ``model.generate(do_sample=False)`` with the decode
step's key-value cache (two families, K=1 and 2) and, where the step cannot be captured, with
the window, saying so in one line; the sampling filters keep the likeliest tokens."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

import gpipe.train.kv_cache as kv_cache
from gpipe.frontend import CaptureError
from gpipe.pipe import Pipe
from gpipe.train.generation import Sampling, generate, pick

transformers = pytest.importorskip("transformers")

_NOTICE = "without a key-value cache"


def _llama():
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


def _gpt2():  # tied embeddings, learnt positions
    return transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)


def _pipe_and_model(config, stages: int, rows: int):
    """(a pipe of ``stages``, its task, the plain model with its weights), float64."""
    from gpipe.train.hf import HFModel

    source = HFModel({"config": config.to_dict(), "family": "causal-lm"})
    task = types.SimpleNamespace(model=source, dtype=torch.float64, tokenizer=None,
                                 logits=source.logits)  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = source.build().eval()
        pipe = Pipe.from_model(
            model, torch.zeros(rows, 16, dtype=torch.int64), split=source.split(model),
            balance=[4] if stages == 1 else [2, 2], devices=["cpu"] * stages, chunks=rows,
            inference_only=True,  # as gpipe generate builds it: the eval() graph alone
        )  # fmt: skip
    finally:
        torch.set_default_dtype(previous)
    return pipe, task, model


@pytest.mark.parametrize(("family", "stages"), [(_llama, 1), (_gpt2, 2)])
def test_greedy_tokens_are_model_generates_with_the_cache_and_without(
    family, stages, capfd, monkeypatch
):
    rows, new_tokens = 2, 10
    pipe, task, model = _pipe_and_model(family(), stages, rows)
    prompt = torch.randint(3, 96, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    start = torch.tensor([prompt] * rows)
    expected = model.generate(
        start, attention_mask=torch.ones_like(start), do_sample=False,
        max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    mesh = types.SimpleNamespace(pipeline=types.SimpleNamespace(broadcast=lambda t, *a, **k: t))
    built, decoder = [], kv_cache.decoder

    def refused(*args, **kwargs):
        raise CaptureError("no capture here\nsecond line")

    def recorded(*args, **kwargs):
        built.append(decoder(*args, **kwargs))
        return built[-1]

    said = f"{_NOTICE}: the decode step cannot be captured (no capture here); each token runs"
    for make, notice in ((refused, said), (recorded, None)):
        monkeypatch.setattr(kv_cache, "decoder", make)
        tokens = generate(pipe, mesh, task, prompt, rows=rows, new_tokens=new_tokens, window=32,
                          sampling=Sampling(temperature=0), seed=0,
                          autocast=contextlib.nullcontext)  # fmt: skip
        err = capfd.readouterr().err
        assert (notice in err) if notice else (_NOTICE not in err), err
        assert torch.equal(tokens, expected)
    assert sorted(built[0].pipes) == [1, 7]  # the 7 tokens of the prompt at once, then each
    for stage in built[0].pipe.stages:  # each stage holds the cache of its own layers only
        layers = {n for unit in stage.layers for n, _ in unit.named_parameters()}
        held = sorted({n.split(".")[3] for n in layers if n.count(".") > 4})
        caches = [n for unit in stage.layers for n, _ in unit.named_buffers() if "cache" in n]
        assert sorted(caches) == sorted(f"{kv}_cache_{i}" for i in held for kv in ("key", "value"))
    window = {t.data_ptr() for t in pipe.parameters()}
    for step in built[0].pipes.values():  # the window's weights, not copies
        assert {t.data_ptr() for t in step.parameters()} == window


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
