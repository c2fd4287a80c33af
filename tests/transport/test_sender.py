"""Sends in flight: waited for only once their receives are posted (acknowledged, or after
the step's agreement), and nothing of a completed send kept."""

from __future__ import annotations

import weakref

import torch

from gpipe.transport.sender import Outbox


class _Send:
    """Stands for a c10d Work of a send; records when it was waited for."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait(self, timeout=None) -> bool:
        self.log.append(self.name)
        return True


def test_acknowledged_sends_are_waited_for_in_order_and_their_buffers_freed():
    log: list[str] = []
    outbox = Outbox(timeout=5.0)
    buffers = [torch.ones(3) for _ in range(3)]
    kept = [weakref.ref(b) for b in buffers]
    for position, buffer in enumerate(buffers):
        outbox.add(1, position, [_Send(log, f"to 1 #{position}")], [buffer])
    outbox.add(2, 0, [_Send(log, "to 2 #0")], [torch.ones(1)])
    del buffers, buffer
    outbox.acknowledged(1, posted=2)  # rank 1 posted the receives of messages 0 and 1
    assert log == ["to 1 #0", "to 1 #1"] and len(outbox) == 2
    assert [ref() is None for ref in kept] == [True, True, False]
    outbox.acknowledged(1, posted=2)  # nothing new
    assert len(log) == 2
    outbox.settle()  # after the agreement: every send's receive is posted
    assert log[2:] == ["to 1 #2", "to 2 #0"] and len(outbox) == 0
    assert kept[2]() is None


def test_a_failed_steps_sends_are_dropped_without_waiting_and_kept_alive():
    log: list[str] = []
    outbox = Outbox(timeout=5.0)
    work = _Send(log, "never received")
    kept = weakref.ref(work)
    outbox.add(1, 0, [work], [torch.ones(1)])
    del work
    outbox.abandon()
    outbox.settle()
    assert log == [] and len(outbox) == 0
    assert kept() is not None  # a transfer that may still run keeps its buffer
