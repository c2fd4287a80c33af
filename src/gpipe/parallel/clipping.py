"""Clipping across processes: refusing a script that clips each stage by its own norm.

``torch.nn.utils.clip_grad_norm_(pipe.parameters(), max_norm)``, what every training script
writes, sees only this process's gradients when the pipeline spans processes: each stage is
clipped by its own norm, not the model's, and nothing in PyTorch can be asked to do otherwise.
``Pipe.clip_grad_norm_`` is the whole model's clip. So that the plain call does not train
another model in silence, :class:`GradientWatch` refuses it before the optimizer applies it:

* at the end of each step it notes this process's gradients: each one's version counter and
  norm (the norms are the ones the step's non-finite check computes anyway);
* when an optimizer that holds the Pipe's parameters steps (a global pre-step hook), it
  measures what the script did to them since: nothing, one factor on every gradient (how many
  in-place writes each took), or something else; every rank's :class:`Edit` is gathered then
  (one row each, the pipeline group's ``check_edit``) and :func:`check_edits` raises on every
  rank, inside ``optimizer.step()`` and before it changes any weight, when the edits are a
  per-stage clip. The last step of a run is checked as any other.

``clip_grad_norm_`` multiplies every gradient of a rank once, by min(1, max_norm / that rank's
norm): ranks that clip get different factors, and when no stage's own norm reaches
``max_norm`` every rank multiplies by exactly 1 — though the whole model's norm may exceed it.
Either is refused. A rescale that is the same on every rank (dividing by an accumulation count,
a ``GradScaler`` unscaling: ``scale`` is taken out) is the un-split model's and passes, as do
edits that are no rescale (``clip_grad_value_``). Sharded gradients (``Pipe(shard=...)``) are
measured by their norms only: in-place ``foreach`` ops on a ``DTensor`` move no version
counter (torch 2.13), so differing factors are refused but a clip that clipped no stage
cannot be told from no clip (README, Traps).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gpipe.base._utils import gradient_norms, local_value

__all__ = ["ClippedPerStageError", "Edit", "GradientWatch", "check_edits"]

NO_GRADIENTS, UNTOUCHED, SCALED, OTHER = 0, 1, 2, 3


class ClippedPerStageError(RuntimeError):
    """The gradients were clipped (rescaled) per pipeline stage between two steps."""


@dataclass(frozen=True)
class Edit:
    """What the script did to this rank's gradients between a step and the optimizer step."""

    kind: int = NO_GRADIENTS
    factor: float = 1.0  # SCALED: every gradient's factor (a GradScaler's unscaling taken out)
    writes: int = 0  # SCALED: in-place writes per gradient (the scaler's taken out)
    tolerance: float = 0.0  # relative: how well the gradients' dtype measures a factor

    def row(self) -> list[float]:
        return [float(self.kind), self.factor, float(self.writes), self.tolerance]


@dataclass
class _Noted:
    # parameter, its gradient (weakly: a cleared gradient is freed), the gradient's version
    grads: list[tuple[nn.Parameter, weakref.ref, int]]
    norms: torch.Tensor | None
    scale: torch.Tensor | None
    owners: set[int]  # ids of the Pipe's parameters


class GradientWatch:
    """This process's gradients of one Pipe, noted after each step and measured when an
    optimizer holding them steps; ``check(edit)`` gathers every rank's edit and raises
    :class:`ClippedPerStageError` on every rank for a per-stage clip (``check_edit`` of the
    Pipe's ranks)."""

    def __init__(self, check: Callable[[Edit], None]) -> None:
        self._noted: _Noted | None = None
        self._check = check
        this = weakref.ref(self)

        def before_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            watch = this()
            if watch is not None:
                watch._optimizer_steps(optimizer)

        weakref.finalize(self, register_optimizer_step_pre_hook(before_step).remove)

    def note(
        self,
        parameters: Iterable[nn.Parameter],
        norms: torch.Tensor | None,
        scale: torch.Tensor | None,
    ) -> None:
        """The step ended: ``norms`` are the norms of the parameters' gradients, in order
        (those with one); ``scale`` a GradScaler's scale, which its unscaling divides out."""
        parameters = list(parameters)
        grads = [
            (p, weakref.ref(p.grad), local_value(p.grad)._version)
            for p in parameters
            if p.grad is not None
        ]
        self._noted = _Noted(grads, norms, scale, {id(p) for p in parameters})

    def rebase(self) -> None:
        """gpipe edited the gradients itself (``Pipe.clip_grad_norm_``, after any unscaling):
        what the script does from here is measured against them as they are now."""
        noted = self._noted
        if noted is not None and any(p.grad is not None for p, _, _ in noted.grads):
            parameters = [p for p, _, _ in noted.grads if p.grad is not None]
            self.note(parameters, gradient_norms([p.grad for p in parameters]), None)
            self._noted.owners = noted.owners

    def forget(self) -> None:
        """A step begins: what the last one left is no longer the optimizer's to check."""
        self._noted = None

    def _optimizer_steps(self, optimizer: torch.optim.Optimizer) -> None:
        noted = self._noted
        if noted is None or not any(
            id(p) in noted.owners for group in optimizer.param_groups for p in group["params"]
        ):
            return
        # Every rank checks once per step, at its first optimizer holding its parameters; a
        # second optimizer of the same step measures nothing new.
        self._noted = None
        self._check(_measure(noted))


