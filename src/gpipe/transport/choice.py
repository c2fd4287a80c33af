"""Which carrier moves a pipeline's messages between processes: same-host sockets
(``gpipe.transport.handshake`` connects them) where every rank's stages are CPU stages of one
machine on gloo and the user did not say otherwise, else the process group's own
point-to-point (gloo between machines, NCCL on GPUs). The ranks decide together, and sockets
that should form but do not are never a silent switch."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gpipe.base.errors import PartitionError, PipelineError
from gpipe.schedule.routes import Routes
from gpipe.transport import handshake
from gpipe.transport.distributed import GroupCarrier
from gpipe.transport.peers import PeerTransport
from gpipe.transport.sockets import SocketCarrier

__all__ = ["TRANSPORTS", "check_choice", "open_transport"]

TRANSPORTS = ("auto", "sockets", "group")
_log = logging.getLogger(__name__)


def check_choice(transport: str) -> None:
    """Refuse a ``Pipe(transport=...)`` that names no carrier."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def open_transport(
    schedule: Any,
    rank: int,
    group: Any,
    devices: list[torch.device],
    *,
    routes: Routes,
    timeout: float,
    wanted: str,
    gather: Callable[[Any, str], list[Any]],
) -> PeerTransport:
    """This rank's transport (``devices``: each stage's; ``gather``: one bounded all-gather
    of the group, through which every rank takes part in the choice)."""
    mine = [devices[s] for s in schedule.stages_of(rank)]
    on_cpu = dist.get_backend(group) == "gloo" and all(d.type == "cpu" for d in mine)
    size = dist.get_world_size(group)
    # Every rank was told the same (the Pipe's configuration, checked): all ask, or none.
    links = None if wanted == "group" else _sockets(wanted, on_cpu, rank, size, timeout, gather)
    carrier = GroupCarrier(group, mine[0]) if links is None else SocketCarrier(links, timeout)
    return PeerTransport(schedule, rank, group, devices, carrier, timeout=timeout, routes=routes)


def _sockets(
    wanted: str,
    on_cpu: bool,
    rank: int,
    num_ranks: int,
    timeout: float,
    gather: Callable[[Any, str], list[Any]],
) -> dict[int, socket.socket] | None:
    """A Unix socket to every peer where the pipeline can use them (``wanted``: 'auto' or
    'sockets'; where: the module's docstring), else None: the process group carries them."""
    where: Any = "has stages off the CPU or a group off gloo"  # or the machine, if it can
    listener, address, token = None, "", b""
    if on_cpu:
        where = handshake.host_key() or "has no abstract Unix sockets (not Linux)"
    if not isinstance(where, str):
        try:
            listener, address, token = handshake.listen(num_ranks)
        except OSError as error:
            where = f"cannot open a Unix socket here ({error})"
    formed, failed = {}, ""
    with listener or contextlib.nullcontext():  # closed by connect too; else by nobody
        everyone = gather((where, address, token), "where each rank runs")
        unavailable = [
            f"rank {r} " + (w if isinstance(w, str) else "runs elsewhere")
            for r, (w, _, _) in enumerate(everyone)
            if isinstance(w, str) or w != everyone[0][0]
        ]
        if unavailable:  # every rank read the same gather: none connects
            if wanted == "sockets":
                raise PartitionError(
                    "transport='sockets' needs every rank of the pipeline on one machine, its "
                    "stages on the CPU and the group on gloo: "
                    + "; ".join(dict.fromkeys(unavailable))
                    + "; use transport='auto' or 'group'"
                )
            if rank == 0:
                _log.info("transport='auto' uses the process group: %s", "; ".join(unavailable))
            return None
        try:
            formed = handshake.connect(listener, [e[1:] for e in everyone], rank, timeout)
        except OSError as error:
            failed = f"rank {rank} could not connect its sockets: {error}"
    failures = [f for f in gather(failed, "the socket connections") if f]
    if failures:  # on one machine, sockets that should work did not: never a silent switch
        for link in formed.values():
            link.close()
        raise PipelineError(
            f"rank {rank}: the same-host sockets did not form: {'; '.join(failures)}; if a "
            "process not of this job connected, find it (its pid); or use transport='group'"
        )
    return formed
