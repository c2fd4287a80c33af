"""Evaluating through the pipeline: :func:`validate`, the loss of ``gpipe train``'s validation
and of ``gpipe eval``, and :func:`build_pipe`, one rank's stage of a run's model.

The loss is the objective's mean over every target of the samples evaluated (a sum of each
batch's mean times its targets, in float64), so it does not depend on K, M or the batch: it
is the plain model's mean over the same samples (tests/train/test_evaluation.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gpipe.parallel.mesh import Mesh
from gpipe.pipe import Pipe
from gpipe.train.config import TrainConfig
from gpipe.train.data import hash_seed

__all__ = ["build_pipe", "validate"]


def build_pipe(
    config: TrainConfig, mesh: Mesh, balance: list[int], *, inference_only: bool = False
) -> Pipe:
    """This rank's stage(s) of ``config``'s model, from the model's weights unless it
    resumes (the checkpoint's are loaded next); ``inference_only``: it only evaluates."""
    c = config
    return c.task.pipe(
        resume=bool(c.resume),
        inference_only=inference_only,
        balance=balance,
        layout=c.layout,
        deferred_batch_norm=c.task.deferred_batch_norm,
        group=mesh.pp,
        data_parallel_group=mesh.dp,
        init_seed=c.seed,
        timeout=c.timeout,
        transport=c.transport,
    )


def validate(
    pipe: Pipe,
    config: TrainConfig,
    mesh: Mesh,
    samples: Any,
    indices: torch.Tensor,
    *,
    replica: int,
    autocast: Callable[[], Any],
) -> dict[str, float]:
    """Mean loss (perplexity, accuracy) on ``samples[indices]``, shared out over replicas;
    every rank returns it. ``val_targets``: the targets it is the mean of."""
    c, task = config, config.task
    mine = torch.tensor_split(indices, c.replicas)[replica]
    # As many forwards on every replica (sharded ones run each together): by the shortest
    # share.
    shortest = len(indices) // c.replicas
    batches = max(1, shortest // max(c.batch // c.replicas, c.chunks))
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, targets, correct
    pipe.eval()
    try:
        with torch.no_grad(), autocast():
            for part in torch.tensor_split(mine, batches):
                # the same masks at every validation (a masked LM's)
                x, y = task.batch(samples, part, seed=hash_seed(c.seed, -3))
                out = pipe(x)
                if out is not None:  # on the last stage's ranks only
                    loss, count = task.loss(out, y), float(task.count(y))
                    correct = task.correct(out, y)
                    totals += torch.tensor(
                        [float(loss) * count, count, correct], dtype=torch.float64
                    )
    finally:
        pipe.train()
    totals = mesh.everyone.all_reduce(totals, "the validation loss sum (all-reduce)")
    loss = float(totals[0] / totals[1].clamp(min=1))
    result = {"val_loss": loss, "val_targets": float(totals[1])}
    if task.classifies:
        result["val_accuracy"] = float(totals[2] / totals[1])
    else:  # a language model's
        result["val_perplexity"] = math.exp(min(loss, 700.0))  # finite, as JSON needs
    return result
