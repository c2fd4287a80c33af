"""Sends in flight: kept until the receiver has posted their receives, then waited for at no
cost, so that no thread has to wait for them.

A gloo send completes only once its receive is posted, and its ``Work`` tells so only to
``wait()``, which blocks until then. Waiting at once would stall the sender; waiting on a
thread costs a hand-off per message. So the receiver says, in the header of each message
it sends back, how many of this rank's messages of the step it has posted receives for
(:class:`Outbox` ``acknowledged``): those sends complete without waiting on anyone, and
their buffers are freed then. What no message acknowledges (the step's last ones) is waited
for after the step's agreement, an all-reduce that no rank enters before it has received
every message of the step (:meth:`Outbox.settle`).
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Any

import torch

__all__ = ["Outbox"]


class Outbox:
    """Each peer's sends of this step, in wire order, with their buffers."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timedelta(seconds=timeout)
        self._pending: dict[int, deque[tuple[int, list[Any], list[torch.Tensor]]]] = {}
        # Sends of a failed step, never waited for: kept (a gloo buffer must not be freed
        # while its transfer may still run) until the transport goes.
        self._abandoned: list[Any] = []

    def add(self, dst: int, position: int, works: list[Any], buffers: list[torch.Tensor]) -> None:
        self._pending.setdefault(dst, deque()).append((position, works, buffers))

    def acknowledged(self, dst: int, posted: int) -> None:
        """``dst`` has posted the receives of this rank's first ``posted`` messages of the
        step: their sends complete without waiting on it; free their buffers."""
        pending = self._pending.get(dst)
        while pending and pending[0][0] < posted:
            _, works, _ = pending.popleft()
            for work in works:
                work.wait(timeout=self._timeout)

    def settle(self) -> None:
        """Wait for every send of the step: call once every rank has received all of its
        messages (after the step's agreement), when none can block."""
        for dst in list(self._pending):
            self.acknowledged(dst, posted=1 << 62)
        self._pending.clear()

    def abandon(self) -> None:
        """After a failure: drop the step's sends without waiting (a peer may never take
        them), keeping their works alive."""
        for pending in self._pending.values():
            self._abandoned += [(works, buffers) for _, works, buffers in pending]
        self._pending.clear()

    def __len__(self) -> int:
        return sum(len(p) for p in self._pending.values())
