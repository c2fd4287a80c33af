"""One rank of a pipeline spread over processes: the one sequencing of the wire protocol
(``gpipe.transport.framing``) over either carrier, which only moves bytes (``sockets``:
same-host sockets; ``distributed``: the process group's point-to-point, gloo or NCCL).

Each pair of ranks exchanges one sequence of frames per step (seed row, messages in the
schedule's order, agreement row); every transfer of a frame is posted with its position as
tag. When receives are posted:

* ``receive_ahead`` (sockets; gloo by default): every frame of the step is received
  ahead, posted when the step begins (and the rest as frames are taken, while more than
  ``AHEAD`` bytes would be): a message lands while the rank computes, and a gloo send
  finds its receive posted (it waits for its receiver's word that it is, otherwise: a
  round trip). A *stable* message (same description the last two times) is ONE transfer:
  head and tensors packed in one buffer that the receiver posted at last time's size and
  reads its tensors from without copying. A frame in place of a stable message (it
  changed after all, a notice, a row after a notice) fills that buffer with its head
  alone; the rest follows: a rare extra transfer instead of a guess.
* NCCL (tests run its order on gloo by naming the backend 'nccl': test_nccl_paths.py):
  a process's operations run in issue order, so a receive posted early would hold
  back later sends and can deadlock. Heads and descriptions travel on a gloo side group
  (received ahead); each tensor receive is posted at the point of :func:`receive_points`,
  where the sender's send falls in one global order of all the pipeline's transfers.

Sends never block the runtime: each is let go once done (oldest first, at the next send)
or when the step ends (:meth:`finish`, after the agreement, when every rank has received
all). Every wait is bounded by the pipeline's timeout; a failed one names the rank that
caused it, and a failed rank tells its peers (``gpipe.transport.inquest``).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpipe.base.errors import PipelineError
from gpipe.schedule.comm_plan import receive_points, wire_order
from gpipe.schedule.routes import Message, Routes
from gpipe.transport.codec import CodecError
from gpipe.transport.framing import (
    AGREEMENT,
    HEAD,
    MESSAGE,
    NOTICE,
    NOTICE_ROW,
    SEED,
    History,
    bytes_tensor,
    flatten,
    head,
    read_head,
    row_of,
)
from gpipe.transport.inquest import failure, heard, left, state
from gpipe.transport.local import LocalTransport

__all__ = ["PeerTransport"]

# Bytes of receives a rank keeps posted ahead per peer: a step's small messages all at once
# (no receive is posted while the step runs: on gloo, posting one while the peer's data
# comes in makes gloo's thread spin on the pair's lock), large ones one at a time (their
# buffers would otherwise all be allocated at once: 1F1B's memory bound).
AHEAD = 1 << 20
_CPU = torch.device("cpu")  # of every head and description, on every carrier


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


class PeerTransport:
    """One rank's frames to and from its peers over ``carrier`` (see the module's docstring)."""

    def __init__(
        self,
        schedule: Any,
        rank: int,
        group: Any,
        devices: list[torch.device],
        carrier: Any,
        *,
        timeout: float,
        routes: Routes | None = None,
    ) -> None:
        self.carrier, self.kind = carrier, carrier.kind
        self.schedule, self.rank, self.group, self.timeout = schedule, rank, group, timeout
        self.routes = routes or Routes(schedule.num_stages)
        self.wire_device = carrier.wire_device  # where the group's collectives take tensors
        self.receive_ahead = carrier.receive_ahead
        self._devices = devices  # device of each stage (meaningful for local stages)
        self._here = LocalTransport(devices)  # messages between two stages of this rank
        self._plans = {training: self._sequences(training) for training in (True, False)}
        # NCCL: where each tensor receive is posted (in the one order of all transfers).
        self._points = {
            t: {} if self.receive_ahead else receive_points(schedule, self.routes, rank, t)
            for t in (True, False)
        }
        self._training = True
        # Per peer, this step's frames in wire order (messages, and the rows' kinds).
        self._incoming: dict[int, list[Any]] = {}
        self._outgoing: dict[int, list[Any]] = {}
        # Each peer's failure notice, once taken: the error it says, whether the peer gave up.
        self._told: dict[int, tuple[PipelineError, bool]] = {}
        self._sent: dict[int, int] = {}  # to each peer: frames of the step sent
        self._cursor: dict[int, int] = {}  # from each peer: frames posted
        self._pending: dict[int, deque[_Posted]] = {}  # posted, from each peer, in order
        self._ahead: dict[int, int] = {}  # bytes of those receives, from each peer
        self._arriving: dict[Any, _Posted] = {}  # taken before their turn (NCCL: prepare)
        self._seed_ahead: _Posted | None = None  # the next step's seed row, posted
        self._works: list[tuple[Any, list[torch.Tensor]]] = []  # the step's sends
        self._abandoned: list[Any] = []  # a failed step's sends: alive while they may run
        self._failed = False  # this rank announced a failure
        # What each message this rank sends or receives looked like last time, in training
        # and in inference (which sends no gradients along: its descriptions differ).
        self._histories: dict[bool, dict[Message, History]] = {True: {}, False: {}}
        self._history = self._histories[True]
        # Each message received: the rank it comes from, whether it carries a stage's inputs.
        self._routes: dict[Message, tuple[int, bool]] = {}

    # -- the order of frames on each wire ---------------------------------------------------

    def _sequences(self, training: bool) -> tuple[dict[int, list], dict[int, list]]:
        """Per peer, the frames of a step from it and to it: rank 0's seed row first, the
        schedule's messages in order, every rank's agreement row last."""
        incoming, outgoing = wire_order(self.schedule, self.routes, self.rank, training)
        peers = [p for p in range(self.schedule.num_ranks) if p != self.rank]
        seed = [SEED] if self.rank == 0 else []
        return (
            {p: [*([SEED] if p == 0 else []), *incoming.get(p, []), AGREEMENT] for p in peers},
            {p: [*seed, *outgoing.get(p, []), AGREEMENT] for p in peers},
        )

    def begin(self, training: bool) -> None:
        """Start a step: reset the per-peer positions and post the first receives."""
        self._training = training
        self._incoming, self._outgoing = self._plans[training]
        self._history = self._histories[training]
        self._here.clear()
        self._cursor = dict.fromkeys(self._incoming, 0)
        self._sent = dict.fromkeys(self._outgoing, 0)
        self._pending = {src: deque() for src in self._incoming}
        self._ahead = dict.fromkeys(self._incoming, 0)
        self._arriving.clear()
        if self._seed_ahead is not None:
            self._pending[0].append(self._seed_ahead)
            self._ahead[0] = self._seed_ahead.frame.numel()
            self._cursor[0], self._seed_ahead = 1, None
        for src in self._incoming:
            self._post_ahead(src)  # raises PipelineError if src left

    def prepare(self, action: Any) -> None:
        """This rank is about to run ``action``: under NCCL's order, take the heads of the
        messages whose tensor receives are posted here (ahead, all are posted already)."""
        for src, message in self._points[self._training].get(action, ()):
            self._arriving[message] = self._take(src, until=message)

    def ready(self, message: Message) -> bool:
        return True  # receiving blocks until the message is here

    def finish(self) -> None:
        """End a step once every rank has received all of its frames (after the step's
        agreement): complete its sends, which none can hold up now."""
        works, self._works = self._works, []
        for work, _ in works:
            work.wait(timeout=timedelta(seconds=self.timeout))

    def clear(self) -> None:
        """Drop what a failed step left; its sends are never waited for (a peer may never
        take them) but kept alive while they may run."""
        self._here.clear()
        self._arriving.clear()
        self._abandoned += self._works
        self._works = []

    # -- sending ----------------------------------------------------------------------------

    def send(self, message: Message, value: Any) -> None:
        """``message`` to the rank of its stage: its description (encoded only when it
        changed; the head's size 0: described as last time), then its tensors."""
        dst = self.schedule.stage_to_rank[message.stage]
        if dst == self.rank:  # to a stage of this rank
            self._here.send(message, value)
            return
        leaves, spec = flatten(value)
        payload = [leaf.detach().contiguous() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        history = self._history.get(message) or self._history.setdefault(message, History())
        try:
            meta = history.describe(spec, leaves)
        except CodecError as error:  # on the sending side, where the value was made
            raise CodecError(f"the {message.channel} of micro-batch {message.microbatch} for "
                             f"stage {message.stage}: {error}") from None  # fmt: skip
        self._emit(dst, MESSAGE, data=b"" if meta == history.last else meta, payload=payload)
        history.update(meta)

    def _emit(
        self,
        dst: int,
        kind: int,
        *,
        data: bytes = b"",
        payload: list[torch.Tensor] | None = None,
        row: torch.Tensor | None = None,
    ) -> None:
        """The next frame to ``dst``: its head (then ``data``, if any), then ``payload``.
        Where ``dst`` posted a packed buffer, that buffer's size: head and tensors in it, or
        the head alone."""
        position = self._sent[dst]
        self._sent[dst] = position + 1
        sequence = self._outgoing[dst]
        history = self._history.get(sequence[position]) if position < len(sequence) else None
        frame, payload = head(kind, position, len(data), row), payload or []
        if self.receive_ahead and history is not None and history.stable:  # posted packed
            whole = kind == MESSAGE and not data  # the message itself: one transfer
            frames = [history.parts(frame, payload if whole else None)]
            payload = [] if whole else payload
        else:
            frames = [bytes_tensor(frame)]
        frames += [bytes_tensor(data)] if data else []
        works = self._carry(True, dst, position, frames)
        if payload:
            works += self._carry(True, dst, position, payload, True)
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

    # -- receiving --------------------------------------------------------------------------

    def recv(self, message: Message) -> Any:
        route = self._routes.get(message)
        if route is None:
            sender = self.schedule.stage_to_rank[self.routes.sender(message)]
            route = self._routes[message] = (sender, message.channel.forward)
        src, forward = route
        if src == self.rank and self._here.ready(message):
            return self._here.recv(message)
        # With receives ahead its head may still be on the way; under NCCL's plan it has
        # come in at prepare(), before this action.
        posted = self._take(src, until=message)
        self._wait(posted.works, src, message)  # its tensors, where apart from its head
        return posted.history.rebuild(posted.leaves, forward)

    def _post_ahead(self, src: int) -> None:
        """Post the receives of the next frames from ``src``: at least one, more while
        fewer than ``AHEAD`` bytes are posted."""
        while self._cursor[src] < len(self._incoming[src]) and (
            not self._pending[src] or self._ahead[src] < AHEAD
        ):
            self._post_next(src)

    def _post_next(self, src: int) -> None:
        """Post the receive of the next frame from ``src`` (beyond its sequence: an
        agreement row after a notice in place of the last)."""
        position = self._cursor[src]
        sequence = self._incoming[src]
        self._cursor[src] = position + 1
        key = sequence[position] if position < len(sequence) else AGREEMENT
        posted = self._post(src, key, position)
        self._pending[src].append(posted)
        self._ahead[src] += posted.frame.numel()

    def _post(self, src: int, key: Any, position: int) -> _Posted:
        history = self._history.setdefault(key, History()) if isinstance(key, Message) else None
        if self.receive_ahead and history is not None and history.stable:
            device, size, data = self._devices[key.stage], history.decoded.size, True
        else:
            device, size, data = _CPU, HEAD, False
        frame = torch.empty(size, dtype=torch.uint8, device=device)
        (work,) = self._carry(False, src, position, [frame], data)
        return _Posted(key, history, position, frame, work)

    def _take(self, src: int, *, until: Any, deadline: float | None = None) -> _Posted:
        """Take the frames from ``src`` up to ``until``'s (a message, or a row's kind) and
        return it (at once where it was taken before its turn); post what else each brings
        (those before it wait in ``_arriving``). A notice in its place raises what it says;
        while taking the agreement, it is kept (the row that follows says the step failed)
        unless its rank gave up."""
        early = self._arriving.pop(until, None)
        if early is not None:
            return early
        while True:
            if not self._pending.get(src):
                raise RuntimeError(f"rank {self.rank} expects no more frames from rank {src}")
            posted = self._pending[src].popleft()
            self._ahead[src] -= posted.frame.numel()
            self._wait([posted.work], src, until, deadline)
            kind, position, size = read_head(posted.frame)
            if kind == NOTICE:
                if not self._pending[src]:
                    self._post_next(src)  # the agreement row that follows it
                row = row_of(posted.frame[:HEAD].cpu(), NOTICE_ROW).tolist()
                error, gave_up = heard(self.group, self.rank, src, row), bool(row[2])
                self._told.setdefault(src, (error, gave_up))
                if until != AGREEMENT or gave_up:
                    raise error
                continue
            self._post_ahead(src)
            if kind == MESSAGE:
                if position != posted.position or not isinstance(posted.key, Message):
                    raise PipelineError(
                        f"rank {self.rank} received frame {position} of this step from rank "
                        f"{src} where it expected {posted.key} at {posted.position}: the ranks "
                        "run different schedules; build every rank's Pipe with the same "
                        "arguments", rank=src)  # fmt: skip
                self._message_in(src, posted, size)
            key = posted.key if kind == MESSAGE else kind
            if key == until:
                return posted
            self._arriving[key] = posted

    def _message_in(self, src: int, posted: _Posted, size: int) -> None:
        """A message's head is in: its description (``size`` bytes, else as last time), then
        the receives of whatever else of it comes."""
        history = posted.history
        meta = history.last
        if size != 0:
            data = torch.empty(size, dtype=torch.uint8, device=_CPU)
            self._wait(self._carry(False, src, posted.position, [data]), src, posted.key)
            meta = data.numpy().tobytes()
        elif meta is None:
            raise PipelineError(f"rank {src} sent {posted.key} without describing it", rank=src)
        history.update(meta)
        if size == 0 and posted.frame.numel() > HEAD:  # packed: nothing else of it comes
            posted.leaves = history.unpack(posted.frame)
            return
        posted.leaves = history.allocate(self._devices[posted.key.stage])
        tensors = [t for t in posted.leaves if isinstance(t, torch.Tensor)]
        posted.works = self._carry(False, src, posted.position, tensors, True)

    def _carry(self, sends: bool, peer: int, position: int, tensors: list, data=False) -> list:
        """Post sends (or receives) of a frame's ``tensors`` (``data``: its message's)."""
        try:
            return self.carrier.post(sends, peer, position, tensors, data)
        except RuntimeError as error:  # gloo: "Connection closed by peer"
            raise self._left(error, peer, "send to" if sends else "receive from") from error

    def _wait(self, works: list, src: int, what: Any, deadline: float | None = None) -> None:
        """Wait for receives from ``src`` of ``what`` (a message; a row's kind: the error of
        its wait, for ``row`` to name)."""
        if not works:  # a packed message's tensors: in its frame, taken already
            return
        left = self.timeout if deadline is None else max(deadline - time.monotonic(), 0.001)
        try:
            for work in works:
                work.wait(timeout=timedelta(seconds=left))
        except Exception as error:  # a dead peer or a timeout: gloo and NCCL differ
            if not isinstance(what, Message):
                raise
            words = f"the receive from rank {self._global(src)} of the {what.channel} of "
            words += f"micro-batch {what.microbatch}"
            raise failure(
                self.group, self.rank, [src], words, error, timeout=self.timeout, cause_first=True
            ) from error

    # -- failures and the step's rows: frames of the same sequences -----------------------

    def announce_failure(
        self, origin: int, culprit: int | None, message: str, *, gave_up: bool
    ) -> None:
        """State ``message`` (pipeline rank ``origin`` failed, caused by global rank
        ``culprit`` where known), then tell every peer that still expects a frame of this
        step, within a second; its agreement row follows unless this rank ``gave_up``."""
        me = self._global(self.rank)
        others = [self._global(r) for r in range(self.schedule.num_ranks) if r != self.rank]
        waits_on = [] if culprit == me else others if culprit is None else [culprit]
        state(me, waits_on, message)  # before the notices: they point here
        self._failed = True
        row = [origin, -1 if culprit is None else culprit, gave_up]
        row = torch.tensor(row, dtype=torch.int64)
        for dst, sequence in self._outgoing.items():
            if self._sent.get(dst, 0) < len(sequence):
                with contextlib.suppress(Exception):
                    self._emit(dst, NOTICE, row=row)
        self.carrier.flush(min(1.0, self.timeout))
        self.clear()

    def peer_gave_up(self) -> bool:
        """Whether a peer left without agreeing on its failure: nobody to agree with."""
        return any(gave_up for _, gave_up in self._told.values())

    def _global(self, rank: int) -> int:  # a rank of the job, as the user knows it
        return dist.get_global_rank(self.group, rank)

    def _left(self, error: Exception, peer: int, doing: str) -> PipelineError:
        """Posting a transfer failed: ``peer`` left. The failure it announced, if any."""
        for told, _ in self._told.values():  # it gave up on this step, and said why
            return told
        return left(self.group, self.rank, peer, error, doing, timeout=self.timeout)

    def row(self, kind: int, row: torch.Tensor, what: str, doing: str) -> torch.Tensor:
        """The step's row of ``kind`` (of one dtype and length on every rank; ``what``,
        ``doing``: an error's words for it): ``SEED``, rank 0's, sent ahead of its messages;
        ``AGREEMENT``, every rank's stacked by rank, after the step's messages (a rank that
        failed sends its row after its notice). One that does not come raises
        ``inquest.failure``, or the words of a peer that gave up (it looked for the cause)."""
        senders = [0] if self.rank else []  # of the seed: rank 0, which waits for nobody
        if kind == AGREEMENT:  # the nearest first: where several failed, nearer the cause
            senders = sorted(self._incoming, key=lambda p: abs(p - self.rank))
        if kind == AGREEMENT or not self.rank:
            for peer in self._outgoing:
                self._emit(peer, kind, row=row)
        deadline, rows = time.monotonic() + self.timeout, {self.rank: row}
        for src in senders:
            try:
                taken = self._take(src, until=kind, deadline=deadline)
            except Exception as error:
                if self.peer_gave_up():  # its notice, taken here: a gave-up notice ends the step
                    raise
                timed_out = False if isinstance(error, PipelineError) else None  # a notice
                raise failure(self.group, self.rank, [src], what, error, timeout=self.timeout,
                              doing=doing, timed_out=timed_out) from error  # fmt: skip
            rows[src] = row_of(taken.frame.cpu(), row)
            if kind == AGREEMENT and src == 0:  # the next step's seed, posted ahead
                self._seed_ahead = self._post(0, SEED, 0)
        if kind == SEED:
            return rows[0]
        if self._told or self._failed:  # a peer may still take them: written within a second
            self.carrier.flush(min(1.0, self.timeout))
        else:  # every rank took all: none can wait; here, so a step refused after it frees them
            self.finish()
        return torch.stack([rows[r] for r in range(self.schedule.num_ranks)])
