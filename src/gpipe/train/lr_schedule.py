"""The learning rate of each step, by ``torch.optim.lr_scheduler``'s own schedulers.

Linear warm-up (``LinearLR``) to ``lr`` at step ``warmup``, then a decay to the last step
``steps``: cosine to lr/10 (``CosineAnnealingLR``), linear to 0 (``LinearLR``) or none
(``ConstantLR``), joined by ``SequentialLR``. Step t (from 1) trains at

    warm-up (t <= warmup):  lr * t / warmup
    cosine:                 lr * (0.1 + 0.9 * (1 + cos(pi * p)) / 2)
    linear:                 lr * (1 - p),  p = (t - warmup) / (steps - warmup)

(warm-up 0 is warm-up 1: step 1 at ``lr``). The scheduler's epoch is step - 1: it steps
*before* each step but the first (:func:`advance`), so a checkpoint of step t holds the rate
step t trained at, and a resumed run computes its next rate from there.

A resumed run with another ``--steps`` keeps the rate where it stood and spreads the rest of
the decay over the new horizon (:func:`stretch`): the schedulers compute each rate from the
previous one, so with a new horizon the cosine (or line) continues from the current rate and
reaches its end (lr/10, or 0) at the new last step. With the same ``--steps``, the same
floating-point operations run in the same order: bitwise the uninterrupted run.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.optim import lr_scheduler

__all__ = ["LR_SCHEDULES", "advance", "build", "load_state", "state", "stretch"]

LR_SCHEDULES = ("cosine", "linear", "constant")
_PER_GROUP = ("base_lrs", "_last_lr")  # this rank's groups, not the saving rank's


def build(
    optimizer: torch.optim.Optimizer, *, kind: str, lr: float, warmup: int, steps: int
) -> lr_scheduler.LRScheduler:
    """The scheduler of a run of ``steps`` steps; it sets step 1's rate on ``optimizer``."""
    if kind not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {kind!r}: choose one of {', '.join(LR_SCHEDULES)}")
    decay = _decay(optimizer, kind, lr, _decay_steps(warmup, steps))
    if warmup <= 1:
        return decay
    warm = lr_scheduler.LinearLR(optimizer, 1 / warmup, 1.0, total_iters=warmup - 1)
    return lr_scheduler.SequentialLR(optimizer, [warm, decay], milestones=[warmup - 1])


def _decay_steps(warmup: int, steps: int) -> int:
    return max(1, steps - max(warmup, 1))


def _decay(optimizer: torch.optim.Optimizer, kind: str, lr: float, length: int) -> Any:
    if kind == "cosine":
        return lr_scheduler.CosineAnnealingLR(optimizer, T_max=length, eta_min=lr / 10)
    if kind == "linear":
        return lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=length)
    return lr_scheduler.ConstantLR(optimizer, 1.0, total_iters=0)


def advance(scheduler: lr_scheduler.LRScheduler, step: int) -> None:
    """Set the rate of ``step`` (from 1): the scheduler's epoch becomes step - 1."""
    with warnings.catch_warnings():
        # A resumed run (or one replayed from a checkpoint without a scheduler) steps the
        # scheduler before this process's first optimizer step, which torch takes for the
        # pre-1.1 order; the rates are those of the saved run (tests/train/test_lr_schedule.py).
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        while scheduler.last_epoch < step - 1:
            scheduler.step()


def stretch(scheduler: lr_scheduler.LRScheduler, *, warmup: int, steps: int) -> None:
    """Make the decay end at step ``steps`` from here on, starting from the current rate."""
    # SequentialLR keeps its parts in _schedulers (torch has no public name for them).
    decay = (
        scheduler._schedulers[-1] if isinstance(scheduler, lr_scheduler.SequentialLR) else scheduler
    )
    length = _decay_steps(warmup, steps)
    if isinstance(decay, lr_scheduler.CosineAnnealingLR):
        decay.T_max = length
    elif isinstance(decay, lr_scheduler.LinearLR):
        decay.total_iters = length


def state(scheduler: lr_scheduler.LRScheduler) -> dict[str, Any]:
    """The scheduler's state, JSON-able and free of per-group values: a checkpoint loads
    into a rank of another cut, whose optimizer may have other groups (all share one rate)."""
    saved = scheduler.state_dict()
    for inner in saved.get("_schedulers", []):
        for key in _PER_GROUP:
            inner.pop(key, None)
    return {k: v for k, v in saved.items() if k not in _PER_GROUP}


def load_state(scheduler: lr_scheduler.LRScheduler, saved: dict[str, Any]) -> None:
    """Load :func:`state`'s output; the rates themselves come with the optimizer's groups."""
    inner = getattr(scheduler, "_schedulers", [])
    kept = [_per_group(s) for s in (scheduler, *inner)]
    scheduler.load_state_dict(saved)
    for one, values in zip((scheduler, *inner), kept, strict=True):
        one.__dict__.update(values)


def _per_group(scheduler: lr_scheduler.LRScheduler) -> dict[str, Any]:
    return {k: getattr(scheduler, k) for k in _PER_GROUP if hasattr(scheduler, k)}
