"""Sends that never block the runtime: a thread waits for each and then frees its buffers."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta

import torch

from gpipe.errors import PipelineError

__all__ = ["SendReaper"]


class SendReaper:
    """Waits for sends in a background thread and drops their buffers once complete."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._queue: queue.Queue = queue.Queue()
        self._errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="gpipe-send-reaper", daemon=True)
        self._thread.start()

    def add(self, works: list, tensors: list[torch.Tensor], dst: int) -> None:
        self._queue.put((works, tensors, dst))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:  # close()
                    return
                self._reap(*item)
            finally:
                # Nothing of a send may outlive it here: a Work object this frame still
                # held at interpreter exit would be freed by a thread Python is shutting
                # down, and its C++ destructor then aborts the process ("terminate called
                # without an active exception").
                del item
                self._queue.task_done()

    def _reap(self, works: list, tensors: list[torch.Tensor], dst: int) -> None:
        """Wait for one message's sends; its buffers go with this frame, once complete."""
        try:
            for work in works:
                work.wait(timeout=timedelta(seconds=self._timeout))
        except Exception as error:
            self._errors.append(f"send to rank {dst} failed: {error}")

    def drain(self, check: Callable[[], None] | None = None, poll: float = 0.05) -> None:
        """Wait until every queued send has completed; ``check`` runs every ``poll``
        seconds meanwhile and may raise to stop waiting (a peer announced a failure)."""
        while True:
            with self._queue.all_tasks_done:
                if not self._queue.unfinished_tasks:
                    break
                self._queue.all_tasks_done.wait(timeout=poll if check is not None else None)
            if check is not None:
                check()
        if self._errors:
            errors, self._errors = self._errors, []
            raise PipelineError("; ".join(errors))

    def abandon(self) -> None:
        """After a failure: stop caring about sends the peers will never receive."""
        self._errors.clear()

    def close(self) -> None:
        """End the thread once the sends queued so far are done (or timed out).

        Joined, so that at interpreter exit (``weakref.finalize`` runs then) the thread
        has finished before Python tears threads down. A send that cannot complete (its
        peer died) is not waited for past a few seconds: the process is failing anyway.
        """
        if self._thread.is_alive():
            self._queue.put(None)
            # The garbage collector may run this finalizer in the thread itself.
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=min(self._timeout, 5.0))
