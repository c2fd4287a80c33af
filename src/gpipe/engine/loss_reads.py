"""The last stage's loss: it must reach the model, and what it may read besides the outputs.

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
from collections.abc import Iterable
from typing import Any

import torch

from gpipe._utils import tensors_of
from gpipe.engine.split_backward import leaves_below
from gpipe.errors import PartitionError

__all__ = ["ForeignParameters", "check_loss"]


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
