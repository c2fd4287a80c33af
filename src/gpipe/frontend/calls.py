"""A call of the Pipe (``pipe(x)``) where one of the model would be: inside
``torch.inference_mode()``, and with a backward through its output attempted.

``pipe(x)`` is pipelined inference: the stages run micro-batch by micro-batch without autograd.
It runs under ``torch.inference_mode()`` as under ``torch.no_grad()`` (the engine reads the
version counters of the tensors it keeps, which inference tensors lack, so it runs outside
inference mode; the numbers are the same). Its output has no graph: training is
``pipe.step``, and a backward through the output says so instead of torch's bare "does not
require grad".
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree

from gpipe import microbatch

__all__ = ["joined", "without_autograd"]

_NO_BACKWARD = (
    "pipe(x) runs the stages without autograd (micro-batch by micro-batch), so its output has "
    "no gradient to give; train with loss = pipe.step(inputs, targets, loss_fn), which runs "
    "every micro-batch's backward and leaves the gradients in pipe.parameters()"
)


@contextmanager
def without_autograd():
    """``torch.no_grad()``, outside ``torch.inference_mode()`` if the caller is inside it."""
    with torch.inference_mode(False), torch.no_grad():
        yield


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> tuple:
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        raise RuntimeError(_NO_BACKWARD)


def joined(outputs: list[Any], training: bool) -> Any:
    """The micro-batches' ``outputs`` joined as ``pipe(x)``'s output, whose floating tensors
    raise the remedy when a backward reaches them: in ``train()`` mode with autograd on, where
    a backward is likely meant."""
    output = microbatch.join(outputs)
    if not training or not torch.is_grad_enabled() or output is None:
        return output
    leaves, spec = pytree.tree_flatten(output)
    slots = [
        i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if not slots:
        return output
    anchor = torch.zeros((), requires_grad=True)  # makes the outputs part of a graph
    for i, t in zip(slots, _NoBackward.apply(anchor, *[leaves[i] for i in slots]), strict=True):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)
