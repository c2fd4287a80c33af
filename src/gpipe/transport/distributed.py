"""Transport between processes: point-to-point ``torch.distributed`` (gloo on CPU, NCCL on GPU).

The one story of how receives are posted is :class:`DistributedTransport`'s docstring.
"""

from __future__ import annotations

import contextlib
import threading
import time
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
    HEAD,
    MESSAGE,
    NOTICE,
    SEED,
    History,
    bytes_tensor,
    head,
    notice,
    read_head,
    read_notice,
    row_of,
)
from gpipe.transport.peers import PeerTransport, _announced, said_in

__all__ = ["DistributedTransport"]

_NOTICE_BYTES = 4096
# Tags: each transport built on a group takes its own range for its frames, above those a
# user's own transfers take (a receive posted ahead must take no other's), and one for
# notices to every peer outside the sequences; the n-th the same on every rank.
_FRAMES, _RANGE, _NOTICE_TAG = 1 << 29, 1 << 20, 1 << 30
_transports_built: dict[tuple[int, ...], int] = {}


@dataclass
class _Posted:
    """Receives posted for one incoming frame: its head (or its packed buffer), then what
    else of it comes."""

    key: Any  # the Message, or the row's kind, the sequence has at its position
    history: History | None
    position: int  # in the peer's sequence: every transfer of the frame carries it as tag
    frame: torch.Tensor  # its head, or the packed buffer of a stable message (head first)
    work: Any
    leaves: list[Any] | None = None
    works: list[Any] = field(default_factory=list)  # receives of the tensors, when separate


