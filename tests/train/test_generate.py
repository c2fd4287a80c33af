"""``gpipe generate`` through K processes: greedy decoding writes the tokens of the plain
model's ``model.generate(do_sample=False)`` (a tiny saved Llama, its own BPE tokenizer); the
sampling filters (top-k, top-p) keep the likeliest tokens."""

from __future__ import annotations

import json

import pytest
import torch
from saved_models import PAD, llama, model_folder, transformers

from gpipe.train.generation import Sampling, pick


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_greedy_generation_through_3_processes_is_model_generates(in_process, tmp_path):
    folder = model_folder(tmp_path / "llama", llama(), seed=3)
    done = in_process("generate", str(folder), "--prompt", "def loads(s, *, cls=None",
                      "--max-tokens", "12", "--seq", "48", "-K", "3", "--dtype", "float64",
                      "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    prompt = torch.tensor([result["prompt"]])
    expected = model.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    print(result["texts"][0])
    assert len(result["tokens"][0]) > prompt.shape[1]
    assert result["tokens"][0] == expected[0].tolist()


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


def test_generate_without_a_prompt_says_so_in_one_line(in_process, tmp_path):
    done = in_process("generate", str(tmp_path))
    assert done.returncode == 2
    assert "--prompt is required" in done.stderr
