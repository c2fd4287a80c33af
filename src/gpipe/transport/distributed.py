"""The carrier of the frames over the process group's point-to-point (gloo between machines,
NCCL on GPUs): each transfer on the tag of its frame's position, so that on gloo the receive
of a next frame can be posted before the current one has fully arrived without taking its
bytes (NCCL ignores tags and is never asked to). How receives are posted on each backend is
``gpipe.transport.peers``'s docstring."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gpipe.transport.framing import join

__all__ = ["GroupCarrier"]

# Tags: each transport built on a group takes its own range for its frames, above those a
# user's own transfers take (a receive posted ahead must take no other's); the n-th the same
# on every rank.
_FRAMES, _RANGE = 1 << 29, 1 << 20
_transports_built: dict[tuple[int, ...], int] = {}


class GroupCarrier:
    """Moves the frames of ``gpipe.transport.peers`` through ``torch.distributed``."""

    kind = "group"  # what Pipe.transport says

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.receive_ahead = _backend(group) == "gloo"  # else NCCL's order: peers' docstring
        # Collectives of the front end (loss, health check) use a device the backend supports.
        self.wire_device = torch.device("cpu") if self.receive_ahead else device
        # A gloo group of the same processes. On NCCL it carries the heads and descriptions.
        # On gloo the frames to a lower rank: a gloo pair's thread takes the incoming bytes
        # only under the pair's lock, which the rank's own sends hold; over one pair both
        # ways, its thread spins while they do (a third of a step's CPU on 1F1B's last
        # stage), over two it has nothing to wait for.
        members = tuple(dist.get_process_group_ranks(group))
        self._twin = dist.new_group(members, backend="gloo", use_local_synchronization=True)
        self._rank = dist.get_rank(group)
        built = _transports_built.get(members, 0)
        _transports_built[members] = built + 1
        self._tags = _FRAMES + built * _RANGE

    def post(
        self, sends: bool, peer: int, position: int, tensors: list[torch.Tensor], data=False
    ) -> list[Any]:
        """Post sends (or receives) of ``tensors`` (a list: the parts of one) of the frame at
        ``position`` with group rank ``peer`` (``data``: tensors of a message, else its head
        or description). On gloo, and one operation on NCCL, straight to the process group
        (``torch.distributed``'s wrappers cost more than gloo's own posting for small
        messages); several on NCCL are coalesced into one group call."""
        tag = self._tags + position
        tensors = [join(t) if isinstance(t, list) else t for t in tensors]  # a packed message
        if self.receive_ahead:  # to a lower rank, or from a higher one: on the twin
            group = self._twin if (peer < self._rank) == sends else self.group
        else:
            group = self.group if data else self._twin
        if len(tensors) <= 1 or self.receive_ahead:
            move = group.send if sends else group.recv
            return [move([t], peer, tag) for t in tensors]
        op, glob = dist.isend if sends else dist.irecv, dist.get_global_rank(self.group, peer)
        return dist.batch_isend_irecv([dist.P2POp(op, t, glob, group, tag) for t in tensors])

    def flush(self, seconds: float) -> None:
        pass  # the backend moves what is posted by itself


def _backend(group: Any) -> str:
    """What every NCCL path here is chosen by (a test names 'nccl' to run them on gloo)."""
    return dist.get_backend(group)
