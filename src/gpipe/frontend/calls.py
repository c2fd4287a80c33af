"""A call of the Pipe (``pipe(x)``) inside ``torch.inference_mode()``.

Pipelined inference runs the stages micro-batch by micro-batch without autograd. It runs under
``torch.inference_mode()`` as under ``torch.no_grad()``: the engine reads the version counters
of the tensors it keeps, which inference tensors lack, so it runs outside inference mode (the
numbers are the same). In training mode with autograd on, ``pipe(x)`` is connected to autograd
instead (``gpipe.pipe.through_output``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["without_autograd"]


@contextmanager
def without_autograd():
    """``torch.no_grad()``, outside ``torch.inference_mode()`` if the caller is inside it."""
    with torch.inference_mode(False), torch.no_grad():
        yield
