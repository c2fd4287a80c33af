"""Transport between processes of one machine: a Unix stream socket per pair of ranks.

On one host with CPU stages, a Unix socket carries a message in one ``sendmsg`` and one
wake-up of the receiver, no thread in between, where gloo takes a rendezvous over TCP
loopback and its own thread per message (the numbers: ``docs/benchmarks.md``).

Each pair of ranks holds one connected socket (``gpipe.transport.handshake``), which carries
the frames of the one wire protocol (``gpipe.transport.framing``) in their sequence: a
message is its head, its description when it changed (shapes may change from step to
step), then each tensor's bytes, received straight into the tensor that will hold it; the
step's rows travel in their heads; a notice's text follows its head.

Sends never wait on the peer's progress: a message goes into the socket's kernel buffer.
When the buffer is full (a large activation), the sender keeps reading whatever every
peer sends it while it waits, so two ranks sending to each other never block each other;
a rank reads its sockets in every send and receive, and enters a collective only after it
has received all of the step's messages, so every send completes. Every wait is bounded by
the pipeline's timeout, and a peer that dies closes its sockets: its receivers know at
once.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpipe.base.errors import PipelineError
from gpipe.schedule.routes import Message, Routes
from gpipe.transport.framing import (
    AGREEMENT,
    HEAD,
    MESSAGE,
    NOTICE,
    History,
    head,
    notice,
    read_head,
    row_of,
)
from gpipe.transport.inquest import REMEDY
from gpipe.transport.peers import PeerTransport

__all__ = ["SocketTransport"]

_MAX_PARTS = 512  # buffers per sendmsg call (the system's limit is 1024)
_READ = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
_GONE = select.POLLHUP | select.POLLERR  # reported whatever the poll watches for


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (any dtype: viewed as bytes; a view
    of the last dimension costs a third of a reshape's)."""
    if not tensor.numel():
        return memoryview(b"")
    flat = tensor.view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def _drop(parts: list[memoryview], sent: int) -> None:
    """Remove the first ``sent`` bytes of ``parts``, which went into a socket."""
    while sent:
        if sent >= parts[0].nbytes:
            sent -= parts.pop(0).nbytes
        else:
            parts[0] = parts[0][sent:]
            sent = 0


def _idle(inbound: _Inbound) -> bool:
    """Whether no frame from this peer is half read."""
    return inbound.got == 0 and len(inbound.parts) == 1 and inbound.parts[0].obj is inbound.header


class _PeerLost(Exception):
    """A peer's socket closed or failed: it died or left."""

    def __init__(self, peer: int, error: BaseException) -> None:
        super().__init__(str(error) or type(error).__name__)
        self.peer = peer


@dataclass
class _Inbound:
    """What has come in from one peer: the frame being read, and messages complete."""

    link: socket.socket
    header: bytearray = field(default_factory=lambda: bytearray(HEAD))
    parts: list[memoryview] = field(default_factory=list)  # what the frame fills, in order
    got: int = 0  # bytes of parts[0] filled
    on_full: Callable[[], None] | None = None  # what to do once the parts are full
    position: int = 0  # of the next frame from this peer
    arrived: dict[Message, Any] = field(default_factory=dict)
    rows: dict[int, list[bytes]] = field(default_factory=dict)  # heads, by kind, in order
    closed: BaseException | None = None
    # From its row of a step's agreement until this rank begins the next step, the peer's
    # next message belongs to that step: it stays in the socket (rows and notices are read).
    hold: bool = True
    events: int = _READ  # what the poll watches its socket for


