"""Fine-tuning saved models through ``gpipe train`` in 2 processes equals plain gradient
accumulation over the same batches, in float64: a tiny Mixtral (a causal LM with experts,
packed text, the folder's tokenizer) and a tiny BART (sequence to sequence, JSONL pairs,
padded), and a resumed run of it continues exactly.

The reference is the plain ``from_pretrained`` model: each mini-batch's micro-batches
forwarded and backwarded one after the other (the loss of each: its summed token
cross-entropy over the mini-batch's count of real tokens), the global norm clipped, AdamW with
the trainer's groups and hyperparameters. Compared: each step's loss and gradient norm, and
every weight after the last step.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

import gpipe.train.checkpoint as ckpt
from gpipe.cli.export import export
from gpipe.train import resolve
from gpipe.train.data import EpochSampler, hash_seed
from train.saved_models import EOS, PAD, TEXT, bart, mixtral, model_folder, pairs_file, transformers
from train_runs import losses

STEPS, BATCH, CHUNKS, SEQ, LR = 3, 6, 3, 16, 1e-3
RUN = ["--stages", "2", "--chunks", str(CHUNKS), "--batch", str(BATCH), "--seq", str(SEQ),
       "--steps", str(STEPS), "--dtype", "float64", "--lr", str(LR), "--lr-schedule",
       "constant", "--warmup", "0", "--eval-every", "0", "--sample-tokens", "0",
       "--progress", "lines"]  # fmt: skip


def plain_training(model: torch.nn.Module, options: dict, out) -> list[tuple[float, float]]:
    """The reference: (loss, gradient norm) per step; trains ``model`` in place."""
    config = resolve({**options, "out": str(out)})
    task = config.task
    data = task.data(batch=BATCH, eval_batches=1, prepared=None)
    sampler = EpochSampler(len(data.train), seed=config.seed)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2]},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=LR, weight_decay=config.weight_decay, betas=(0.9, 0.95),
    )  # fmt: skip
    model.train()
    history = []
    for step in range(1, STEPS + 1):
        x, y = task.batch(data.train, sampler.take(BATCH), seed=hash_seed(config.seed, step, -1))
        total, loss = (y != -100).sum(), 0.0
        for part in range(CHUNKS):
            xm = {k: v.tensor_split(CHUNKS)[part] for k, v in x.items()} if isinstance(
                x, dict) else {"input_ids": x.tensor_split(CHUNKS)[part]}  # fmt: skip
            ym = y.tensor_split(CHUNKS)[part]
            logits = model(**xm).logits
            summed = F.cross_entropy(logits.flatten(0, 1), ym.flatten(), ignore_index=-100,
                                     reduction="sum")  # fmt: skip
            (summed / total).backward()
            loss += float(summed / total)
        norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        history.append((loss, float(norm)))
    return history


def compare(run, history, model) -> dict[str, float]:
    """The worst relative errors of the losses, gradient norms and weights."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    errors = {
        "loss": max(abs(r["loss"] - v) / v for r, (v, _) in zip(records, history, strict=True)),
        "grad_norm": max(abs(r["grad_norm"] - n) / n
                         for r, (_, n) in zip(records, history, strict=True)),
    }  # fmt: skip
    # Weights, relative to the model's largest: a key bias has no gradient but rounding
    # (softmax ignores it), which AdamW turns into steps of ~1e-12 from its zeros.
    trained, expected = ckpt.export_state_dict(run), model.state_dict()
    assert set(trained) == set(expected)
    weights = {k: v for k, v in expected.items() if v.is_floating_point()}
    scale = max(float(v.abs().max()) for v in weights.values())
    errors["weights"] = max(float((trained[k] - v).abs().max()) / scale
                            for k, v in weights.items())  # fmt: skip
    print(f"worst relative errors: {errors}; losses {[r['loss'] for r in records]} vs "
          f"{[v for v, _ in history]}")  # fmt: skip
    for what, error in errors.items():
        assert error <= 1e-10, (what, error)
    return errors


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_saved_mixtral_fine_tunes_in_2_processes_as_plain_gradient_accumulation(
    in_process, tmp_path
):
    folder = model_folder(tmp_path / "mixtral", mixtral())  # experts saved one by one
    (tmp_path / "train.txt").write_text(TEXT)
    run = tmp_path / "run"
    done = in_process("train", "--model", str(folder), "--data", str(tmp_path / "train.txt"),
                      *RUN, "--save-every", "0", "--out", str(run))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "mixtral small, K=2 M=3 gpipe" in done.stdout
    # transformers' own loop over the experts (its grouped_mm takes no float64)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, experts_implementation="eager"
    )
    options = {"model": str(folder), "data": str(tmp_path / "train.txt"), "seq": SEQ,
               "dtype": "float64"}  # fmt: skip
    history = plain_training(model, options, tmp_path / "reference")
    compare(run, history, model)

    # Exported as the model's own kind of folder: save_pretrained's, experts saved one by one.
    exported = export(run)
    assert (exported / "tokenizer.json").exists()
    again = transformers.AutoModelForCausalLM.from_pretrained(
        exported, dtype=torch.float64, experts_implementation="eager"
    )
    trained = ckpt.export_state_dict(run)
    assert all(torch.equal(v, trained[k]) for k, v in again.state_dict().items())


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_a_saved_bart_fine_tunes_in_2_processes_as_plain_gradient_accumulation_and_resumes(
    in_process, tmp_path
):
    folder = model_folder(tmp_path / "bart", bart(), family="AutoModelForSeq2SeqLM")
    data = pairs_file(tmp_path / "pairs.jsonl")
    pairs = ["--data", str(data), "--text-field", "source", "--target-field", "target",
             "--packing", "pad", "--val-fraction", "0.25"]  # fmt: skip
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    done = in_process("train", "--model", str(folder), *pairs, *RUN, "--save-every", "2",
                      "--out", str(run))  # fmt: skip
    assert done.returncode == 0, done.stderr

    # The decoder's input is the target shifted right after the start token, as the model's
    # own labels= gives it.
    options = {"model": str(folder), "data": str(data), "text_field": "source",
               "target_field": "target", "packing": "pad", "val_fraction": 0.25, "seq": SEQ,
               "dtype": "float64"}  # fmt: skip
    task = resolve({**options, "out": str(tmp_path / "x")}).task
    samples = task.data(batch=BATCH, eval_batches=1, prepared=None).train
    x, y = task.batch(samples, torch.arange(len(samples)), seed=0)
    shift = transformers.models.bart.modeling_bart.shift_tokens_right
    assert torch.equal(x["decoder_input_ids"], shift(y.where(y != -100, PAD), PAD, EOS))
    assert (y == -100).any() and (x["attention_mask"] == 0).any()  # padded on both sides

    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float64)
    history = plain_training(model, options, tmp_path / "reference")
    compare(run, history, model)

    # Resumed from step 2: the data position and weights of the checkpoint, the same steps.
    middle = run / "checkpoints" / "step-000002"
    done = in_process("train", "--resume", str(middle), "--out", str(resumed))
    assert done.returncode == 0, done.stderr
    assert "resumed from step 2" in done.stdout
    assert losses(resumed)[3] == losses(run)[3]
