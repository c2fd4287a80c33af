"""Which carrier moves a pipeline's messages between processes, and how the ranks of one
machine connect their sockets, and who may.

Same-host sockets (``gpipe.transport.sockets``) where every rank's stages are CPU stages of
one machine on gloo and the user did not say otherwise, else the process group's own
point-to-point (gloo between machines, NCCL on GPUs). The ranks decide together, and sockets
that should form but do not are never a silent switch.

The sockets are abstract Unix sockets: no file, no permission bits, and their names are
listed in ``/proc/net/unix`` for anyone to see. So a rank's listener takes a connection only
from a process of the same user (``SO_PEERCRED``) that presents the listener's token: 32
random bytes shared with the other ranks through the process group's own all-gather (never
through the job's store, which anyone who reaches its port can read), compared in constant
time. Anything else is closed and reported (a warning naming its user and process), and the
listener keeps waiting for its genuine peers within the timeout: a stranger cannot take a
rank's place, nor change the transport. If the peers do not all connect, the build fails,
naming the strangers.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import socket
import struct
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gpipe.base.errors import PartitionError, PipelineError
from gpipe.schedule.routes import Routes
from gpipe.transport.distributed import GroupCarrier
from gpipe.transport.peers import PeerTransport
from gpipe.transport.sockets import SocketCarrier

__all__ = ["TRANSPORTS", "check_choice", "connect", "host_key", "listen", "open_transport"]

TRANSPORTS = ("auto", "sockets", "group")
_log = logging.getLogger(__name__)
_HELLO = struct.Struct("<q32s")  # the caller's rank, the listener's token
_BUFFER = 4 << 20  # bytes of kernel buffer asked for each way (the system may cap it)
Gather = Callable[[Any, str], list[Any]]  # a bounded all-gather of the group: (value, what)


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
    gather: Gather,
) -> PeerTransport:
    """This rank's transport (``devices``: each stage's; ``gather``: one bounded all-gather
    of the group, through which every rank takes part in the choice)."""
    mine = [devices[s] for s in schedule.stages_of(rank)]
    on_cpu = dist.get_backend(group) == "gloo" and all(d.type == "cpu" for d in mine)
    # Every rank was told the same (the Pipe's configuration, checked): all ask, or none.
    links = None if wanted == "group" else _sockets(wanted, on_cpu, rank, timeout, gather)
    carrier = GroupCarrier(group, mine[0]) if links is None else SocketCarrier(links, timeout)
    return PeerTransport(schedule, rank, group, devices, carrier, timeout=timeout, routes=routes)


def _sockets(
    wanted: str, on_cpu: bool, rank: int, timeout: float, gather: Gather
) -> dict[int, socket.socket] | None:
    """A Unix socket to every peer where the pipeline can use them (``wanted``: 'auto' or
    'sockets'; where: the module's docstring), else None: the process group carries them."""
    # The machine this rank runs on, or why it cannot take part in sockets.
    where: Any = host_key() if on_cpu else "has stages off the CPU or a group off gloo"
    where = where or "has no abstract Unix sockets (not Linux)"
    listener, address, token = None, "", b""
    if not isinstance(where, str):
        try:
            listener, address, token = listen()
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
            formed = connect(listener, [e[1:] for e in everyone], rank, timeout)
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


def host_key() -> tuple[str, ...] | None:
    """What processes must share to reach each other's abstract Unix sockets: the machine
    (host name and boot) and the network namespace; None where there are none (not Linux,
    whose ``/proc`` alone tells them).
    ``GPIPE_TEST_HOST`` is a testing aid: ranks given different values believe they run on
    different machines (the suite runs two "nodes" on one host over the process group)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return (socket.gethostname(), boot_id, str(namespace), os.environ.get("GPIPE_TEST_HOST", ""))


def listen() -> tuple[socket.socket, str, bytes]:
    """A listening socket for this rank's peers, its (abstract) address, and its token.
    The backlog is the system's largest, so that strangers calling do not fill it."""
    address = f"\0gpipe/{secrets.token_hex(16)}"  # public: not the token
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    return listener, address, secrets.token_bytes(32)


def connect(
    listener: socket.socket, peers: list[tuple[str, bytes]], rank: int, timeout: float
) -> dict[int, socket.socket]:
    """Connect this rank with every other (``peers``: each rank's address and token): it
    calls every lower rank's listener, and takes the calls of the higher ones, each of which
    says its rank and this listener's token. Raises ``ConnectionError`` naming the strangers
    if strangers called and the peers did not all, ``OSError`` if that does not complete
    within ``timeout`` seconds for another reason."""
    links: dict[int, socket.socket] = {}
    strangers: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        for peer in range(rank):
            link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            links[peer] = link  # closed with the others if this fails
            link.settimeout(max(deadline - time.monotonic(), 0.001))
            link.connect(peers[peer][0])  # its backlog is the system's largest: never full
            if (stranger := _who(link)[1]) is not None:  # the name was taken before ours
                raise ConnectionError(f"rank {peer}'s socket is held by {stranger}")
            link.sendall(_HELLO.pack(rank, peers[peer][1]))
        while len(links) < len(peers) - 1:
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                link, _ = listener.accept()
            except TimeoutError as error:
                if strangers:
                    raise ConnectionError(
                        f"rank {rank} refused connections to its socket from processes not of "
                        f"this job ({'; '.join(strangers)}), and its peers did not all connect"
                    ) from error
                raise
            peer = _hello(link, peers[rank][1], rank, len(peers), deadline)
            if isinstance(peer, str) or peer in links:
                stranger = peer if isinstance(peer, str) else f"a second rank {peer}"
                strangers.append(stranger)
                warnings.warn(f"gpipe: rank {rank} refused a connection to its socket from "
                              f"{stranger}", RuntimeWarning, stacklevel=2)  # fmt: skip
                link.close()
                continue
            links[peer] = link
    except BaseException:
        for link in links.values():
            link.close()
        raise
    finally:
        listener.close()
    for link in links.values():
        link.setblocking(False)
        with contextlib.suppress(OSError):
            link.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
            link.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)
    return links


def _who(link: socket.socket) -> tuple[int, str | None]:
    """The pid of the process at the other end, and who it is if not a process of this user
    (Linux tells: the sockets are formed only there, ``host_key``)."""
    option = socket.SO_PEERCRED
    pid, uid, _ = struct.unpack("3i", link.getsockopt(socket.SOL_SOCKET, option, 12))
    return pid, None if uid == os.geteuid() else f"uid {uid} (pid {pid}), not this job's user"


def _hello(link: socket.socket, token: bytes, rank: int, size: int, deadline: float) -> int | str:
    """The rank a caller says it is, or who it is when it is no rank of this job."""
    pid, stranger = _who(link)
    if stranger is not None:
        return stranger
    link.settimeout(max(deadline - time.monotonic(), 0.001))
    hello = b""
    with contextlib.suppress(OSError):
        while len(hello) < _HELLO.size and (part := link.recv(_HELLO.size - len(hello))):
            hello += part
    if len(hello) < _HELLO.size:
        return f"pid {pid}, which did not say its rank and token"
    peer, said = _HELLO.unpack(hello)
    if not hmac.compare_digest(said, token):
        return f"pid {pid}, which did not present the job's token"
    return peer if rank < peer < size else f"pid {pid}, which said it is rank {peer}"