class SocketTransport(PeerTransport):
    """Point-to-point transport between processes of one machine (see the module's
    docstring); built by ``gpipe.parallel.group`` where every rank's stages are on the CPU
    of one host. Collectives stay on the process group, but for the step's rows."""

    kind = "sockets"  # what Pipe.transport says
    receive_ahead = True  # whatever a peer sends is taken as soon as the rank reads

    def __init__(
        self,
        schedule: Any,
        rank: int,
        group: Any,
        devices: list[torch.device],
        links: dict[int, socket.socket],
        *,
        timeout: float,
        routes: Routes | None = None,
    ) -> None:
        super().__init__(schedule, rank, group, devices, timeout=timeout, routes=routes)
        self.wire_device = torch.device("cpu")
        self._links = links
        self._inbound = {peer: _Inbound(link) for peer, link in links.items()}
        self._by_fd = {link.fileno(): peer for peer, link in links.items()}
        self._poll = select.poll()
        for link in links.values():
            self._poll.register(link, _READ)
        for peer in links:
            self._expect_header(peer)
        self._unsent: dict[int, list[memoryview]] = {}  # a frame interrupted by a failure
        self._exchanging = False

    def begin(self, training: bool) -> None:
        self.check_notices()  # a peer gave up on this pipeline since the last step
        self._begin_plan(training)
        self._sent = dict.fromkeys(self._outgoing, 0)
        for peer, inbound in self._inbound.items():
            inbound.position = 0
            inbound.arrived.clear()
            inbound.hold = False
            self._watch(peer, _READ)

    def finish(self) -> None:
        pass  # every send is in its socket already

    def clear(self) -> None:
        self._mailbox.clear()
        for inbound in self._inbound.values():
            inbound.arrived.clear()

    def check_notices(self) -> None:
        """Raise the failure a peer announced, if one has (read without waiting)."""
        if not self._notices:
            for peer in self._inbound:
                self._pump(peer)
        super().check_notices()

    def _watch(self, peer: int, events: int) -> None:
        """What the poll watches ``peer``'s socket for (nothing once it closed)."""
        inbound = self._inbound[peer]
        if inbound.closed is None and events != inbound.events:
            self._poll.modify(inbound.link, events)
            inbound.events = events

    # -- sending ----------------------------------------------------------------------------

    def send(self, message: Message, value: Any) -> None:
        if self._send_here(message, value):
            return
        dst = self.schedule.stage_to_rank[message.stage]
        history, meta, size, tensors = self._described(dst, message, value)
        payload = [_bytes_of(t) for t in tensors]
        frame = head(MESSAGE, self._sent[dst], size)
        self._write(dst, [memoryview(frame), *([memoryview(meta)] if size else []), *payload])
        history.update(meta)
        self._sent[dst] += 1

    def _send_row(self, dst: int, kind: int, row: torch.Tensor) -> None:
        self._write(dst, [memoryview(head(kind, self._sent[dst], 0, row))])
        self._sent[dst] += 1

    def _write(self, dst: int, parts: list[memoryview]) -> None:
        """Put ``parts`` into ``dst``'s socket, reading every peer while the socket is full."""
        link = self._links[dst]
        parts = [p for p in parts if p.nbytes]
        self._unsent[dst] = parts
        deadline = time.monotonic() + self.timeout
        while parts:
            try:
                sent = link.sendmsg(parts[:_MAX_PARTS])
            except BlockingIOError:
                sent = 0
            except OSError as error:
                raise self._left(error, dst, "send to") from error
            _drop(parts, sent)
            if not parts:
                break
            try:
                waited = self._wait_for(deadline, writing=dst)
            except _PeerLost as lost:
                raise self._left(lost, dst, "send to") from lost
            if not waited:
                me, other = self._global(self.rank), self._global(dst)
                raise PipelineError(
                    f"rank {me} waited {self.timeout:g} s to send to rank {other}, which took "
                    f"nothing in that time: it stalled or is slower than that; look for why "
                    f"{REMEDY}",
                    rank=dst,
                    global_rank=other,
                )
        del self._unsent[dst]

    # -- receiving --------------------------------------------------------------------------

    def recv(self, message: Message) -> Any:
        if message in self._mailbox:
            return self._mailbox.pop(message)
        src = self.schedule.stage_to_rank[self.routes.sender(message)]
        inbound = self._inbound[src]
        deadline = time.monotonic() + self.timeout
        try:
            self._pump(src)
            while message not in inbound.arrived:
                if inbound.closed is not None:
                    raise _PeerLost(src, inbound.closed)
                if not self._wait_for(deadline):
                    raise self._wait_failed(TimeoutError("timed out"), src, message)
        except _PeerLost as lost:
            raise self._wait_failed(lost, lost.peer, message) from lost
        return inbound.arrived.pop(message)

    def _wait_for(self, deadline: float, writing: int | None = None) -> bool:
        """Wait until a peer has sent something (read it) or ``writing``'s socket has room;
        False if nothing happened before ``deadline``. Raises a failure a peer announced."""
        if writing is not None:
            watched = self._inbound[writing].events
            self._watch(writing, watched | select.POLLOUT)
        try:
            left = deadline - time.monotonic()
            events = self._poll.poll(max(left, 0) * 1000) if left > 0 else []
        finally:
            if writing is not None:
                self._watch(writing, watched)
        for fd, happened in events:
            peer = self._by_fd[fd]
            self._pump(peer)
            inbound = self._inbound[peer]
            if inbound.closed is None and happened & _GONE and inbound.events == 0:
                # Its next step's message is held, and it hung up: it is gone all the same.
                self._lost(peer, _PeerLost(peer, ConnectionResetError("the connection was closed")))
            if peer == writing and inbound.closed is not None:
                raise inbound.closed
        return bool(events)

    def _pump(self, peer: int) -> None:
        """Read whatever ``peer`` has sent, without waiting; keep each complete message. A
        peer that left is marked ``closed`` once what it sent before is read: its last
        messages and row count, the wait for a next one fails."""
        if self._inbound[peer].closed is None:
            try:
                self._read(peer)
            except _PeerLost as lost:
                self._lost(peer, lost)

    def _lost(self, peer: int, lost: _PeerLost) -> None:
        self._inbound[peer].closed = lost
        self._poll.unregister(self._links[peer])  # a dead peer's socket stays readable

    def _read(self, peer: int) -> None:
        inbound = self._inbound[peer]
        link = inbound.link
        while True:
            if inbound.hold and _idle(inbound) and not self._notice_next(peer):
                return
            part = inbound.parts[0]
            try:
                got = link.recv_into(part[inbound.got :])
            except BlockingIOError:
                return
            except OSError as error:
                raise _PeerLost(peer, error) from error
            if got == 0:
                raise _PeerLost(peer, ConnectionResetError("the connection was closed"))
            inbound.got += got
            if inbound.got == part.nbytes:
                inbound.parts.pop(0)
                inbound.got = 0
                if not inbound.parts:
                    assert inbound.on_full is not None
                    inbound.on_full()

    def _expect_header(self, peer: int) -> None:
        inbound = self._inbound[peer]
        inbound.parts = [memoryview(inbound.header)]
        inbound.on_full = lambda: self._header_in(peer)

    def _header_in(self, peer: int) -> None:
        inbound = self._inbound[peer]
        kind, position, size = read_head(inbound.header)
        if kind == NOTICE:  # a failure: what it says, then raise it
            meta = bytearray(size)
            inbound.parts = [memoryview(meta)]
            inbound.on_full = lambda: self._noticed(peer, meta)
            return
        if kind != MESSAGE:  # a row
            inbound.rows.setdefault(kind, []).append(bytes(inbound.header))
            inbound.position += 1
            inbound.hold = kind == AGREEMENT  # its frames of this step are all in
            self._expect_header(peer)
            return
        incoming = self._incoming.get(peer, [])
        expected = position == inbound.position and position < len(incoming)
        message = incoming[position] if expected else None
        if not isinstance(message, Message):
            raise PipelineError(
                f"rank {self.rank} received message {position} of this step from rank {peer} "
                f"where it expected message {inbound.position} of {len(incoming)}: the ranks "
                "run different schedules; build every rank's Pipe with the same arguments",
                rank=peer,
            )
        history = self._recv_meta.setdefault(self._key(peer, message), History())
        if size == 0:
            if history.last is None:
                raise PipelineError(f"rank {peer} sent {message} without describing it", rank=peer)
            self._tensors_of(peer, message, history, history.last)
            return
        meta = bytearray(size)
        inbound.parts = [memoryview(meta)]
        inbound.on_full = lambda: self._tensors_of(peer, message, history, bytes(meta))

    def _tensors_of(self, peer: int, message: Message, history: History, meta: bytes) -> None:
        """Receive the message's tensors straight into the tensors that will hold them."""
        history.update(meta)
        leaves = history.allocate(torch.device("cpu"))
        inbound = self._inbound[peer]

        def complete() -> None:
            inbound.arrived[message] = history.rebuild(leaves, message.channel.forward)
            inbound.position += 1
            self._expect_header(peer)

        parts = [_bytes_of(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)]
        inbound.parts = [p for p in parts if p.nbytes]
        if inbound.parts:
            inbound.on_full = complete
        else:
            complete()

    def _noticed(self, peer: int, data: bytearray) -> None:
        """A peer's failure notice: raise it, and on every later check (while the rank
        gathers the step's agreement, only if nobody is left to agree with)."""
        self._expect_header(peer)
        self._notices = self._notice_from(peer, data)
        if not self._exchanging or self._notices.get("gave_up"):
            super().check_notices()

    def _notice_next(self, peer: int) -> bool:
        """While holding ``peer``'s next frame (its step's are all in): whether it is a
        notice (then read it). Another, left where it is, is not polled for until the next
        step."""
        inbound = self._inbound[peer]
        try:
            peeked = inbound.link.recv(HEAD, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError as error:
            raise _PeerLost(peer, error) from error
        if not peeked:
            raise _PeerLost(peer, ConnectionResetError("the connection was closed"))
        if len(peeked) < 24:
            return False  # the rest of the head is on its way
        if read_head(peeked)[0] == NOTICE:
            return True
        self._watch(peer, 0)
        return False

    # -- the step's rows --------------------------------------------------------------------

    def _take_row(self, src: int, kind: int, like: torch.Tensor, deadline: float) -> torch.Tensor:
        """Read until ``src``'s row of ``kind`` is in. A failure notice that comes while the
        agreement is gathered is kept, not raised: a rank that failed still sends its row."""
        self._exchanging = kind == AGREEMENT
        inbound = self._inbound[src]
        try:
            while not inbound.rows.get(kind):
                self._pump(src)
                if inbound.rows.get(kind):
                    break
                if inbound.closed is not None:
                    raise _PeerLost(src, inbound.closed)
                if self._exchanging and self.peer_gave_up():
                    raise ConnectionError(self._notices["message"])
                if not self._wait_for(deadline):
                    raise TimeoutError("timed out")
        except _PeerLost as lost:
            raise ConnectionError(f"rank {self._global(lost.peer)}: {lost}") from lost
        finally:
            self._exchanging = False
        return row_of(inbound.rows[kind].pop(0), like)

    # -- failures ---------------------------------------------------------------------------

    def announce_failure(self, description: dict) -> None:
        """Tell every peer (each may be waiting on this rank, directly or not), after the
        rest of any frame a failure interrupted; for at most a second."""
        text = notice(description)
        frame = [memoryview(head(NOTICE, -1, len(text))), memoryview(text)]
        deadline = time.monotonic() + min(1.0, self.timeout)
        for peer, link in self._links.items():
            parts = [*self._unsent.pop(peer, []), *frame]
            with contextlib.suppress(OSError, PipelineError, _PeerLost):
                while parts and time.monotonic() < deadline:
                    try:
                        sent = link.sendmsg(parts)
                    except BlockingIOError:
                        select.select([], [link], [], max(deadline - time.monotonic(), 0))
                        continue
                    _drop(parts, sent)
