"""The carrier of the frames between processes of one machine: a Unix stream socket per pair
of ranks.

On one host with CPU stages, a Unix socket carries a message in one ``sendmsg`` and one
wake-up of the receiver, no thread in between, where gloo takes a rendezvous over TCP
loopback and its own thread per message (the numbers: ``docs/benchmarks.md``).

Each pair of ranks holds one connected socket (``gpipe.transport.choice``). It moves the
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

import contextlib
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
_tag = struct.Struct("<q").unpack_from  # (the tag,) of a preamble


class _Transfer:
    """One posted send or receive: what a gloo work answers (``is_completed``, ``wait``)."""

    __slots__ = ("carrier", "error", "got", "peer", "size", "view")

    def __init__(self, carrier: SocketCarrier, size: int, view: Any = None, peer: Any = None):
        self.carrier, self.size, self.view, self.peer = carrier, size, view, peer
        self.got, self.error = 0, carrier._closed.get(peer)  # a receive from a peer lost

    def is_completed(self) -> bool:
        return self.got == self.size

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.got == self.size:
            return True
        if self.peer is not None:
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
    """Moves the frames of ``gpipe.transport.peers`` (the step's rows among them) through a
    socket per peer (the module's docstring); collectives stay on the process group."""

    kind = "sockets"  # what Pipe.transport says
    receive_ahead = True  # a stream's receives are matched in order: never a deadlock
    wire_device = torch.device("cpu")

    def __init__(self, links: dict[int, socket.socket], timeout: float) -> None:
        self.timeout = timeout
        self._links = links
        self._by_fd = {link.fileno(): peer for peer, link in links.items()}
        self._posted: dict[int, dict[int, deque[_Transfer]]] = {p: {} for p in links}
        self._out: dict[int, deque[tuple[memoryview, _Transfer]]] = {p: deque() for p in links}
        self._closed: dict[int, str] = {}  # peers whose stream ended, once all it sent is read
        self._broken: dict[int, str] = {}  # peers that take nothing more
        # From each peer: the preamble of the transfer that comes, read into its own buffer
        # (complete: no receive with its tag is posted yet), then the transfer it announced.
        self._preambles = {p: _Transfer(self, 16, memoryview(bytearray(16))) for p in links}
        self._into: dict[int, _Transfer] = dict(self._preambles)

    def post(
        self, sends: bool, peer: int, tag: int, tensors: list[torch.Tensor], data=False
    ) -> list[_Transfer]:
        """Post sends (or receives) of ``tensors`` with ``peer`` on ``tag``; sends are
        written at once as far as the socket takes them."""
        if not sends:
            transfers = [_Transfer(self, v.nbytes, v, peer) for v in map(bytes_of, tensors)]
            self._posted[peer].setdefault(tag, deque()).extend(transfers)
            return transfers
        if peer in self._broken:
            raise RuntimeError(f"Connection closed by peer: {self._broken[peer]}")
        return [self._send(peer, tag, t if isinstance(t, list) else [t]) for t in tensors]

    def _send(self, peer: int, tag: int, parts: list[Any]) -> _Transfer:
        """One transfer of ``parts`` (bytes, contiguous tensors) to ``peer``."""
        views = [memoryview(p) if type(p) is bytes else bytes_of(p) for p in parts]
        size = sum(v.nbytes for v in views)
        transfer = _Transfer(self, _PREAMBLE.size + size)  # done once its preamble is written too
        views.insert(0, memoryview(_PREAMBLE.pack(tag, size)))
        out = self._out[peer]
        if not out and len(views) <= _MAX_PARTS:  # nothing queued before it: written at once
            with contextlib.suppress(OSError):  # a full socket, a lost peer: left to _write
                transfer.got = self._links[peer].sendmsg(views)
            if transfer.is_completed():
                return transfer
            views = _after(views, transfer.got)
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
        """Whether a read from ``peer`` would land somewhere (a preamble, read whole, waits
        for a receive posted with its tag)."""
        into = self._into[peer]
        return not into.is_completed() or bool(self._posted[peer].get(_tag(into.view)[0]))

    def _read(self, peer: int) -> None:
        """Read what ``peer`` sent into the receives posted for it, without waiting."""
        link, preamble = self._links[peer], self._preambles[peer]
        while peer not in self._closed:
            into = self._into[peer]
            if into.is_completed():
                if into is not preamble:  # a transfer in: the next one's preamble comes
                    self._into[peer], preamble.got = preamble, 0
                elif not self._match(peer):
                    return  # not posted yet: it stays in the socket
                continue
            try:
                got = link.recv_into(into.view[into.got :])
            except BlockingIOError:
                return
            except OSError as error:
                got, why = 0, f"Connection closed by peer ({error})"
            else:
                why = "Connection closed by peer"
            if got == 0:  # the stream ended: the peer is closed
                self._lose(peer, why)
                return
            into.got += got

    def _match(self, peer: int) -> bool:
        """Where the transfer whose preamble came lands: the first receive posted with its
        tag. False while none is posted."""
        tag, size = _PREAMBLE.unpack(self._preambles[peer].view)
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

    def _lose(self, peer: int, why: str) -> None:
        """``peer``'s stream ended: every receive posted from it fails, now and later."""
        self._closed[peer] = why
        for queue in self._posted[peer].values():
            for t in queue:
                t.error = why
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
                    t.error = f"Connection closed by peer ({error})"
                out.clear()
                return
            while sent:
                view, t = out[0]
                taken = min(sent, view.nbytes)
                sent -= taken
                t.got += taken
                if taken == view.nbytes:
                    out.popleft()
                else:
                    out[0] = (view[taken:], t)


def _after(views: list[memoryview], sent: int) -> list[memoryview]:
    """What of ``views`` is left once their first ``sent`` bytes are written."""
    for i, view in enumerate(views):
        if sent < view.nbytes:
            return [view[sent:], *views[i + 1 :]]
        sent -= view.nbytes
    return []