class DistributedTransport(PeerTransport):
    """Point-to-point transport between processes through ``torch.distributed``.

    Each pair of ranks exchanges one sequence of frames per step (``gpipe.transport.framing``:
    the seed row, the messages in the schedule's order, the agreement row), every frame on
    the tag of its position, so that on gloo the receive of a next frame can be posted
    before the current one has fully arrived without taking its bytes (NCCL ignores tags
    and is never asked to). A message's head says whether its description follows (it
    changed since last time: shapes may change from step to step); its tensors follow.

    When receives are posted depends on the backend:

    * gloo (``receive_ahead``, the default for gloo): the next frame from each peer is always
      posted, and where a burst begins (the messages a rank takes between two of its sends,
      as a GPipe schedule's forwards) all of the burst's, so a message lands while the rank
      computes (a gloo send waits for its receiver's word that the receive is posted: a
      round trip per message otherwise). A *stable* message (same description the last two
      times, as when training at a fixed shape) is ONE transfer: head and tensors packed in
      one buffer that the receiver posted at last time's size and reads its tensors from
      without copying. A frame in place of a stable message (it changed after all, a
      notice, a row after a notice) fills that buffer with its head alone; the rest
      follows: a rare extra transfer instead of a guess that could corrupt the wire.
    * NCCL (and ``receive_ahead=False`` on gloo, which tests use to run NCCL's order on
      the CPU): a process's operations run in issue order, so a receive posted early would
      hold back later sends and can deadlock. Heads and descriptions travel on a gloo side
      group (independent, received ahead); each tensor receive is posted at the point of
      :func:`receive_points`, where the sender's send falls in one global order of all the
      pipeline's transfers.

    Sends never block the runtime and are not waited for one by one: their works and
    buffers are kept until done (seen at the next send) or the step ends (:meth:`finish`,
    after the agreement, when every rank has received all and none can wait).
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
        # Heads and descriptions: on the group itself where receiving ahead is safe,
        # otherwise on a gloo side group of the same processes.
        self._meta_group = group if self.receive_ahead else _gloo_twin(group)
        self._meta_device = self.wire_device if self.receive_ahead else torch.device("cpu")
        # NCCL: where each receive is posted; gloo: where a burst's receives are.
        points = receive_points if not self.receive_ahead else self._bursts
        self._points = {t: points(schedule, self.routes, rank, t) for t in (True, False)}
        self._cursor: dict[int, int] = {}  # from each peer: frames posted
        self._pending: dict[int, deque[_Posted]] = {}  # posted, from each peer, in order
        self._arriving: dict[Any, _Posted] = {}  # head in, tensors not yet waited for
        self._seed_ahead: _Posted | None = None  # the next step's seed row, posted
        self._works: list[tuple[Any, list[torch.Tensor]]] = []  # the step's sends
        self._abandoned: list[Any] = []  # a failed step's sends: alive while they may run
        self._failed = False  # this rank announced a failure
        members = tuple(self._dist.get_process_group_ranks(group))
        built = _transports_built.get(members, 0)
        _transports_built[members] = built + 1
        self._notice_tag, self._tags = _NOTICE_TAG + built, _FRAMES + built * _RANGE

    # -- the order of frames on each wire ---------------------------------------------------

    def begin(self, training: bool) -> None:
        """Start a step: reset the per-peer positions and post the first receives."""
        self.check_notices()  # a peer gave up on this pipeline since the last step
        self._begin_plan(training)
        self._cursor = dict.fromkeys(self._incoming, 0)
        self._sent = dict.fromkeys(self._outgoing, 0)
        self._pending = {src: deque() for src in self._incoming}
        self._arriving.clear()
        if self._seed_ahead is not None:
            self._pending[0].append(self._seed_ahead)
            self._cursor[0], self._seed_ahead = 1, None
        for src in self._incoming:
            if not self._pending[src]:
                self._post_next(src)  # raises PipelineError if src left
        self._listen_for_notices()

    def prepare(self, action: Any) -> None:
        """This rank is about to run ``action``: post the receives due here (gloo: the
        burst's; NCCL: the tensors', in its order)."""
        for src, message in self._points[self._training].get(action, ()):
            if not self.receive_ahead:
                self._take(src, until=message)
                continue
            while self._cursor[src] <= message:
                self._post_next(src)

    def _bursts(self, schedule: Any, routes: Routes, rank: int, training: bool) -> dict:
        """Where gloo posts a burst's receives: at the first action after one that sends (and
        at the first), those of every message it takes before its next send, so that each
        of a burst's messages lands at once instead of waiting for its receive to be posted.
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
        """End a step once every rank has received all of its frames (after the step's
        agreement): complete its sends, which none can hold up now."""
        works, self._works = self._works, []
        for work, _ in works:
            work.wait(timeout=timedelta(seconds=self.timeout))

    def all_gather_row(self, row: torch.Tensor) -> torch.Tensor:
        rows = super().all_gather_row(row)
        if not self._notices and not self._failed:  # every rank took all: none can wait
            self.finish()  # here, so that a step refused after its agreement frees them too
        return rows

    def _listen_for_notices(self) -> None:
        """Start, once, a thread that waits for a failure notice from any peer (a gloo
        receive tells that it completed only to ``wait()``)."""
        if self._notices is not None:
            return
        self._notices = {}
        frame = torch.zeros(_NOTICE_BYTES, dtype=torch.uint8)
        work = self._dist.irecv(frame, src=None, group=self._meta_group, tag=self._notice_tag)
        threading.Thread(target=_wait_for_notice, args=(work, frame, self._notices),
                         name="gpipe-failure-notice", daemon=True).start()  # fmt: skip

    # -- sending ----------------------------------------------------------------------------

    def send(self, message: Message, value: Any) -> None:
        if self._send_here(message, value):
            return
        dst = self.schedule.stage_to_rank[message.stage]
        history, meta, size, payload = self._described(dst, message, value)
        self._emit(dst, MESSAGE, size=size, data=meta, payload=payload)
        history.update(meta)

    def _send_row(self, dst: int, kind: int, row: torch.Tensor) -> None:
        self._emit(dst, kind, row=row)

    def _emit(
        self,
        dst: int,
        kind: int,
        *,
        size: int = 0,
        data: bytes = b"",
        payload: list[torch.Tensor] | None = None,
        row: torch.Tensor | None = None,
    ) -> None:
        """The next frame to ``dst``: its head (``size`` bytes of ``data`` follow when not
        0), then ``payload``. Where ``dst`` posted a packed buffer, that buffer's size:
        head and tensors in it, or the head alone."""
        position = self._sent[dst]
        self._sent[dst] = position + 1
        sequence = self._outgoing[dst]
        key = sequence[position] if position < len(sequence) else None
        history = self._sent_meta.get(self._key(dst, key)) if self.receive_ahead else None
        frame = head(kind, position, size, row)
        payload = payload or []
        if history is not None and history.stable:
            whole = kind == MESSAGE and size == 0
            frames = [history.pack(frame, payload if whole else None, self._local_device)]
            payload = [] if whole else payload
        else:
            frames = [bytes_tensor(frame, self._meta_device)]
        if size:
            frames.append(bytes_tensor(data, self._meta_device))
        try:
            works = self._p2p([(self._dist.isend, t, self._meta_group) for t in frames], dst,
                              position)  # fmt: skip
            works += self._p2p([(self._dist.isend, t, self.group) for t in payload], dst, position)
        except RuntimeError as error:  # gloo: "Connection closed by peer"
            raise self._left(error, dst, "send to") from error
        self._works += [(work, frames + payload) for work in works]
        self._release_sent()

    def _release_sent(self) -> None:
        """Let go of the sends already done, oldest first: kept to the step's end, a stage's
        sent activations would stay beside the inputs it keeps (all M of them, on GPU too)."""
        works, done = self._works, 0
        while done < len(works) and works[done][0].is_completed():
            works[done][0].wait()  # at once; so the backend lets go of it here, not later
            done += 1
        del works[:done]

    def _p2p(self, ops: list[tuple[Callable, torch.Tensor, Any]], peer: int, position: int) -> list:
        """Post sends or receives (``dist.isend``/``dist.irecv``, tensor, group) of the frame
        at ``position`` with group rank ``peer``. One operation, or any number on gloo, goes
        straight to the process group (``torch.distributed``'s wrappers cost more than gloo's
        own posting for small messages); several on NCCL are coalesced into one group call."""
        dist, tag = self._dist, self._tags + position
        if not ops:
            return []
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
        # With receives ahead its head may still be on the way; under NCCL's plan it has
        # come in at prepare(), before this action.
        self._take(src, until=message)
        posted = self._arriving.pop(message)
        self._wait(posted.works, src, message)
        return posted.history.rebuild(posted.leaves, message.channel.forward)

    def _take_row(self, src: int, kind: int, like: torch.Tensor, deadline: float) -> torch.Tensor:
        if self.peer_gave_up():  # it sends no row: nobody is left to agree with
            raise ConnectionError(self._notices["message"])
        try:
            self._take(src, until=kind, deadline=deadline)
        except PipelineError as error:  # a notice in its place: the caller names it
            raise ConnectionError(str(error)) from error
        posted = self._arriving.pop(kind)
        if kind == AGREEMENT and self.rank != 0 and src == 0:
            self._seed_ahead = self._post(0, SEED, 0, None)  # the next step's, ahead
        return row_of(posted.frame.cpu(), like)

    def _post_next(self, src: int, beyond: bool = False) -> None:
        """Post the receive of the next frame from ``src``, if this step has one (or
        ``beyond`` its sequence: an agreement row after a notice in place of the last)."""
        position = self._cursor[src]
        sequence = self._incoming[src]
        if position >= len(sequence) and not beyond:
            return
        self._cursor[src] = position + 1
        key = sequence[position] if position < len(sequence) else AGREEMENT
        history = None
        if isinstance(key, Message):
            history = self._recv_meta.setdefault(self._key(src, key), History())
        self._pending[src].append(self._post(src, key, position, history))

    def _post(self, src: int, key: Any, position: int, history: History | None) -> _Posted:
        if self.receive_ahead and history is not None and history.stable:
            device, group, size = self._devices[key.stage], self.group, history.layout[1]
        else:
            device, group, size = self._meta_device, self._meta_group, HEAD
        frame = torch.empty(size, dtype=torch.uint8, device=device)
        (work,) = self._irecv([(frame, group)], src, position)
        return _Posted(key, history, position, frame, work)

    def _take(self, src: int, *, until: Any, deadline: float | None = None) -> None:
        """Take the frames from ``src`` up to ``until``'s (a message, or a row's kind); post
        what else each brings. A notice in its place raises what it says; while taking the
        agreement, it is kept (the row that follows says the step failed) unless its rank
        gave up."""
        while until not in self._arriving:
            if not self._pending.get(src):
                raise RuntimeError(f"rank {self.rank} expects no more frames from rank {src}")
            posted = self._pending[src].popleft()
            self._wait([posted.work], src, until, deadline)
            kind, _, size = read_head(posted.frame[:24].cpu())
            if not self._pending[src]:
                self._post_next(src, beyond=kind == NOTICE)  # keep the next one posted
            if kind == NOTICE:
                said = self._notice_from(src, self._receive_bytes(src, posted, size, until))
                self._notices.update(said)
                if until != AGREEMENT or said.get("gave_up"):
                    raise _announced(said)
                continue
            if kind == MESSAGE:
                self._message_in(src, posted, size)
            self._arriving[posted.key if kind == MESSAGE else kind] = posted

    def _message_in(self, src: int, posted: _Posted, size: int) -> None:
        """A message's head is in: post the receives of whatever else of it comes."""
        message, history = posted.key, posted.history
        if size == 0 and posted.frame.numel() > HEAD:
            history.update(history.last)  # as posted: nothing else of it is on the wire
            posted.leaves = history.unpack(posted.frame)
            return
        if size != 0:
            history.update(self._receive_bytes(src, posted, size, message))
        elif history.last is None:
            raise PipelineError(f"rank {src} sent {message} without describing it", rank=src)
        else:
            history.update(history.last)
        posted.leaves = history.allocate(self._devices[message.stage])
        frames = [(t, self.group) for t in posted.leaves if isinstance(t, torch.Tensor)]
        posted.works = self._irecv(frames, src, posted.position)

    def _receive_bytes(self, src: int, posted: _Posted, size: int, what: Any) -> bytes:
        data = torch.empty(size, dtype=torch.uint8, device=self._meta_device)
        self._wait(self._irecv([(data, self._meta_group)], src, posted.position), src, what)
        return data.cpu().numpy().tobytes()

    def _irecv(self, ops: list[tuple[torch.Tensor, Any]], src: int, position: int) -> list[Any]:
        try:
            return self._p2p([(self._dist.irecv, t, g) for t, g in ops], src, position)
        except RuntimeError as error:  # gloo: "Connection closed by peer"
            raise self._left(error, src, "receive from") from error

    def _wait(self, works: list, src: int, what: Any, deadline: float | None = None) -> None:
        """Wait for receives from ``src`` of ``what`` (a message, or a row's kind: those
        raise ``TimeoutError`` or ``ConnectionError`` naming ``src``, for the caller)."""
        left = self.timeout if deadline is None else max(deadline - time.monotonic(), 0.001)
        try:
            for work in works:
                work.wait(timeout=timedelta(seconds=left))
        except Exception as error:  # a dead peer or a timeout: gloo and NCCL differ
            if isinstance(what, Message):
                raise self._wait_failed(error, src, what) from error
            text, timed_out = said_in(error)
            failure = TimeoutError if timed_out else ConnectionError
            raise failure(f"rank {self._global(src)}: {text}") from error

    # -- failures ---------------------------------------------------------------------------

    def announce_failure(self, description: dict) -> None:
        """Tell every peer: in place of the next frame of its sequence if it still expects
        one (then, unless this rank gave up, its agreement row follows), and outside the
        sequences to every peer (it may be waiting for another rank, or between steps)."""
        self._failed, text = True, notice(description)
        for dst, sequence in self._outgoing.items():
            if self._sent.get(dst, 0) < len(sequence):
                with contextlib.suppress(Exception):
                    self._emit(dst, NOTICE, size=len(text), data=text)
        frame = torch.zeros(_NOTICE_BYTES, dtype=torch.uint8)
        frame[: HEAD + len(text)] = bytes_tensor(head(NOTICE, -1, len(text)) + text, frame.device)
        for peer in range(self.schedule.num_ranks):
            if peer != self.rank:
                with contextlib.suppress(Exception):
                    work = self._meta_group.send([frame], peer, self._notice_tag)
                    self._works.append((work, [frame]))
        self.clear()

    def clear(self) -> None:
        self._mailbox.clear()
        self._arriving.clear()
        self._abandoned += self._works  # never waited for: a peer may never take them
        self._works = []


def _wait_for_notice(work: Any, frame: torch.Tensor, notices: dict[str, Any]) -> None:
    try:
        work.wait(timeout=timedelta(days=365))  # until a peer fails or the group goes away
    except Exception:
        return
    _, _, size = read_head(frame)
    notices.update(read_notice(frame[HEAD : HEAD + size].numpy().tobytes(), None, "a peer"))


def _backend(group: Any) -> str:
    """What every NCCL path here is chosen by (a test names 'nccl' to run them on gloo)."""
    import torch.distributed as dist

    return dist.get_backend(group)


def _gloo_twin(group: Any) -> Any:
    """A gloo group of the same processes, for small host-side messages."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
