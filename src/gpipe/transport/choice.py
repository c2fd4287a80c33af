"""Which carrier moves a pipeline's messages between processes: same-host sockets where every
rank's stages are CPU stages of one machine on gloo and the user did not say otherwise, else
the process group's own point-to-point (gloo between machines, NCCL on GPUs). The ranks
decide together (``gpipe.transport.handshake.links``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpipe.schedule.routes import Routes
from gpipe.transport import handshake
from gpipe.transport.distributed import GroupCarrier
from gpipe.transport.peers import PeerTransport
from gpipe.transport.sockets import SocketCarrier

__all__ = ["TRANSPORTS", "check_choice", "open_transport"]

TRANSPORTS = ("auto", "sockets", "group")


def check_choice(transport: str, receive_ahead: bool | None) -> None:
    """Refuse a ``Pipe(transport=..., receive_ahead=...)`` that names no carrier."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "sockets" and receive_ahead is False:
        raise ValueError(
            "receive_ahead=False posts receives in NCCL's order, which only the process "
            "group's transport does; use transport='group' (or 'auto') with it"
        )


def open_transport(
    schedule: Any,
    rank: int,
    group: Any,
    devices: list[torch.device],
    *,
    routes: Routes,
    timeout: float,
    wanted: str,
    receive_ahead: bool | None,
    gather: Callable[[Any, str], list[Any]],
) -> PeerTransport:
    """This rank's transport (``devices``: each stage's; ``gather``: one bounded all-gather
    of the group, through which every rank takes part in the choice)."""
    import torch.distributed as dist

    # NCCL's order on gloo (receive_ahead=False) is the group's transport's alone.
    wanted = "group" if receive_ahead is False else wanted
    mine = [devices[s] for s in schedule.stages_of(rank)]
    on_cpu = dist.get_backend(group) == "gloo" and all(d.type == "cpu" for d in mine)
    size = dist.get_world_size(group)
    links = handshake.links(wanted, on_cpu, rank, size, timeout, gather)
    if links is not None:
        carrier: Any = SocketCarrier(links, timeout)
    else:
        carrier = GroupCarrier(group, mine[0], receive_ahead)
    return PeerTransport(schedule, rank, group, devices, carrier, timeout=timeout, routes=routes)
