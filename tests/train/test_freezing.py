"""``gpipe train --freeze PATTERNS`` in 2 processes: the frozen parameters never move, and
the others take the plain model's step exactly (float64, SGD: a step from the checkpoint
before it is the plain model's gradient step on the same batch)."""

from __future__ import annotations

import pytest
import torch

import gpipe.train.checkpoint as ckpt
from gpipe.train import build_model, resolve
from gpipe.train.data import EpochSampler, hash_seed

LR = 0.5
FROZEN = ("0.token.weight", "0.position.weight", "1.qkv.weight", "1.qkv.bias")


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_frozen_parameters_stay_and_the_rest_take_the_plain_step(in_process, tmp_path):
    run = tmp_path / "run"
    options = ["--size", "tiny", "--model-config", "dropout=0", "--dtype", "float64",
               "--optimizer", "sgd", "--lr", str(LR), "--lr-schedule", "constant",
               "--warmup", "0", "--grad-clip", "0", "--weight-decay", "0", "--steps", "2",
               "--save-every", "1", "--keep", "0", "--eval-every", "0", "--sample-tokens", "0",
               "--freeze", "0.*,1.qkv.*", "--progress", "lines", "--report-to", "none"]  # fmt: skip
    done = in_process("train", *options, "--out", str(run))
    assert done.returncode == 0, done.stderr
    first, second = (ckpt.read_manifest(run / "checkpoints" / f"step-00000{s}") for s in (1, 2))
    before, after = (ckpt.export_state_dict(m.path) for m in (first, second))
    config = resolve({"resume": str(first.path), "steps": 3})  # the run's task
    task = config.task
    data = task.data(batch=config.batch, eval_batches=1, prepared=None)
    sampler = EpochSampler(len(data.train), seed=config.seed)
    sampler.load_state_dict(first.data)
    x, y = task.batch(data.train, sampler.take(config.batch), seed=hash_seed(config.seed, 2, -1))
    torch.set_default_dtype(torch.float64)
    try:
        model = build_model(first.model)
    finally:
        torch.set_default_dtype(torch.float32)
    model.load_state_dict(before)
    task.loss(model(x), y).backward()
    for name, parameter in model.named_parameters():
        if name in FROZEN:
            assert torch.equal(after[name], before[name]), name
        else:
            expected = before[name] - LR * parameter.grad
            error = float((after[name] - expected).abs().max() / expected.abs().max())
            assert error <= 1e-10, (name, error)
    assert any(not torch.equal(after[n], before[n]) for n in before if n not in FROZEN)
