"""The job's store (torch's ``TCPStore``): who holds it, and where it listens.

Every process of a job reaches the store: it forms the process group, and a failed wait's
inquest (``gpipe.transport.inquest``) leaves its statements there. torch's store has no
authentication, and its server listens on every interface whatever host it is given. So:

* under :func:`gpipe.launch`, the launcher holds it, and every rank is a client: a rank
  that stops (SIGSTOP, a debugger) cannot take the store with it, and the others still
  tell who stopped;
* when every process is on this host (the launcher; ``MASTER_ADDR`` a loopback address
  when set by hand), it listens on loopback only (:func:`serve`): no other machine
  reaches it. Other local users still can (a TCP port has no owner to check), as they can
  any torch.distributed job's;
* under torchrun, torchrun's agent holds the store and chooses where it listens (all
  interfaces, even with ``--standalone``): gpipe only connects to it.

A store reached over the network, between machines, is the user's to protect, as with any
torch.distributed job: a private network, or a firewall that admits only the job's hosts.
"""

from __future__ import annotations

import ipaddress
import random
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["client", "free_port", "loopback", "serve"]


def loopback(address: str) -> str | None:
    """The loopback IP ``address`` names (``localhost``, ``127.0.0.1``, ``::1``), or None
    when it names (or may name) another host."""
    try:
        found = {info[4][0] for info in socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)}
    except OSError:
        return None
    ips = [ipaddress.ip_address(ip.split("%")[0]) for ip in found]
    if not ips or not all(ip.is_loopback for ip in ips):
        return None
    return str(min(ips, key=lambda ip: ip.version))  # 127.0.0.1 before ::1


def _free_candidates() -> list[int]:
    """Ports to try, below the kernel's ephemeral range where it can: the ports it hands
    out there (gloo's own connections, of this job or a concurrent one) could take one
    before it is bound; then 0, any free port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            lowest = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        lowest = 0
    draw = random.SystemRandom()  # not the global generator, which scripts seed alike
    below = [draw.randrange(lowest // 2, lowest) for _ in range(20)] if lowest > 4096 else []
    return [*below, 0]


def _listener(host: str, port: int | None = None) -> socket.socket:
    """A TCP socket listening on ``host`` at ``port`` (None: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    error: OSError = OSError(f"no free TCP port on {host}")
    for candidate in _free_candidates() if port is None else [port]:
        server = socket.socket(family, socket.SOCK_STREAM)
        try:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own
            server.bind((host, candidate))
            server.listen(socket.SOMAXCONN)
        except OSError as failed:
            server.close()
            error = failed
            continue
        return server
    raise error


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for ``MASTER_PORT`` set
    by hand; :func:`serve` binds its own and holds it)."""
    with _listener("127.0.0.1") as server:
        return server.getsockname()[1]


def serve(host: str, port: int | None, size: int, timeout: float) -> dist.TCPStore:
    """The server of a job of ``size`` processes, listening on ``host`` only (a loopback
    address: :func:`loopback`) at ``port`` (None: a free one, then the store's ``port``).

    torch binds every interface whatever host it is given; a socket bound here and handed
    over (``master_listen_fd``, libuv's server) listens where it was bound."""
    server = _listener(host, port)
    return dist.TCPStore(
        host, server.getsockname()[1], size, is_master=True,
        timeout=timedelta(seconds=timeout), wait_for_workers=False,
        master_listen_fd=server.detach(), use_libuv=True,  # the store closes it
    )  # fmt: skip


def client(host: str, port: int, size: int, timeout: float) -> Any:
    """A client of the store at ``host``:``port`` (all of a launched job's ranks are)."""
    return dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=timeout))
