"""gpipe.train.evaluation: the loss ``gpipe eval`` (and a run's validation) computes through K
processes is the plain model's mean over the same windows (float64), here of a saved Hugging
Face model (a run's checkpoint evaluated with another K: test_eval_job.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gpipe.train.eval_job import EvalConfig, resolve_eval
from train.saved_models import TEXT, llama, model_folder, plain_loss, transformers


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_gpipe_eval_of_a_saved_model_is_the_plain_models_loss(in_process, tmp_path):
    folder = model_folder(tmp_path / "llama", llama())
    data = tmp_path / "val.txt"
    data.write_text(TEXT[:6000])
    done = in_process("eval", str(folder), "--data", str(data), "-K", "2", "-M", "2",
                      "--batch", "4", "--seq", "32", "--dtype", "float64", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    config = resolve_eval(EvalConfig(str(folder), data=str(data), seq=32, batch=4, stages=2,
                                     chunks=2, dtype="float64"))  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    loss, targets = plain_loss(model, config)
    print(f"gpipe eval {result['loss']!r} vs plain {loss!r} over {targets} targets")
    assert result["targets"] == targets
    assert abs(result["loss"] - loss) <= 1e-12 * loss
    assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-12)
    assert result["tokens_per_s"] > 0
