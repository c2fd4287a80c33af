"""The carrier of the frames between processes of one machine: a Unix stream socket per pair
of ranks.

On one host with CPU stages, a Unix socket carries a message in one ``sendmsg`` and one
wake-up of the receiver, no thread in between, where gloo takes a rendezvous over TCP
loopback and its own thread per message (the numbers: ``docs/benchmarks.md``).

Each pair of ranks holds one connected socket (``gpipe.transport.handshake``). It moves the
transfers ``gpipe.transport.peers`` posts, as gloo's point-to-point does: each goes with a
preamble (its tag, its size) and lands in the first receive posted with its tag, straight
into the tensor that holds it; one whose receive is not posted yet stays in the socket
(the stream holds everything behind it).

Sends never wait on the peer: what the socket's kernel buffer does not take is written
whenever the rank next waits (for any transfer), so two ranks sending to each other never
block each other. Every wait is bounded by the pipeline's timeout, and a peer that dies
closes its socket: what it sent before is read, then its receivers know at once.
"""

from __future__ import annotations

import itertools
import select
import socket
import struct
import time
from collections import deque
from datetime import timedelta
from typing import Any

import torch

from gpipe.transport.framing import bytes_of

__all__ = ["SocketCarrier"]

_MAX_PARTS = 512  # buffers per sendmsg call (the system's limit is 1024)
_PREAMBLE = struct.Struct("<qq")  # a transfer's tag and size


class _Transfer:
    """One posted send or receive: what a gloo work answers (``is_completed``, ``wait``)."""

    __slots__ = ("carrier", "error", "got", "keep", "peer", "size", "view")

    def __init__(self, carrier: SocketCarrier, size: int, view: Any = None, keep: Any = None):
        self.carrier, self.size, self.view, self.keep = carrier, size, view, keep
        self.got, self.error, self.peer = 0, None, None

    def is_completed(self) -> bool:
        return self.got == self.size

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.peer is not None and not self.is_completed():
            self.carrier._read(self.peer)  # it may be in the socket already: no poll then
        seconds = timeout.total_seconds() if timeout is not None else self.carrier.timeout
        deadline = time.monotonic() + seconds
        while not self.is_completed():
            if self.error is not None:
                raise RuntimeError(self.error)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"Timed out waiting {seconds:g} s for a transfer to complete")
            self.carrier.pump(left)
        return True


