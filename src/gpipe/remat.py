"""Re-materialization state: lets layers know when their forward is being recomputed.

gpipe recomputes a stage's forward right before that micro-batch's backward (see
``gpipe.stage``). Layers with side effects (running statistics, counters, caches) must
not apply them twice; they ask :func:`is_recomputing`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["is_recomputing", "recomputing"]

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
