"""gpipe.train.eval_job: ``gpipe eval`` of a run's checkpoint with another K than it was trained
with is the exported model's loss over the same windows (float64): trained in one process,
evaluated in two (each capture of the model in a process costs seconds)."""

from __future__ import annotations

import json

import pytest
import torch

from gpipe.train.eval_job import EvalConfig, resolve_eval
from train.saved_models import TEXT, llama, model_folder, plain_loss, transformers


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_gpipe_eval_of_a_run_with_another_k_is_the_exported_models_loss(in_process, tmp_path):
    folder = model_folder(tmp_path / "llama", llama())
    data = tmp_path / "train.txt"
    data.write_text(TEXT[:8000])
    run = tmp_path / "run"
    done = in_process("train", "--model", str(folder), "--data", str(data), "--stages", "1",
                      "--chunks", "2", "--batch", "4", "--seq", "16", "--steps", "2",
                      "--dtype", "float64", "--eval-every", "0", "--sample-tokens", "0",
                      "--progress", "lines", "--out", str(run))  # fmt: skip
    assert done.returncode == 0, done.stderr
    held = tmp_path / "held.txt"
    held.write_text(TEXT[8000:12000])
    done = in_process("eval", str(run), "--data", str(held), "-K", "2", "-M", "3",
                      "--dtype", "float64", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    from gpipe.cli.export import export

    exported = export(run)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float64)
    config = resolve_eval(EvalConfig(str(run), data=str(held), stages=2, chunks=3,
                                     dtype="float64"))  # fmt: skip
    assert config.seq == 16
    loss, targets = plain_loss(model, config)
    assert result["targets"] == targets
    assert abs(result["loss"] - loss) <= 1e-12 * loss