def _measure(noted: _Noted) -> Edit:
    if not noted.grads or noted.norms is None:
        return Edit(NO_GRADIENTS)
    grads = [ref() for _, ref, _ in noted.grads]
    if any(
        grad is None or p.grad is not grad
        for (p, _, _), grad in zip(noted.grads, grads, strict=True)
    ):
        return Edit(OTHER)  # replaced or dropped: no rescale of what the step left
    # A sharded gradient's in-place ops run below autograd and move no version counter:
    # its norms tell what changed, not how many writes (-1: unknown).
    sharded = any(hasattr(grad, "to_local") for grad in grads)
    versions = [v for _, _, v in noted.grads]
    writes = (
        {-1}
        if sharded
        else {local_value(g)._version - v for g, v in zip(grads, versions, strict=True)}
    )
    if writes == {0}:
        return Edit(UNTOUCHED)
    if len(writes) > 1:
        return Edit(OTHER)
    before, after = noted.norms, gradient_norms(grads)
    if noted.scale is not None:  # a GradScaler unscaled them once: take it out
        after = after * noted.scale.to(after.device, torch.float64)
    counted = before > 0
    if bool((after[~counted] != 0).any()) or not bool(counted.any()):
        return Edit(OTHER)
    ratios = after[counted] / before[counted]
    low, high = ratios.min().item(), ratios.max().item()
    # a rescaled gradient is rounded to its dtype, its norm summed in float64: the factor is
    # known to a few of the dtype's eps (or of float64's sums over millions of entries)
    tolerance = max(1e-9, 8 * max(torch.finfo(grad.dtype).eps for grad in grads))
    if not high - low <= tolerance * abs(high):
        return Edit(OTHER)
    scaler_writes = 1 if noted.scale is not None and not sharded else 0
    return Edit(SCALED, high, writes.pop() - scaler_writes, tolerance)


def check_edits(rows: torch.Tensor, describe: Callable[[int], str] = str) -> None:
    """Refuse (on every rank alike: ``rows`` are every rank's :meth:`Edit.row`) a per-stage
    clip: rescales that differ between ranks, or every rank's gradients multiplied by
    exactly 1 once (a norm clip where no stage reached ``max_norm``)."""
    table = rows.tolist()
    scaled = [(rank, factor, writes) for rank, (kind, factor, writes, _) in enumerate(table)
              if kind == SCALED]  # fmt: skip
    informative = [row for row in table if row[0] != NO_GRADIENTS]
    if not scaled:
        return
    factors = [factor for _, factor, _ in scaled]
    tolerance = max(row[3] for row in table)
    differ = max(factors) - min(factors) > tolerance * max(abs(f) for f in factors)
    unchanged = len(scaled) == len(informative) and all(
        factor == 1.0 and writes == 1 for _, factor, writes in scaled
    )
    if not (differ or unchanged):
        return
    found = ", ".join(f"{describe(rank)} by {factor:.6g}" for rank, factor, _ in scaled)
    what = (
        f"scaled per stage ({found})"
        if differ
        else "rewritten unchanged on every rank, as a norm clip leaves them when no stage's own "
        "norm reaches max_norm (the whole model's may)"
    )
    raise ClippedPerStageError(
        f"the optimizer step was refused (no weight changed): since the last step the "
        f"gradients were {what}, and torch.nn.utils.clip_grad_norm_(pipe.parameters(), "
        "max_norm) clips each pipeline stage by its own norm, not the un-split model. Clip with "
        "pipe.clip_grad_norm_(max_norm): the norm of every stage's gradients, on every rank "
        "(with a GradScaler: after scaler.unscale_(optimizer))"
    )
