"""A run's precision (``--dtype``): the autocast of its forwards, and for float16 the
gradient scaler of its optimizer steps (``torch.amp.GradScaler``, which ``Pipe.step`` makes
every rank skip alike; see :meth:`gpipe.pipe.Pipe.step`).

float32 and float64 are the weights' dtype, with no autocast; bfloat16 and float16 autocast
the forwards on CPU (the weights stay float32). float16's narrow range needs the scaler: a
step whose scaled gradients overflow is skipped and the scale halved (``skipped`` and
``scale`` in metrics.jsonl), and the scale doubles after 2000 good steps.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from gpipe.pipe import Pipe

__all__ = ["AUTOCAST", "autocast_of", "load_scaler", "optimizer_step", "save_scaler", "scaler_of"]

AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SCALER = "grad_scaler"  # its key in the checkpoint's scheduler record


def autocast_of(dtype: str) -> Callable[[], Any]:
    """The context of a run's forwards: autocast for ``--dtype bfloat16`` or ``float16``."""
    if dtype in AUTOCAST:
        return functools.partial(torch.autocast, "cpu", dtype=AUTOCAST[dtype])
    return contextlib.nullcontext


def scaler_of(dtype: str) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler("cpu") if dtype == "float16" else None


def optimizer_step(
    pipe: Pipe, optimizer: torch.optim.Optimizer | None, scaler: Any, grad_clip: float
) -> dict[str, Any]:
    """Clip and step (through ``scaler``, if any); the step's ``grad_norm`` (None when not
    finite: a skipped step's), and with a scaler the ``scale`` it used and whether it was
    ``skipped`` (the scaler lowered its scale)."""
    if scaler is not None and optimizer is not None:
        scaler.unscale_(optimizer)
    norm = pipe.clip_grad_norm_(grad_clip) if grad_clip else None
    record: dict[str, Any] = {"grad_norm": None}
    if norm is not None and math.isfinite(float(norm)):
        record["grad_norm"] = float(norm)
    if optimizer is None:
        return record
    if scaler is None:
        optimizer.step()
    else:
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        record.update(scale=scale, skipped=scaler.get_scale() < scale)
    optimizer.zero_grad(set_to_none=True)
    return record


def save_scaler(schedule: dict[str, Any] | None, scaler: Any) -> dict[str, Any] | None:
    """The checkpoint's scheduler record with the scaler's state (its scale and growth
    tracker, the same on every rank) beside it: a float16 run resumes exactly."""
    if scaler is None:
        return schedule
    return {**(schedule or {}), SCALER: scaler.state_dict()}


def load_scaler(schedule: dict[str, Any] | None, scaler: Any) -> dict[str, Any] | None:
    """Load what :func:`save_scaler` added into ``scaler`` (None: a run of another
    --dtype, which drops it); returns the scheduler's own record."""
    if not schedule or SCALER not in schedule:
        return schedule
    rest = {k: v for k, v in schedule.items() if k != SCALER}
    if scaler is not None:
        scaler.load_state_dict(schedule[SCALER])
    return rest or None