class SocketCarrier:
    """Moves the frames of ``gpipe.transport.peers`` through a socket per peer (see the
    module's docstring); chosen by ``gpipe.transport.choice`` where every rank's stages
    are on the CPU of one host. Collectives stay on the process group, but for the step's
    rows."""

    kind = "sockets"  # what Pipe.transport says
    receive_ahead = True  # a stream's receives are matched in order: never a deadlock
    wire_device = torch.device("cpu")

    def __init__(self, links: dict[int, socket.socket], timeout: float) -> None:
        self.timeout = timeout
        self._links = links
        self._by_fd = {link.fileno(): peer for peer, link in links.items()}
        self._posted: dict[int, dict[int, deque[_Transfer]]] = {p: {} for p in links}
        self._out: dict[int, deque[tuple[memoryview, _Transfer]]] = {p: deque() for p in links}
        self._next: dict[int, tuple[int, int] | None] = dict.fromkeys(links)  # preamble read
        self._into: dict[int, _Transfer | None] = dict.fromkeys(links)  # being filled
        self._closed: dict[int, str] = {}  # peers whose stream ended, once all it sent is read
        self._broken: dict[int, str] = {}  # peers that take nothing more

    def post(
        self, sends: bool, peer: int, tag: int, tensors: list[torch.Tensor], data=False
    ) -> list[_Transfer]:
        """Post sends (or receives) of ``tensors`` with ``peer`` on ``tag``; sends are
        written at once as far as the socket takes them."""
        if sends:
            if peer in self._broken:
                raise RuntimeError(f"Connection closed by peer: {self._broken[peer]}")
            return [self._send(peer, tag, t if isinstance(t, list) else [t]) for t in tensors]
        transfers = []
        for t in tensors:
            view = bytes_of(t)
            transfers.append(_Transfer(self, view.nbytes, view, t))
            transfers[-1].peer, transfers[-1].error = peer, self._closed.get(peer)
            self._posted[peer].setdefault(tag, deque()).append(transfers[-1])
        return transfers

    def _send(self, peer: int, tag: int, parts: list[Any]) -> _Transfer:
        """One transfer of ``parts`` (bytes, contiguous tensors) to ``peer``."""
        views = [memoryview(p) if isinstance(p, bytes) else bytes_of(p) for p in parts]
        transfer = _Transfer(self, sum(v.nbytes for v in views), keep=parts)
        out = self._out[peer]
        out.append((memoryview(_PREAMBLE.pack(tag, transfer.size)), None))
        out.extend((view, transfer) for view in views if view.nbytes)
        self._write(peer)
        return transfer

    def flush(self, seconds: float) -> None:
        """Write what is posted, for at most ``seconds``."""
        deadline = time.monotonic() + seconds
        while any(self._out.values()) and time.monotonic() < deadline:
            self.pump(deadline - time.monotonic())

    # -- moving bytes -------------------------------------------------------------------------

    def pump(self, seconds: float) -> None:
        """Wait at most ``seconds`` for any socket to be readable (where a read lands) or
        writable (with something to write), and move what can be moved."""
        poll = select.poll()  # a few peers: cheaper than keeping one in step with them
        for peer, link in self._links.items():
            reading = peer not in self._closed and self._wanted(peer)
            events = (select.POLLIN if reading else 0) | (select.POLLOUT if self._out[peer] else 0)
            # Only a socket with something to move: a hung-up one is always ready (it would
            # spin); reading or writing it ends its peer (_lose, _write), and it is left out.
            if events:
                poll.register(link, events)
        for fd, _ in poll.poll(max(seconds, 0) * 1000):
            peer = self._by_fd[fd]
            if self._out[peer]:
                self._write(peer)
            self._read(peer)

    def _wanted(self, peer: int) -> bool:
        """Whether a read from ``peer`` would land somewhere (or read a preamble)."""
        upcoming = self._next[peer]
        return (upcoming is None or self._into[peer] is not None
                or bool(self._posted[peer].get(upcoming[0])))  # fmt: skip

    def _read(self, peer: int) -> None:
        """Read what ``peer`` sent into the receives posted for it, without waiting."""
        link = self._links[peer]
        while peer not in self._closed:
            if self._into[peer] is None:
                if self._next[peer] is None:  # between transfers: a preamble comes
                    self._into[peer] = _Transfer(self, _PREAMBLE.size, memoryview(bytearray(16)))
                elif not self._match(peer):
                    return  # not posted yet: it stays in the socket
            into = self._into[peer]
            if not into.is_completed():
                got = self._recv(peer, link, into.view[into.got :])
                if got is None:
                    return
                into.got += got
                continue
            self._next[peer] = _PREAMBLE.unpack(into.view) if self._next[peer] is None else None
            self._into[peer] = None

    def _match(self, peer: int) -> bool:
        """Where the transfer whose preamble came lands: the first receive posted with its
        tag. False while none is posted."""
        tag, size = self._next[peer]
        queue = self._posted[peer].get(tag)
        if not queue:
            return False
        self._into[peer] = into = queue.popleft()
        if into.size != size:
            self._lose(peer, f"rank sent {size} bytes on tag {tag} where {into.size} were "
                       "posted: the ranks disagree on what they send; build every rank's "
                       "Pipe with the same arguments")  # fmt: skip
            return False
        return True

    def _recv(self, peer: int, link: socket.socket, view: memoryview) -> int | None:
        """Bytes read into ``view``, or None when nothing is there (or the stream ended:
        the peer is then closed)."""
        try:
            got = link.recv_into(view)
        except BlockingIOError:
            return None
        except OSError as error:
            self._lose(peer, f"Connection closed by peer ({error})")
            return None
        if got == 0:
            self._lose(peer, "Connection closed by peer")
            return None
        return got

    def _lose(self, peer: int, why: str) -> None:
        """``peer``'s stream ended: every receive posted from it fails, now and later."""
        self._closed[peer] = why
        for queue in self._posted[peer].values():
            for t in queue:
                t.error = why
        if self._into[peer] is not None:
            self._into[peer].error = why

    def _write(self, peer: int) -> None:
        """Write what is queued for ``peer``, as far as its socket takes it."""
        out = self._out[peer]
        while out:
            views = [view for view, _ in itertools.islice(out, _MAX_PARTS)]
            try:
                sent = self._links[peer].sendmsg(views)
            except BlockingIOError:
                return
            except OSError as error:
                self._broken[peer] = str(error)
                for _, t in out:
                    if t is not None:
                        t.error = f"Connection closed by peer ({error})"
                out.clear()
                return
            while sent:
                view, t = out[0]
                taken = min(sent, view.nbytes)
                sent -= taken
                if t is not None:
                    t.got += taken
                if taken == view.nbytes:
                    out.popleft()
                else:
                    out[0] = (view[taken:], t)
