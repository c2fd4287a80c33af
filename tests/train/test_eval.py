"""``gpipe eval`` through K processes equals the plain model's evaluation over the same
windows (float64): a saved Hugging Face model, and a run's checkpoint evaluated with another K
than it was trained with."""

from __future__ import annotations

import json
import math

import pytest
import torch
from saved_models import TEXT, llama, model_folder, transformers
from torch.nn import functional as F

from gpipe.train.eval_job import EvalConfig, resolve_eval


def plain_loss(model: torch.nn.Module, config) -> tuple[float, int]:
    """The reference: the summed token cross-entropy of every window over their targets."""
    task = config.task
    data = task.data(batch=config.batch, eval_batches=1, prepared=None, chunks=config.chunks)
    x, y = task.batch(data.val, torch.arange(len(data.val)), seed=0)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits
    summed = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100,
                             reduction="sum")  # fmt: skip
    return float(summed / (y != -100).sum()), int((y != -100).sum())


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


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_gpipe_eval_of_a_run_with_another_k_is_the_exported_models_loss(in_process, tmp_path):
    folder = model_folder(tmp_path / "llama", llama())
    data = tmp_path / "train.txt"
    data.write_text(TEXT[:8000])
    run = tmp_path / "run"
    done = in_process("train", "--model", str(folder), "--data", str(data), "--stages", "2",
                      "--chunks", "2", "--batch", "4", "--seq", "16", "--steps", "2",
                      "--dtype", "float64", "--eval-every", "0", "--sample-tokens", "0",
                      "--progress", "lines", "--out", str(run))  # fmt: skip
    assert done.returncode == 0, done.stderr
    held = tmp_path / "held.txt"
    held.write_text(TEXT[8000:12000])
    done = in_process("eval", str(run), "--data", str(held), "-K", "3", "-M", "3",
                      "--dtype", "float64", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    from gpipe.cli.export import export

    exported = export(run)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float64)
    config = resolve_eval(EvalConfig(str(run), data=str(held), stages=3, chunks=3,
                                     dtype="float64"))  # fmt: skip
    assert config.seq == 16
    loss, targets = plain_loss(model, config)
    assert result["targets"] == targets
    assert abs(result["loss"] - loss) <= 1e-12 * loss


def test_gpipe_eval_without_data_says_so_in_one_line(in_process, tmp_path):
    done = in_process("eval", str(tmp_path))
    assert done.returncode == 2
    assert "--data is required" in done.stderr
