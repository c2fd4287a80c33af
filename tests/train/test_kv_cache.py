"""The decode step with a key-value cache (:mod:`gpipe.train.kv_cache`): fed one token at a
time it gives the plain model's logits at every position (GPT-NeoX, float64, no pipeline:
tests/train/test_generation.py runs it through one); and the cases that decode the window
instead say why, the same on every rank."""

from __future__ import annotations

import types

import pytest
import torch

from gpipe.frontend import CaptureError
from gpipe.train.kv_cache import DecodeStep, why_not

transformers = pytest.importorskip("transformers")


def test_the_decode_step_fed_token_by_token_gives_the_models_logits():
    config = transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    step = DecodeStep(model, rows=2, length=12)
    with torch.no_grad():
        expected = model(tokens).logits
        for i in range(tokens.shape[1]):
            position = torch.full((2,), i, dtype=torch.int64)
            logits = step(tokens[:, i : i + 1], position)
            torch.testing.assert_close(logits[:, 0], expected[:, i], rtol=0, atol=1e-10)
    assert step.key_cache_1[:, :, 9:].abs().sum() == 0  # written up to the last position only


def test_a_model_that_ignores_the_cache_or_slides_its_window_is_refused():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    DecodeStep(model, rows=2, length=8).check(2)  # writes its cache: accepted
    model.forward = lambda input_ids, cache=None, **kwargs: types.SimpleNamespace(
        logits=torch.zeros(*input_ids.shape, 64, device=input_ids.device)
    )  # takes cache= and ignores it
    with pytest.raises(CaptureError, match="does not write transformers' cache="):
        DecodeStep(model, rows=2, length=8).check(2)
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, sliding_window=4,
    )  # fmt: skip
    with torch.device("meta"), pytest.raises(CaptureError, match="StaticSlidingWindowLayer"):
        DecodeStep(transformers.AutoModelForCausalLM.from_config(config), rows=2, length=8)


def _pipe(**layout):
    layout = {"shard": None, "virtual_stages": 1, **layout}
    return types.SimpleNamespace(
        layout=types.SimpleNamespace(**layout), devices=[torch.device("cpu")]
    )


def _task(kind="hf", family="causal-lm", **args):
    return types.SimpleNamespace(model=types.SimpleNamespace(kind=kind, family=family, args=args))


def test_each_case_the_cache_cannot_make_exact_says_why():
    assert why_not(_pipe(), _task(), length=40, window=48) is None
    reasons = {
        "gpipe's gpt model has no key-value cache": (_pipe(), _task("gpt")),
        "a masked-lm model is decoded without its cache": (_pipe(), _task(family="masked-lm")),
        "LoRA adapters": (_pipe(), _task(lora={"r": 4})),
        "sharded or interleaved stages": (_pipe(virtual_stages=2), _task()),
    }
    for reason, (pipe, task) in reasons.items():
        assert why_not(pipe, task, length=40, window=48).startswith(reason)
    assert "exceed the window (32)" in why_not(_pipe(), _task(), length=40, window=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in why_not(_pipe(), _task(), length=40, window=48)
