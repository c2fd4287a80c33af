"""Re-materialization: which micro-batches recompute their forward, and when one is.

A stage that re-materializes a micro-batch keeps only its boundary input during the
forward and runs the forward again right before that micro-batch's backward (see
``gpipe.engine.stage``). The public option is ``Pipe(checkpoint=...)`` (GPipe's and
torchgpipe's word); inside gpipe it is called *remat*, and "checkpoint" means saved
training state only. The modes:

============== =========================================================
``"always"``    every micro-batch recomputes
``"except_last"`` every micro-batch but the last, whose backward follows its
                forward at once in every schedule's drain (default)
``"never"``     none: each stage keeps the whole autograd graph of every
                micro-batch until its backward
============== =========================================================

:func:`recomputes` is that table; everything else (the engine, the memory model, the
planner) asks it. Layers with side effects (running statistics, counters, caches) must
not apply them twice; they ask :func:`is_recomputing`.

The first forward of a recomputed micro-batch runs without autograd, the recomputation
with it. A few kernels choose another algorithm without autograd (scaled dot-product
attention with a float mask, e.g. T5's position bias, picks another backend), so the two
can differ in the last bits, and the gradients with them, by rounding: about 5e-7
relative in float32 was measured for T5, against 2e-7 from micro-batching alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

__all__ = [
    "REMAT_MODES",
    "Remat",
    "check_mode",
    "is_recomputing",
    "recompute_fraction",
    "recomputes",
    "recomputing",
]

Remat = Literal["always", "except_last", "never"]
REMAT_MODES: tuple[Remat, ...] = ("always", "except_last", "never")


def check_mode(mode: object) -> None:
    """Raise ``ValueError`` naming the modes unless ``mode`` is one of them."""
    if mode not in REMAT_MODES:
        raise ValueError(f"checkpoint must be one of {', '.join(REMAT_MODES)}, got {mode!r}")


def recomputes(mode: Remat, microbatch: int, chunks: int) -> bool:
    """Whether ``microbatch`` (of ``chunks``) runs its forward twice under ``mode``."""
    check_mode(mode)
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch < chunks - 1
    return False


def recompute_fraction(mode: Remat, chunks: int) -> float:
    """Share of micro-batches whose forward runs twice."""
    return sum(recomputes(mode, m, chunks) for m in range(chunks)) / chunks


_state = threading.local()


def is_recomputing() -> bool:
    """True while gpipe re-runs a forward to rebuild activations for backward.

    Example::

        class Counter(nn.Module):
            def forward(self, x):
                if not gpipe.is_recomputing():
                    self.calls += 1
                return x
    """
    return getattr(_state, "recomputing", False)


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark the enclosed code (in this thread) as a recomputation."""
    previous = is_recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous
