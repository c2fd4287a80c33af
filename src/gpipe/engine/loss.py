"""The last stage's loss: each micro-batch's share of the mini-batch's (:class:`LossSpec`,
:func:`loss_specs`), and what it may read.

The loss is part of the last stage. A loss that does not require grad (detached, computed
under ``no_grad``) would train nothing: refused. Besides the stage's outputs and the targets
it may read the last stage's own parameters and tensors of its own — a learnable temperature,
a criterion with parameters (``nn.AdaptiveLogSoftmaxWithLoss``): autograd reaches them from
the loss, and the stage's backward accumulates their gradients as the plain model's does,
split (``gpipe.engine.split_backward`` finds every leaf the graph reaches) or not. Give them
to the optimizer as you would without gpipe.

A parameter of *another* stage is different: across processes, the last stage's rank holds
at best a copy that is never trained, and the gradient the loss gives it never reaches the
stage that owns it (a regularizer over the model's weights inside ``loss_fn`` trained
another model, 0.8 off per parameter). gpipe refuses it before any backward, in one process
too, so that a script behaves alike in one process and in many.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gpipe.base import microbatch
from gpipe.base._utils import tensors_of, to_device
from gpipe.base.errors import PartitionError
from gpipe.engine.split_backward import leaves_below
from gpipe.losses import TokenCrossEntropy

__all__ = [
    "ForeignParameters",
    "LossSpec",
    "check_batch",
    "check_loss",
    "compute_loss",
    "loss_specs",
]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class LossSpec:
    """What the last stage needs to turn a micro-batch's output into its loss.

    ``weight`` is this micro-batch's share of the mini-batch loss, known on the host. A
    token loss of ``gpipe.losses`` comes with ``divisor`` instead: its sum over the
    micro-batch is divided by the mini-batch's count, a tensor on the last stage's device,
    so that no count is read before the step, and a micro-batch where no token counts
    adds an exact zero.
    """

    loss_fn: LossFn
    target: Any
    weight: float = 1.0
    scale: torch.Tensor | None = None  # a GradScaler's: backward runs from loss * scale
    divisor: torch.Tensor | None = None


def loss_specs(
    loss_fn: LossFn,
    targets_mb: list[Any],
    inputs_mb: list[Any] | None,
    *,
    reduction: str,
    count: Callable[[Any], Any] | None,
    device: torch.device,
    scale: torch.Tensor | None = None,
) -> list[LossSpec]:
    """The last stage's loss for each micro-batch, weighted so that the gradients add up
    to the mini-batch loss's (see ``Pipe.step`` for ``reduction`` and ``count``)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if count is not None and reduction != "mean":
        raise ValueError("count= weighs the micro-batches' means: use reduction='mean'")
    sizes = [microbatch.batch_size(y, name="targets") for y in targets_mb]
    if inputs_mb is not None:
        input_sizes = [microbatch.batch_size(x, name="inputs") for x in inputs_mb]
        if input_sizes != sizes:
            raise ValueError(
                f"inputs and targets have different batch sizes "
                f"({sum(input_sizes)} and {sum(sizes)}); give one target per sample"
            )
    targets_mb = [to_device(y, device) for y in targets_mb]
    if isinstance(loss_fn, TokenCrossEntropy) and count == loss_fn.count:
        # Nothing counts in the whole mini-batch: 0/0, a NaN loss, and the step is refused.
        total = torch.stack([loss_fn.count(y) for y in targets_mb]).sum()
        return [LossSpec(loss_fn.summed, y, scale=scale, divisor=total) for y in targets_mb]
    if count is None:
        shares = [float(n) for n in sizes]
    else:  # one read of the host for all the counts
        shares = torch.stack(
            [torch.as_tensor(count(y)).to(device, torch.float64) for y in targets_mb]
        ).tolist()
    if any(not c >= 0 for c in shares) or not sum(shares) > 0:
        raise ValueError(
            f"count(target) must be >= 0 for each micro-batch and > 0 in all, got {shares}: "
            "it counts what loss_fn averages over (e.g. the tokens that are not padding)"
        )
    total = sum(shares)
    return [
        LossSpec(loss_fn, y, n / total if reduction == "mean" else 1.0, scale=scale)
        for y, n in zip(targets_mb, shares, strict=True)
    ]


def check_batch(losses: list[LossSpec], inputs: int) -> None:
    """The targets (on the last stage's rank) describe the inputs' mini-batch (the first's)."""
    targets = sum(microbatch.batch_size(spec.target) for spec in losses)
    if targets != inputs:
        raise ValueError(
            f"the targets hold {targets} samples but the inputs on the first stage's rank "
            f"{inputs}: every rank must step the same mini-batch (one target per sample)"
        )


def compute_loss(spec: LossSpec, outputs: Any) -> torch.Tensor:
    loss = spec.loss_fn(outputs, spec.target)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return a scalar tensor, got {shape}; reduce it inside loss_fn "
            "(reduction='mean' or 'sum') and tell Pipe.step which one with reduction=..."
        )
    return loss


class ForeignParameters:
    """The parameters of the model's other stages, as this process sees them (the copies of
    the layers other ranks hold included; meta tensors left out: nothing reads those), by
    name. Held weakly: the model's other layers may go."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
        self._by_id = {
            id(p): (weakref.ref(p), name) for name, p in named if p.requires_grad and not p.is_meta
        }

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def name_of(self, tensor: torch.Tensor) -> str | None:
        entry = self._by_id.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None


def check_loss(loss: torch.Tensor, stage: Any, outputs: Any, inputs: Any) -> None:
    """With autograd on: the last ``stage``'s loss of its ``outputs`` (its ``inputs``) reaches
    the model, and reads no parameter of another stage (``stage.foreign``)."""
    if not loss.requires_grad:
        if stage.needs_grad(inputs):
            raise RuntimeError(
                "loss_fn returned a loss that does not require grad (detached, or computed "
                "under no_grad), so no gradient would reach the model; return the loss "
                "tensor as computed from the output"
            )
        return
    foreign = stage.foreign
    if not foreign:
        return
    outputs = tensors_of(stage.value_of(outputs))
    found = [(leaf, foreign.name_of(leaf)) for leaf in leaves_below([loss], outputs)]
    found = [(leaf, name) for leaf, name in found if name is not None]
    if not found:
        return
    mine = {id(p) for p in stage.parameters()}  # a tied weight's tensor may sit in both
    names = [name for leaf, name in found if id(leaf) not in mine]
    if names:  # the cut put them away from the loss: a configuration, like any other cut's
        raise PartitionError(
            f"loss_fn reads {', '.join(sorted(names))}, which the last stage ({stage.index}) "
            "does not hold: across processes that is an untrained copy, so gpipe refuses it "
            "everywhere; compute the term in the stage that holds the parameter (a layer "
            "there returns it with its output, and loss_fn adds it), or move the parameter "
            "to the last stage (balance=...). The loss's own tensors (a learnable "
            "temperature, an nn.Module criterion) are fine"
        )
