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
planner) asks it. How a micro-batch is recomputed is ``Pipe(checkpoint_layers=...)``'s: the
whole stage at once (None), or a few layers at a time (``gpipe.engine.stage``).

Module state a forward reads and writes (buffers: spectral norm's vectors, a moving average,
a counter) needs nothing from the layer: the stage restores the buffers its first forward
found before recomputing, replays that layer as its first forward (:func:`replaying`:
:func:`is_recomputing` is False inside it) and puts the later buffers back
(``gpipe.engine.state``). Side effects outside module buffers (a Python counter, a log)
must not be applied twice; such layers ask :func:`is_recomputing`.

The first forward of a recomputed micro-batch runs without autograd, the recomputation
with it. A few kernels choose another algorithm without autograd (scaled dot-product
attention with a float mask, e.g. T5's position bias, picks another backend), so the two
can differ in the last bits, and the gradients with them, by rounding: about 5e-7
relative in float32 was measured for T5, against 2e-7 from micro-batching alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Literal

__all__ = [
    "REMAT_MODES",
    "Remat",
    "check_mode",
    "is_recomputing",
    "recompute_fraction",
    "recomputes",
    "recomputing",
    "rematerializing",
    "replaying",
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
    """True while gpipe re-runs a forward to rebuild activations for backward, except in a
    layer whose buffers gpipe restored for it (that layer runs as its first forward did).

    For side effects outside module buffers, which must happen once per micro-batch::

        class Logged(nn.Module):
            def forward(self, x):
                if not gpipe.is_recomputing():
                    self.seen.append(x.shape[0])  # a Python list: gpipe cannot restore it
                return x

    Buffers need no check: a buffer the forward updates (``self.calls += 1``) is restored
    before the recomputation and updated once per micro-batch.
    """
    return getattr(_state, "recomputing", False) and not getattr(_state, "replaying", False)


def rematerializing() -> bool:
    """True during any recomputation, replayed layers included: for state that gpipe does
    not restore (``DeferredBatchNorm``'s accumulators are Python attributes)."""
    return getattr(_state, "recomputing", False)


def recomputing() -> AbstractContextManager[None]:
    """Mark the enclosed code (in this thread) as a recomputation."""
    return _marked("recomputing")


def replaying() -> AbstractContextManager[None]:
    """Mark the enclosed layer as replayed: its buffers are as its first forward found
    them, so it runs as that forward did (:func:`is_recomputing` is False inside)."""
    return _marked("replaying")


@contextmanager
def _marked(flag: str) -> Iterator[None]:
    previous = getattr(_state, flag, False)
    setattr(_state, flag, True)
    try:
        yield
    finally:
        setattr(_state, flag, previous)
