"""Collectives that wait no longer than the pipeline's timeout, and say which one stopped.

torch.distributed bounds a collective by its process group's timeout (torch's default: 30
minutes). A pipeline promises its own ``timeout``, so every collective outside the schedule
goes through :class:`Collectives`: started with that timeout in its options (the backend
then ends the operation itself: no abandoned collective stays in flight, to hang the group's
destruction at exit) and waited for as long, on gloo and NCCL alike. One that fails raises a
:class:`~gpipe.base.errors.PipelineError` naming the operation, what this rank was doing,
the rank that caused it (``gpipe.transport.inquest``) and the remedy.

Values travel as bytes in tensors, never pickled (``gpipe.transport.codec``): torch's own
``all_gather_object`` unpickles what peers send, and takes no timeout.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # not re-exported by dist

from gpipe.base.errors import PipelineError
from gpipe.transport.codec import decode, encode
from gpipe.transport.inquest import failure

__all__ = ["Collectives"]

# The backend's worker thread (gloo's) lets go of a collective's work a moment after wait()
# returns. Had Python dropped its own reference first, that thread frees the work's tensors,
# which takes the GIL; at interpreter exit, a thread that takes the GIL is stopped inside
# torch's C++ code, which aborts the process ("terminate called without an active
# exception", seen at the exit of ranks after a failed step). The latest works stay
# referenced here, so that Python's own thread frees them.
_recent: deque[Any] = deque(maxlen=32)


class Collectives:
    """The collectives of one process group, each bounded by ``timeout`` seconds.

    ``device``: where the backend takes tensors (this rank's GPU on NCCL, the CPU on gloo).
    Each method takes ``operation``, the name an error gives it ("clip_grad_norm_
    all-reduce"), and ``doing``, what this rank was doing ("step 3"), when known.
    """

    def __init__(self, group: Any, *, timeout: float, device: torch.device | str = "cpu") -> None:
        self.group = group
        self.timeout = timeout
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def wait(self, operation: str, start: Callable[[], Any], *, doing: str = "") -> None:
        """Run ``start()`` (which starts collectives and returns their work, or a list of
        them) and wait for it, within the timeout."""
        began = time.monotonic()
        try:
            works = start()
            works = list(works) if isinstance(works, Sequence) else [works]
            _recent.extend(works)
            for work in works:
                # A second more than the operation's own timeout, which ends it (see above)
                left = self.timeout + 1.0 - (time.monotonic() - began)
                work.wait(timeout=timedelta(seconds=max(left, 0.001)))
        except Exception as error:
            timed_out = time.monotonic() - began >= self.timeout * 0.99
            raise self.error(operation, error, doing=doing, timed_out=timed_out) from error

    def error(
        self,
        operation: str,
        error: BaseException,
        *,
        doing: str = "",
        timed_out: bool | None = None,
    ) -> PipelineError:
        """The error of a collective that did not complete: what, who (the rank that caused
        it: ``gpipe.transport.inquest.failure``), and what to do (``timed_out``: unless the
        error says)."""
        others = [r for r in range(self.size) if r != self.rank]
        return failure(self.group, self.rank, others, operation, error, timeout=self.timeout,
                       doing=doing, timed_out=timed_out)  # fmt: skip

    # -- tensors ------------------------------------------------------------------------------

    def start_all_reduce(self, tensor: torch.Tensor, *, maximum: bool = False) -> Any:
        """Start summing (or maxing) ``tensor`` (on :attr:`device`) over the group, in place;
        its work."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM
        options.timeout = timedelta(seconds=self.timeout)
        return self.group.allreduce([tensor], options)

    def all_reduce(
        self, tensor: torch.Tensor, operation: str, *, maximum: bool = False, doing: str = ""
    ) -> torch.Tensor:
        """The sum (or max) of ``tensor`` over the group, on ``tensor``'s device."""
        wire = tensor.to(self.device, copy=True)
        self.wait(operation, lambda: self.start_all_reduce(wire, maximum=maximum), doing=doing)
        return wire.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor, operation: str, *, doing: str = "") -> torch.Tensor:
        """Every rank's ``tensor``, stacked by group rank, on ``tensor``'s device.

        For a few numbers from each rank, cheaper than an all-reduce of a table each rank
        fills one row of: gloo all-reduces more than a couple of elements in a ring of
        chunks, 1.2–1.7 ms for 14 float64s on two ranks here against 0.5–0.6 ms to gather
        them (``benchmarks/runtime_cost.py``'s breakdown).
        """
        wire = tensor.to(self.device).contiguous()
        rows = [torch.empty_like(wire) for _ in range(self.size)]
        options = AllgatherOptions()
        options.timeout = timedelta(seconds=self.timeout)
        self.wait(operation, lambda: self.group.allgather([rows], [wire], options), doing=doing)
        return torch.stack(rows).to(tensor.device)

    def broadcast(
        self, tensor: torch.Tensor, operation: str, *, src: int = 0, doing: str = ""
    ) -> torch.Tensor:
        """Group rank ``src``'s ``tensor`` on every rank, on ``tensor``'s device."""
        wire = tensor.to(self.device, copy=True)
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        options.timeout = timedelta(seconds=self.timeout)
        self.wait(operation, lambda: self.group.broadcast([wire], options), doing=doing)
        return wire.to(tensor.device)

    def barrier(self, operation: str, *, doing: str = "") -> None:
        """Wait until every rank has arrived here (an all-reduce of one number)."""
        self.all_reduce(torch.zeros(1), operation, doing=doing)

    # -- objects ------------------------------------------------------------------------------

    def all_gather_object(self, value: Any, operation: str, *, doing: str = "") -> list[Any]:
        """Every rank's ``value`` (plain data: ``gpipe.transport.codec``), by group rank.

        Each rank writes its bytes into its own slice of a zeroed buffer and the buffers
        are summed: an all-reduce, whose options carry a timeout on every backend.
        """
        data = torch.frombuffer(bytearray(encode(value, operation)), dtype=torch.uint8)
        sizes = torch.zeros(self.size, dtype=torch.int64)
        sizes[self.rank] = len(data)
        sizes = self.all_reduce(sizes, operation, doing=doing)
        width = int(sizes.max())
        slices = torch.zeros(self.size, width, dtype=torch.uint8)
        slices[self.rank, : len(data)] = data
        slices = self.all_reduce(slices, operation, doing=doing)
        return [
            decode(row[: int(size)].numpy().tobytes())
            for row, size in zip(slices, sizes, strict=True)
        ]

    def broadcast_object(self, value: Any, operation: str, *, src: int = 0, doing: str = "") -> Any:
        """Group rank ``src``'s ``value`` (plain data: ``gpipe.transport.codec``) on every
        rank (the other ranks' ``value`` is not sent)."""
        mine = value if self.rank == src else None
        return self.all_gather_object(mine, operation, doing=doing)[src]
