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
  interfaces, even with ``--standalone``): gpipe only connects to it, each attempt of the
  job (``--max-restarts``) in a namespace of its own (:func:`this_attempt`).

A store reached over the network, between machines, is the user's to protect, as with any
torch.distributed job: a private network, or a firewall that admits only the job's hosts.
"""

from __future__ import annotations

import ipaddress
import random
import secrets
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["client", "free_port", "loopback", "serve", "this_attempt"]


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


def this_attempt(store: Any, rank: int, size: int, timeout: float) -> dist.PrefixStore:
    """``store`` (torchrun's agent's) seen through a namespace of this attempt of the job
    only, agreed by its ``size`` processes within ``timeout`` seconds.

    torchrun's agent keeps one store for every attempt (``--max-restarts``) and torch hands
    it to each attempt's processes unprefixed: a restarted process read the dead attempt's
    keys (gloo's addresses: "connectFullMesh ... Connection refused", or a hang).
    ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each machine's agent counts its
    own. So rank 0 draws a fresh namespace and hands it to each rank that asks with a nonce
    of its own, which no key of a dead attempt answers. Raises :class:`TimeoutError` naming
    the ranks that did not come."""
    if rank != 0:
        nonce = secrets.token_hex(16)
        store.set(f"gpipe/hello/{rank}", nonce)
        try:  # the store's own wait, bounded by its timeout (the job's)
            name = store.get(f"gpipe/answer/{nonce}").decode(errors="replace")
        except RuntimeError:  # DistStoreError: the timeout passed
            raise TimeoutError(f"rank 0 did not answer rank {rank} within {timeout:g} s") from None
        store.set(f"gpipe/{name}/rank/{rank}", "")
        return dist.PrefixStore(f"gpipe/{name}/", store)
    name, deadline = f"attempt-{secrets.token_hex(16)}", time.monotonic() + timeout
    missing, answered = set(range(1, size)), {}
    while missing:
        for other in sorted(missing):
            key = f"gpipe/hello/{other}"
            nonce = store.get(key).decode(errors="replace") if store.check([key]) else ""
            if nonce and answered.get(other) != nonce:  # a dead attempt's too: harmless
                store.set(f"gpipe/answer/{nonce}", name)
                answered[other] = nonce
        missing = {r for r in missing if not store.check([f"gpipe/{name}/rank/{r}"])}
        if missing and time.monotonic() > deadline:
            shown = ", ".join(map(str, sorted(missing)[:10])) + (", ..." * (len(missing) > 10))
            raise TimeoutError(f"rank{'s' * (len(missing) > 1)} {shown} did not come within "
                               f"{timeout:g} s")  # fmt: skip
        time.sleep(0.01 if missing else 0)
    return dist.PrefixStore(f"gpipe/{name}/", store)
