"""``gpipe generate`` through K processes: greedy decoding, with the key-value cache, writes
the tokens of the plain model's ``model.generate(do_sample=False)`` (a tiny saved Llama, its
own BPE tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch

from train.saved_models import PAD, llama, model_folder, transformers


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_greedy_generation_through_3_processes_is_model_generates(in_process, tmp_path):
    folder = model_folder(tmp_path / "llama", llama(), seed=3)
    done = in_process("generate", str(folder), "--prompt", "def loads(s, *, cls=None",
                      "--max-tokens", "12", "--seq", "48", "-K", "3", "--dtype", "float64",
                      "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "without a key-value cache" not in done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    prompt = torch.tensor([result["prompt"]])
    expected = model.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    print(result["texts"][0])
    assert len(result["tokens"][0]) > prompt.shape[1]
    assert result["tokens"][0] == expected[0].tolist()
