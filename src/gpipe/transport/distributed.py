"""Transport between processes: point-to-point ``torch.distributed`` (gloo on CPU, NCCL on GPU).

The one story of how receives are posted is :class:`DistributedTransport`'s docstring.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from gpipe.base.errors import PipelineError
from gpipe.schedule.comm_plan import receive_points
from gpipe.schedule.ir import Kind
from gpipe.schedule.routes import Message, Routes
from gpipe.transport.framing import (
    AGREEMENT,
    HEADER,
    History,
    bytes_tensor,
    notice,
    read_notice,
)
from gpipe.transport.peers import PeerTransport, _announced
from gpipe.transport.rows import _NOTICE_TAG, RowsOverP2P
from gpipe.transport.sender import Outbox

__all__ = ["DistributedTransport"]

_NOTICE_BYTES = 4096
_transports_built: dict[tuple[int, ...], int] = {}


@dataclass
class _Posted:
    """Receives posted for one incoming message: its header, and maybe its tensors."""

    message: Message
    history: History
    tag: int  # its position in the peer's sequence: every frame of it carries that tag
    header: Any = None  # int64 tensor of HEADER elements
    header_work: Any = None
    packed: torch.Tensor | None = None  # header and tensors in one buffer (stable message)
    leaves: list[Any] | None = None
    works: list[Any] = field(default_factory=list)  # receives of the tensors, when separate


class DistributedTransport(RowsOverP2P, PeerTransport):
    """Point-to-point transport between processes through ``torch.distributed``.

    Every message to another rank is framed as an ``int64`` header (``framing.HEADER``), the
    encoded description of the value (its structure, and each tensor's dtype, shape and
    ``requires_grad``) when it differs from the last time this message was sent, then the
    tensors themselves. Shapes may therefore change from step to step.

    Messages between two ranks are received in the order the sender sends them, which
    the schedule fixes: a receiver waiting for message X first takes any that its peer
    sent before X. That keeps the wire order identical on both sides, as NCCL requires.
    Every frame also carries the message's position in that sequence as its tag, so
    that on gloo the receive of the next message can be posted before the current one
    has fully arrived without taking its frames (NCCL ignores tags and is never asked to).

    When receives are posted depends on the backend:

    * gloo (``receive_ahead``, the default for gloo): the next message from each peer is always
      posted, and where a burst begins (the messages a rank takes between two of its sends,
      as a GPipe schedule's forwards) all of the burst's, so a message lands while the rank
      computes and posting costs no time on the critical path (a gloo send waits for its
      receiver's word that the receive is posted: a round trip per message otherwise).
      When the message is *stable* (same description the last two times, as when training
      at a fixed shape) header and tensors travel packed in one buffer, which the receiver
      posts ahead at the size of last time and reads its tensors from without copying;
      otherwise only its header is posted and the rest follows. If a stable message changes
      after all, the sender fills the posted buffer with the header alone, then sends the
      description and real tensors: a rare extra transfer instead of a guess that could
      corrupt the wire.
    * NCCL (and ``receive_ahead=False`` on gloo, which tests use to run NCCL's order on
      the CPU): a process's operations run in issue order, so a receive posted early would
      hold back later sends and can deadlock. Headers and descriptions travel on a gloo
      side group (independent, received ahead); each tensor receive is posted at the
      point of :func:`receive_points`, where the sender's send falls in one global order
      of all the pipeline's transfers.

    Sends never block the runtime, and no thread waits for them: each header also says how
    many of the peer's messages of the step this rank has posted receives for, and the
    sends those cover are then complete, their buffers freed (``gpipe.transport.sender``);
    the rest are waited for once the step's agreement shows every rank received all.
    A negative header announces a failure: the description that follows it says what
    failed, and the receiver raises :class:`PipelineError` and passes the news on.
    """

    kind = "group"  # what Pipe.transport says

    def __init__(
        self,
        schedule: Any,
        rank: int,
        group: Any,
        devices: list[torch.device],
        *,
        timeout: float,
        routes: Routes | None = None,
        receive_ahead: bool | None = None,
    ) -> None:
        super().__init__(schedule, rank, group, devices, timeout=timeout, routes=routes)
        backend = _backend(group)
        # Collectives of the front end (loss, health check) use a device the backend supports.
        self.wire_device = self._local_device if backend == "nccl" else torch.device("cpu")
        self.receive_ahead = receive_ahead if receive_ahead is not None else backend == "gloo"
        self._direct = backend == "gloo"  # no coalescing: every operation posted by itself
        # Headers and descriptions: on the group itself where receiving ahead is safe,
        # otherwise on a gloo side group of the same processes.
        self._meta_group = group if self.receive_ahead else _gloo_twin(group)
        self._meta_device = self.wire_device if self.receive_ahead else torch.device("cpu")
        # NCCL: where each receive is posted; gloo: where a burst's receives are.
        points = receive_points if not self.receive_ahead else self._bursts
        self._points = {t: points(schedule, self.routes, rank, t) for t in (True, False)}
        self._cursor: dict[int, int] = {}
        self._pending: dict[int, deque[_Posted]] = {}  # posted, from each peer, in order
        self._arriving: dict[Message, _Posted] = {}  # header in, tensors not yet waited for
        members = tuple(self._dist.get_process_group_ranks(group))
        built = _transports_built.get(members, 0)
        _transports_built[members] = built + 1
        self._notice_tag = _NOTICE_TAG + 4 * built  # then its agreement's and seed's
        self._init_rows()
        self._outbox = Outbox(timeout)
        self._posted: dict[int, int] = {}  # from each peer: messages of the step fully posted

    # -- the order of messages on each wire ------------------------------------------------

    def begin(self, training: bool) -> None:
        """Start a step: reset the per-peer positions and post the first receives."""
        self.check_notices()  # a peer gave up on this pipeline since the last step
        self._begin_plan(training)
        self._cursor = dict.fromkeys(self._incoming, 0)
        self._posted = dict.fromkeys(self._incoming, 0)
        self._sent = dict.fromkeys(self._outgoing, 0)
        self._pending = {src: deque() for src in self._incoming}
        self._arriving.clear()
        self._row_sent = False
        for src in self._incoming:
            self._post_next(src)  # raises PipelineError if src left
        self._listen_for_notices()

    def prepare(self, action: Any) -> None:
        """This rank is about to run ``action``: post the receives due here (gloo: the
        burst's; NCCL: the tensors', in its order)."""
        for src, message in self._points[self._training].get(action, ()):
            if not self.receive_ahead:
                self._take_headers(src, until=message)
                continue
            while self._cursor[src] <= message:
                self._post_next(src)

    def _bursts(self, schedule: Any, routes: Routes, rank: int, training: bool) -> dict:
        """Where gloo posts a burst's receives: at the first action after one that sends (and
        at the first), those of every message it takes before its next send, so that each
        of a burst's messages lands at once instead of waiting for its receive to be posted
        (gloo's sender waits for the receiver's word that it posted).
        {action: [(peer, last position from it)]}."""
        incoming = self._plans[training][0]
        position = {m: (src, i) for src, ms in incoming.items() for i, m in enumerate(ms)}
        points: dict[Any, dict[int, int]] = {}
        start = None
        for action in schedule.actions[rank]:
            if not training and action.kind is not Kind.FORWARD:
                continue
            start = start or action
            for message in routes.incoming(action):
                if message in position:
                    src, at = position[message]
                    burst = points.setdefault(start, {})
                    burst[src] = max(at, burst.get(src, -1))
            if any(schedule.stage_to_rank[m.stage] != rank for m in routes.outgoing(action)):
                start = None
        return {action: list(last.items()) for action, last in points.items()}

    def finish(self) -> None:
        """End a step once every rank has received all of its messages (after the step's
        agreement): complete the sends no message acknowledged."""
        self._outbox.settle()

    def _listen_for_notices(self) -> None:
        """Start, once, a thread that waits for a failure notice from any peer.

        A thread, because a gloo receive tells that it completed only to ``wait()``.
        """
        if self._notices is not None:
            return
        self._notices = {}
        frame = torch.zeros(_NOTICE_BYTES, dtype=torch.uint8)
        work = self._dist.irecv(frame, src=None, group=self._meta_group, tag=self._notice_tag)
        threading.Thread(
            target=_wait_for_notice,
            args=(work, frame, self._notices),
            name="gpipe-failure-notice",
            daemon=True,
        ).start()

    # -- sending ----------------------------------------------------------------------------

    def send(self, message: Message, value: Any) -> None:
        if self._send_here(message, value):
            return
        dst = self.schedule.stage_to_rank[message.stage]
        history, meta, header, payload = self._described(dst, message, value)
        tag = self._sent[dst]
        if self.receive_ahead:
            self._post(dst, self._frames(dst, history, header, meta, payload), self.group, tag)
        else:
            self._post(dst, self._frames(dst, None, header, meta, []), self._meta_group, tag)
            self._post(dst, payload, self.group, tag)
        history.update(meta)
        self._sent[dst] += 1

    def _frames(
        self,
        dst: int,
        history: History | None,
        header: int,
        meta: bytes,
        payload: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """A message on the wire: header (0: described as last time; and the receives this
        rank has posted of the peer's messages), description, tensors.

        For a stable message the receiver has posted one packed buffer: header and
        tensors go in it, or the header alone when the message changed or failed.
        """
        head = torch.tensor([header, self._posted.get(dst, 0)], dtype=torch.int64)
        if history is not None and history.stable:
            if header == 0:
                return [history.pack(head, payload, self._local_device)]
            frames = [history.pack(head, None, self._local_device)]
        else:
            frames = [head.to(self._meta_device)]
        if header != 0:
            frames.append(bytes_tensor(meta, self._meta_device))
        return frames + payload

    def _post(
        self, dst: int, frames: list[torch.Tensor], group: Any, tag: int, at: int | None = None
    ) -> None:
        """Send ``frames``; ``at``: its position in the outbox (its tag unless given)."""
        if not frames:
            return
        try:
            works = self._p2p([(self._dist.isend, t, group) for t in frames], dst, tag)
        except RuntimeError as error:  # gloo: "Connection closed by peer"
            raise self._left(error, dst, "send to") from error
        self._outbox.add(dst, tag if at is None else at, works, frames)

    def _p2p(self, ops: list[tuple[Callable, torch.Tensor, Any]], peer: int, tag: int) -> list:
        """Post sends or receives (``dist.isend``/``dist.irecv``, tensor, group) with group
        rank ``peer``. One operation, or any number on gloo, goes straight to the process
        group (``torch.distributed``'s wrappers cost more than gloo's own posting for small
        messages); several on NCCL are coalesced into one group call."""
        dist = self._dist
        if len(ops) == 1 or self._direct:
            return [
                group.send([t], peer, tag) if op is dist.isend else group.recv([t], peer, tag)
                for op, t, group in ops
            ]
        glob = self._global(peer)
        return dist.batch_isend_irecv([dist.P2POp(op, t, glob, g, tag) for op, t, g in ops])

    # -- receiving --------------------------------------------------------------------------

    def recv(self, message: Message) -> Any:
        if message in self._mailbox:
            return self._mailbox.pop(message)
        src = self.schedule.stage_to_rank[self.routes.sender(message)]
        # With receives ahead its header may still be on the way; under NCCL's plan it has
        # come in at prepare(), before this action.
        self._take_headers(src, until=message)
        return self._finish(src, self._arriving.pop(message))

    def _post_next(self, src: int) -> None:
        """Post the receive of the next message from ``src``, if this step has one."""
        position = self._cursor[src]
        if position == len(self._incoming[src]):
            return
        self._cursor[src] = position + 1
        message = self._incoming[src][position]
        history = self._recv_meta.setdefault(self._key(src, message), History())
        posted = _Posted(message, history, tag=position)
        if self.receive_ahead and history.stable:
            device = self._devices[message.stage]
            posted.packed = torch.empty(history.layout[1], dtype=torch.uint8, device=device)
            posted.header = posted.packed[: 8 * HEADER].view(torch.int64)
            (posted.header_work,) = self._irecv([(posted.packed, self.group)], src, position)
        else:
            posted.header = torch.empty(HEADER, dtype=torch.int64, device=self._meta_device)
            (posted.header_work,) = self._irecv([(posted.header, self._meta_group)], src, position)
        self._pending[src].append(posted)

    def _take_headers(self, src: int, *, until: Message) -> None:
        """Receive the headers from ``src`` up to ``until``'s; post what else each brings."""
        while until not in self._arriving:
            if not self._pending.get(src):
                raise RuntimeError(f"rank {self.rank} expects no more messages from rank {src}")
            posted = self._pending[src].popleft()
            self._arriving[posted.message] = self._complete_header(src, posted)

    def _complete_header(self, src: int, posted: _Posted) -> _Posted:
        """Wait for a message's header; post the receives of whatever else of it comes."""
        message, history = posted.message, posted.history
        self._wait([posted.header_work], src, message)
        size, acknowledged = posted.header.tolist()
        self._outbox.acknowledged(src, acknowledged)
        if size == 0 and posted.packed is not None:
            history.update(history.last)  # as posted: nothing else of it is on the wire
            posted.leaves = history.unpack(posted.packed)
        else:
            if size != 0:
                meta = torch.empty(abs(size), dtype=torch.uint8, device=self._meta_device)
                received = self._irecv([(meta, self._meta_group)], src, posted.tag)
                self._wait(received, src, message)
                data = meta.cpu().numpy().tobytes()
                if size < 0:
                    raise _announced(self._notice_from(src, data))
                history.update(data)
            elif history.last is None:
                raise PipelineError(f"rank {src} sent {message} without describing it", rank=src)
            else:
                history.update(history.last)
            posted.leaves = history.allocate(self._devices[message.stage])
            frames = [(t, self.group) for t in posted.leaves if isinstance(t, torch.Tensor)]
            posted.works = self._irecv(frames, src, posted.tag)
        self._posted[src] += 1  # every receive of this message is posted
        if not self._pending[src]:
            self._post_next(src)  # keep the next message's receive posted
        return posted

    def _finish(self, src: int, posted: _Posted) -> Any:
        """Wait for a message's tensors; its value, with inputs that require grad."""
        self._wait(posted.works, src, posted.message)
        return posted.history.rebuild(posted.leaves, posted.message.channel.forward)

    def _irecv(self, ops: list[tuple[torch.Tensor, Any]], src: int, tag: int) -> list[Any]:
        if not ops:
            return []
        try:
            return self._p2p([(self._dist.irecv, t, g) for t, g in ops], src, tag)
        except RuntimeError as error:  # gloo: "Connection closed by peer"
            raise self._left(error, src, "receive from") from error

    def _wait(self, works: list, src: int, message: Message) -> None:
        try:
            for work in works:
                work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as error:  # a dead peer or a timeout: gloo and NCCL differ
            raise self._wait_failed(error, src, message) from error

    # -- failures ---------------------------------------------------------------------------

    def announce_failure(self, description: dict) -> None:
        """Tell every peer still expecting a message from this rank in this step."""
        meta = notice(description)
        for dst, sequence in self._outgoing.items():
            position = self._sent.get(dst, 0)
            if position >= len(sequence):
                continue
            # In place of the next message: what the peer posted for it gets the header.
            history = self._sent_meta.get(self._key(dst, sequence[position]))
            history = history if self.receive_ahead else None
            frames = self._frames(dst, history, -len(meta), meta, [])
            with contextlib.suppress(Exception):
                self._post(dst, frames, self._meta_group, position)
        # And every peer, which may be waiting for its sends to this rank to complete.
        frame = torch.zeros(_NOTICE_BYTES, dtype=torch.uint8)
        frame[:8].view(torch.int64)[0] = len(meta)
        frame[8 : 8 + len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        for peer in range(self.schedule.num_ranks):
            if peer != self.rank:
                with contextlib.suppress(Exception):
                    self._post(peer, [frame], self._meta_group, self._notice_tag)
        if description.get("gave_up") and not self._row_sent and self._row_like is not None:
            # It will send no agreement row: the peers waiting for one learn at once.
            peers = [p for p in range(self.schedule.num_ranks) if p != self.rank]
            with contextlib.suppress(Exception):
                self._send_row(AGREEMENT, peers, self._row_like, gave_up=True)
        self._outbox.abandon()

    def clear(self) -> None:
        self._mailbox.clear()
        self._arriving.clear()
        self._outbox.abandon()


def _wait_for_notice(work: Any, frame: torch.Tensor, notices: dict[str, Any]) -> None:
    try:
        work.wait(timeout=timedelta(days=365))  # until a peer fails or the group goes away
    except Exception:
        return
    length = int(frame[:8].view(torch.int64).item())
    notices.update(read_notice(frame[8 : 8 + length].numpy().tobytes(), None, "a peer"))


def _backend(group: Any) -> str:
    """What every NCCL path here is chosen by (a test names 'nccl' to run them on gloo)."""
    import torch.distributed as dist

    return dist.get_backend(group)


def _gloo_twin(group: Any) -> Any:
    """A gloo group of the same processes, for small host-side messages."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
