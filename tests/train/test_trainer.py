"""The whole training loop: :class:`gpipe.train.Trainer` (K=1 and K=2 processes) against a
plain PyTorch loop over the same batches — the un-split model from the same initial weights,
AdamW with nanoGPT's two weight-decay groups, the documented warm-up + cosine rate written
out by hand, the default gradient clipping — in float64: each step's loss and every weight
after the last step."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from gpipe.materialize import build
from gpipe.parallel.launch import launch
from gpipe.parallel.sharded import full_value
from gpipe.train import Trainer, resolve
from gpipe.train.config import TrainConfig
from gpipe.train.data import EpochSampler, hash_seed
from reference import reference_step, relative_error
from train_runs import losses

STEPS, WARMUP = 4, 2  # two warm-up steps, then the cosine: both parts of the schedule


def _trained(rank: int, config: TrainConfig) -> dict[str, torch.Tensor]:
    """In each process: ``gpipe train``'s loop, then this rank's weights by name."""
    trainer = Trainer(rank, config)
    trainer.run()
    return {n: full_value(p.detach()).clone() for n, p in trainer.pipe.named_parameters()}


def _rate(config: TrainConfig, step: int) -> float:
    """Step ``step``'s (from 1) learning rate, as gpipe.train.lr_schedule documents it."""
    c = config
    if step <= c.warmup:
        return c.lr * step / c.warmup
    progress = (step - c.warmup) / (c.steps - c.warmup)
    return c.lr * (0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2)


def _plain_loop(config: TrainConfig) -> tuple[list[float], nn.Module]:
    """nanoGPT's loop on the plain model: accumulate over the micro-batches, clip, step."""
    c, task = config, config.task
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = build(functools.partial(task.model.build), seed=c.seed)
    finally:
        torch.set_default_dtype(previous)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2]},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay,
    )  # fmt: skip
    data = task.data(batch=c.batch, eval_batches=c.eval_batches, prepared=None, chunks=c.chunks)
    sampler = EpochSampler(len(data.train), seed=c.seed)
    seen = []
    for step in range(1, c.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = _rate(c, step)
        x, y = task.batch(data.train, sampler.take(c.batch), seed=hash_seed(c.seed, step, -1))
        loss = reference_step(model, x, y, task.loss, chunks=c.chunks,
                              seed=hash_seed(c.seed, step, 0))  # fmt: skip
        seen.append(float(loss))
        nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return seen, model


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stages", [1, 2])
def test_the_trainer_trains_as_a_plain_pytorch_loop(stages, tmp_path, cache, monkeypatch):
    monkeypatch.setenv("GPIPE_CACHE_DIR", str(cache))
    text = tmp_path / "text.txt"  # small: each process reads and tokenizes it
    text.write_text("".join(f"line {i}: {i * i % 97} and {i % 13}\n" for i in range(2000)))
    (tmp_path / "run").mkdir()  # as gpipe train's launcher does
    config = resolve({
        "size": "tiny", "data": str(text), "stages": stages, "dtype": "float64",
        "steps": STEPS, "warmup": WARMUP, "lr_schedule": "cosine",
        "eval_every": 0, "save_every": 0, "sample_tokens": 0, "tensorboard": False,
        "out": str(tmp_path / "run"),
    })  # fmt: skip
    assert config.grad_clip > 0 and config.optimizer == "adamw"  # the defaults compared here
    per_rank = launch(_trained, stages, args=(config,), backend="gloo", timeout=60)
    expected_losses, model = _plain_loop(config)

    ours = losses(tmp_path / "run")
    assert sorted(ours) == list(range(1, STEPS + 1))
    for step, expected in enumerate(expected_losses, 1):
        assert abs(ours[step] - expected) <= 1e-10 * abs(expected), step
    weights = {name: value for rank in per_rank for name, value in rank.items()}
    expected_weights = dict(model.named_parameters())
    assert sorted(weights) == sorted(expected_weights)
    initial = build(functools.partial(config.task.model.build), seed=config.seed)
    for name, value in expected_weights.items():
        assert relative_error(weights[name], value.detach()) <= 1e-9, name
        assert not torch.equal(value.detach().float(), initial.state_dict()[name]), name  # moved
