"""The send thread: it keeps nothing of a completed send and can be closed from anywhere."""

from __future__ import annotations

import weakref

import torch

from gpipe.transport.sender import SendReaper


class _CompletedSend:
    """Stands for a c10d Work of a send that has completed."""

    def wait(self, timeout=None) -> bool:
        return True


def test_send_reaper_keeps_nothing_of_a_completed_send():
    """Sent buffers and the Work go at once; close() ends the thread before it returns.

    A Work still held by the thread at interpreter exit made the process abort there
    ("terminate called without an active exception"), after a job had succeeded.
    """
    reaper = SendReaper(timeout=5.0)
    work, buffer = _CompletedSend(), torch.ones(3)
    kept = [weakref.ref(work), weakref.ref(buffer)]
    reaper.add([work], [buffer], dst=1)
    del work, buffer
    reaper.drain()
    assert [ref() for ref in kept] == [None, None]
    reaper.close()
    assert not reaper._thread.is_alive()


def test_send_reaper_closed_from_its_own_thread_does_not_raise():
    """The garbage collector may finalize a transport in any thread, the reaper's too."""
    reaper = SendReaper(timeout=5.0)
    errors = []

    class ClosesFromInside(_CompletedSend):
        def wait(self, timeout=None) -> bool:
            try:
                reaper.close()
            except Exception as error:  # joining the current thread would raise
                errors.append(error)
            return True

    reaper.add([ClosesFromInside()], [torch.ones(1)], dst=1)
    reaper._thread.join(timeout=5.0)
    assert errors == [] and not reaper._thread.is_alive()
