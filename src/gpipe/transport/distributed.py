"""The carrier of the frames over the process group's point-to-point (gloo between machines,
NCCL on GPUs): each transfer on the tag of its frame's position, so that on gloo the receive
of a next frame can be posted before the current one has fully arrived without taking its
bytes (NCCL ignores tags and is never asked to). How receives are posted on each backend is
``gpipe.transport.peers``'s docstring. Failure notices outside the sequences go on the group
whatever the carrier (``Board``)."""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpipe.transport.framing import HEAD, NOTICE_BYTES, join, read_head

__all__ = ["Board", "GroupCarrier"]

# Tags: each transport built on a group takes its own range for its frames, above those a
# user's own transfers take (a receive posted ahead must take no other's), and one for
# notices to every peer outside the sequences; the n-th the same on every rank.
_FRAMES, _RANGE, _NOTICE_TAG = 1 << 29, 1 << 20, 1 << 30
_transports_built: dict[tuple[int, ...], int] = {}
_boards_built: dict[tuple[int, ...], int] = {}


class Board:
    """Failure notices to every peer outside the sequences, whatever carries the frames:
    on a gloo group of the pipeline's processes (``group``), with a tag of the transport's
    own. A thread waits for them (a gloo receive tells that it completed only to ``wait()``),
    from the first look on."""

    def __init__(self, group: Any) -> None:
        members = tuple(dist.get_process_group_ranks(group))
        built = _boards_built.get(members, 0)
        _boards_built[members] = built + 1
        self.group, self.tag = group, _NOTICE_TAG + built
        self._heard: list[bytes] | None = None  # notices received, once listening
        self._kept: list[Any] = []  # the notices' sends: alive while they may run

    def heard(self) -> list[bytes]:
        """The notices received so far, without waiting."""
        if self._heard is None:  # one from each peer at most: every receive posted at once
            self._heard = []
            size = dist.get_world_size(self.group)
            frames = [torch.zeros(NOTICE_BYTES, dtype=torch.uint8) for _ in range(size - 1)]
            works = [dist.irecv(f, src=None, group=self.group, tag=self.tag) for f in frames]
            threading.Thread(target=_wait_for_notices, args=(works, frames, self._heard),
                             name="gpipe-failure-notice", daemon=True).start()  # fmt: skip
        return self._heard

    def announce(self, frame: bytes, peers: list[int]) -> None:
        """A notice's frame to every peer of ``peers`` (it may be waiting for another rank,
        or between steps)."""
        tensor = torch.zeros(NOTICE_BYTES, dtype=torch.uint8)
        tensor[: len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        for peer in peers:
            with contextlib.suppress(Exception):  # it left: nobody to tell
                self._kept.append(self.group.send([tensor], peer, self.tag))


class GroupCarrier:
    """Moves the frames of ``gpipe.transport.peers`` through ``torch.distributed``."""

    kind = "group"  # what Pipe.transport says

    def __init__(self, group: Any, device: torch.device, receive_ahead: bool | None) -> None:
        self.group = group
        backend = _backend(group)
        # Collectives of the front end (loss, health check) use a device the backend supports.
        self.wire_device = device if backend == "nccl" else torch.device("cpu")
        self.receive_ahead = receive_ahead if receive_ahead is not None else backend == "gloo"
        self._direct = backend == "gloo"  # no coalescing: every operation posted by itself
        # Heads and descriptions: on the group itself where receiving ahead is safe,
        # otherwise on a gloo side group of the same processes.
        self._meta_group = group if self.receive_ahead else _gloo_twin(group)
        self.meta_device = self.wire_device if self.receive_ahead else torch.device("cpu")
        # Receiving ahead on gloo, the frames to a lower rank travel on a group of their own:
        # a gloo pair's thread takes the incoming bytes only under the pair's lock, which
        # the rank's own sends hold; over one pair both ways, its thread spins while they do
        # (a third of a step's CPU on 1F1B's last stage), over two it has nothing to wait for.
        self._back = _gloo_twin(group) if self.receive_ahead and self._direct else None
        self._rank = dist.get_rank(group)
        members = tuple(dist.get_process_group_ranks(group))
        built = _transports_built.get(members, 0)
        _transports_built[members] = built + 1
        self._tags = _FRAMES + built * _RANGE
        self.notices = Board(self._meta_group)

    def post(
        self, sends: bool, peer: int, position: int, tensors: list[torch.Tensor], data=False
    ) -> list[Any]:
        """Post sends (or receives) of ``tensors`` (a list: the parts of one) of the frame at
        ``position`` with group rank ``peer`` (``data``: tensors of a message, else its head
        or description). One operation, or any number on gloo, goes straight to the process group
        (``torch.distributed``'s wrappers cost more than gloo's own posting for small
        messages); several on NCCL are coalesced into one group call."""
        tag = self._tags + position
        tensors = [join(t) if isinstance(t, list) else t for t in tensors]  # a packed message
        group = self.group if data else self._meta_group
        if self._back is not None and (peer < self._rank) == sends:
            group = self._back  # to a lower rank, or from a higher one
        if len(tensors) <= 1 or self._direct:
            move = group.send if sends else group.recv
            return [move([t], peer, tag) for t in tensors]
        op, glob = dist.isend if sends else dist.irecv, dist.get_global_rank(self.group, peer)
        return dist.batch_isend_irecv([dist.P2POp(op, t, glob, group, tag) for t in tensors])

    def flush(self, seconds: float) -> None:
        pass  # the backend moves what is posted by itself


def _wait_for_notices(works: list[Any], frames: list[torch.Tensor], heard: list[bytes]) -> None:
    for work, frame in zip(works, frames, strict=True):
        try:
            work.wait(timeout=timedelta(days=365))  # until a peer fails or the group goes away
        except Exception:
            return
        _, _, size = read_head(frame)
        heard.append(frame[HEAD : HEAD + size].numpy().tobytes())


def _backend(group: Any) -> str:
    """What every NCCL path here is chosen by (a test names 'nccl' to run them on gloo)."""
    return dist.get_backend(group)


def _gloo_twin(group: Any) -> Any:
    """A gloo group of the same processes, for small host-side messages."""
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
