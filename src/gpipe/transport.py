"""Transport: moves activations forward and gradients backward between stages.

The runtime addresses every message by what it is — the activation entering stage ``s``
for micro-batch ``m``, or the gradient leaving it — and never by who sends it, so the
same runtime works whether the neighbouring stage lives on another device of this
process or in another process.

:class:`LocalTransport` serves stages held by one process: a message is a device copy
(``Tensor.to``) put in a mailbox; nothing is serialized. :class:`DistributedTransport`
serves one rank of a pipeline spread over processes, with ``torch.distributed``
point-to-point operations (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import contextlib
import functools
import math
import pickle
import queue
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any

import torch
from torch.utils._pytree import (
    tree_flatten,
    tree_map,
    tree_unflatten,
    treespec_dumps,
    treespec_loads,
)

__all__ = [
    "Channel",
    "Routes",
    "DistributedTransport",
    "LocalTransport",
    "Message",
    "PipelineError",
    "RECEIVE_AHEAD_BACKENDS",
    "receive_points",
    "to_device",
]


class Channel(StrEnum):
    ACTIVATION = "activation"  # output of stage s-1, input of stage s
    GRADIENT = "gradient"  # gradient of stage s+1's input, for stage s's output
    SKIP = "skip"  # a stashed tensor, from the stage that stashes it to the one that pops it
    SKIP_GRADIENT = "skip gradient"  # its gradient, back to the stage that stashed it

    @property
    def forward(self) -> bool:
        """Carries a stage's inputs (which need ``requires_grad`` leaves on arrival)."""
        return self in (Channel.ACTIVATION, Channel.SKIP)


@dataclass(frozen=True, slots=True)
class Message:
    channel: Channel
    stage: int  # the stage that receives it
    microbatch: int
    name: str = ""  # the skip connection's name, for SKIP and SKIP_GRADIENT


class Routes:
    """Which messages each action receives and sends: the one place that knows the wiring.

    ``F(m)@s`` receives the activation into ``s`` (unless s is the first stage) and the
    skip tensors ``s`` pops, and sends its output to ``s+1`` and its stashes to the stages
    that pop them. ``B(m)@s`` receives the gradient of its output and of its stashes and
    sends its input's gradient back, and the gradients of what it popped to their
    stashing stages. ``W`` moves nothing.
    """

    def __init__(self, num_stages: int, skips: dict[int, Any] | None = None) -> None:
        self.last = num_stages - 1
        self.skips = skips or {}  # stage -> gpipe.skip.StageSkips

    def _skips(self, stage: int) -> tuple[dict[str, int], dict[str, int]]:
        view = self.skips.get(stage)
        return (view.inputs, view.outputs) if view is not None else ({}, {})

    def incoming(self, action: Any) -> list[Message]:
        s, m = action.stage, action.microbatch
        popped, stashed = self._skips(s)
        if action.kind.value == "F":
            head = [Message(Channel.ACTIVATION, s, m)] if s > 0 else []
            return head + [Message(Channel.SKIP, s, m, name) for name in popped]
        if action.kind.value == "B":
            head = [Message(Channel.GRADIENT, s, m)] if s < self.last else []
            return head + [Message(Channel.SKIP_GRADIENT, s, m, name) for name in stashed]
        return []

    def outgoing(self, action: Any) -> list[Message]:
        s, m = action.stage, action.microbatch
        popped, stashed = self._skips(s)
        if action.kind.value == "F":
            head = [Message(Channel.ACTIVATION, s + 1, m)] if s < self.last else []
            return head + [Message(Channel.SKIP, stage, m, n) for n, stage in stashed.items()]
        if action.kind.value == "B":
            head = [Message(Channel.GRADIENT, s - 1, m)] if s > 0 else []
            return head + [
                Message(Channel.SKIP_GRADIENT, stage, m, n) for n, stage in popped.items()
            ]
        return []

    def sender(self, message: Message) -> int:
        """The stage that sends ``message``."""
        popped, stashed = self._skips(message.stage)
        return {
            Channel.ACTIVATION: lambda: message.stage - 1,
            Channel.GRADIENT: lambda: message.stage + 1,
            Channel.SKIP: lambda: popped[message.name],
            Channel.SKIP_GRADIENT: lambda: stashed[message.name],
        }[message.channel]()


def to_device(value: Any, device: torch.device, *, as_leaves: bool = False) -> Any:
    """Copy every tensor of ``value`` to ``device``.

    With ``as_leaves`` the copies are detached leaves that require grad exactly where the
    originals did, ready to be a stage's inputs.
    """
    # A device-to-host copy must finish before the host reads it: only copies onto an
    # accelerator may be asynchronous.
    non_blocking = device.type != "cpu"

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        moved = leaf.detach().to(device, non_blocking=non_blocking)
        if as_leaves and leaf.requires_grad:
            moved.requires_grad_(True)
        return moved

    return tree_map(move, value)


class LocalTransport:
    """Mailboxes for stages that all live in this process."""

    def __init__(self, devices: list[torch.device]) -> None:
        self._devices = devices  # device of each stage
        self._mailbox: dict[Message, Any] = {}

    def prepare(self, action: Any) -> None:
        pass  # copies between devices of one process are never posted ahead

    def send(self, message: Message, value: Any) -> None:
        device = self._devices[message.stage]
        self._mailbox[message] = to_device(value, device, as_leaves=message.channel.forward)

    def ready(self, message: Message) -> bool:
        return message in self._mailbox

    def recv(self, message: Message) -> Any:
        return self._mailbox.pop(message)

    def clear(self) -> None:
        self._mailbox.clear()


# -- many processes --------------------------------------------------------------------------


class PipelineError(RuntimeError):
    """A failure elsewhere in the pipeline (another rank raised, died or stalled)."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank  # the pipeline rank that failed first, when known


@dataclass(frozen=True)
class _TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


class _History:
    """What one message (one peer, one kind, one micro-batch) looked like last time.

    Sender and receiver update theirs identically, so both know whether the receiver
    posted the message's buffers ahead (it does when the message is *stable*: the same
    description the last two times).
    """

    __slots__ = ("_decoded", "_layout", "last", "stable")

    def __init__(self) -> None:
        self.last: bytes | None = None
        self.stable = False
        self._decoded: Any = None
        self._layout: Any = None

    def update(self, meta: bytes) -> None:
        self.stable = meta == self.last
        if not self.stable:
            self.last, self._decoded, self._layout = meta, None, None

    @property
    def decoded(self) -> tuple[Any, list[Any]]:
        """(tree spec, leaves with a ``_TensorMeta`` for each tensor) of the last message."""
        if self._decoded is None:
            spec, described = pickle.loads(self.last)
            self._decoded = (treespec_loads(spec), described)
        return self._decoded

    @property
    def layout(self) -> tuple[list[tuple[int, int]], int]:
        """Where a packed message puts each tensor: (offset, bytes) each, and the total.

        The int64 header comes first; every part starts on a 16-byte boundary, so each
        tensor can be a view of the packed bytes.
        """
        if self._layout is None:
            spans, offset = [], _ALIGN
            for d in self.decoded[1]:
                if isinstance(d, _TensorMeta):
                    size = math.prod(d.shape) * d.dtype.itemsize
                    spans.append((offset, size))
                    offset += -(-size // _ALIGN) * _ALIGN
            self._layout = (spans, offset)
        return self._layout

    def pack(
        self, header: int, tensors: list[torch.Tensor] | None, device: torch.device
    ) -> torch.Tensor:
        """Header and tensors (contiguous, as described last time) in one byte buffer."""
        spans, total = self.layout
        packed = torch.empty(total, dtype=torch.uint8, device=device)
        packed[:8].view(torch.int64).fill_(header)
        if tensors is not None:
            for tensor, (offset, size) in zip(tensors, spans, strict=True):
                packed[offset : offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
        return packed

    def unpack(self, packed: torch.Tensor) -> list[Any]:
        """The message's leaves, its tensors as views of ``packed`` (no copy)."""
        spans = iter(self.layout[0])
        leaves = []
        for d in self.decoded[1]:
            if isinstance(d, _TensorMeta):
                offset, size = next(spans)
                leaves.append(packed[offset : offset + size].view(d.dtype).view(d.shape))
            else:
                leaves.append(d)
        return leaves


_ALIGN = 64  # bytes: a cache line, so that vectorized kernels see aligned tensors


@dataclass
class _Posted:
    """Receives posted for one incoming message: its header, and maybe its tensors."""

    message: Message
    history: _History
    tag: int  # its position in the peer's sequence: every frame of it carries that tag
    header: Any = None  # int64 tensor of one element
    header_work: Any = None
    packed: torch.Tensor | None = None  # header and tensors in one buffer (stable message)
    leaves: list[Any] | None = None
    works: list[Any] = field(default_factory=list)  # receives of the tensors, when separate


# Backends whose point-to-point operations proceed independently of each other, so that
# receives may be posted long before they are needed. NCCL is not one: it runs a
# process's operations on a stream in the order they were issued, and a receive posted
# early holds back every later send.
RECEIVE_AHEAD_BACKENDS = frozenset({"gloo"})


class DistributedTransport:
    """Point-to-point transport between processes through ``torch.distributed``.

    Every message to another rank is framed as a one-element ``int64`` header, the
    pickled description of the value (its structure, and each tensor's dtype, shape and
    ``requires_grad``) when it differs from the last time this message was sent, then the
    tensors themselves. Shapes may therefore change from step to step.

    Messages between two ranks are received in the order the sender sends them, which
    the schedule fixes: a receiver waiting for message X first takes any that its peer
    sent before X. That keeps the wire order identical on both sides, as NCCL requires.
    Every frame also carries the message's position in that sequence as its tag, so
    that on gloo the receive of the next message can be posted before the current one
    has fully arrived without taking its frames (NCCL ignores tags and is never asked to).

    When receives are posted depends on the backend:

    * gloo (:data:`RECEIVE_AHEAD_BACKENDS`): the next message from each peer is always
      posted, and the one after it too while the rank waits, so a message lands while
      the rank computes and posting costs no time on the critical path. When
      the message is *stable* (same description the last two times, as when training at
      a fixed shape) header and tensors travel packed in one buffer, which the receiver
      posts ahead at the size of last time and reads its tensors from without copying;
      otherwise only its header is posted and the rest follows. If a stable message
      changes after all, the sender fills the posted buffer with the header alone, then
      sends the description and real tensors: a rare extra transfer instead of a guess
      that could corrupt the wire.
    * NCCL: a process's operations run in issue order, so a receive posted early would
      hold back later sends and can deadlock. Headers and descriptions travel on a gloo
      side group (independent, received ahead); each tensor receive is posted at the
      point of :func:`receive_points`, where the sender's send falls in one global order
      of all the pipeline's transfers.

    Sends never block the runtime. A background thread waits for each send to complete
    and then drops its tensors, so sent buffers are freed as soon as the peer has them.
    A negative header announces a failure: the description that follows it says what
    failed, and the receiver raises :class:`PipelineError` and passes the news on.
    """

    def __init__(
        self,
        schedule: Any,
        rank: int,
        group: Any,
        devices: list[torch.device],
        *,
        timeout: float,
        routes: Routes | None = None,
    ) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.schedule = schedule
        self.routes = routes or Routes(schedule.num_stages)
        self.rank = rank
        self.group = group
        self.timeout = timeout
        self._devices = devices  # device of each stage (meaningful for local stages)
        self._local_device = devices[schedule.stages_of(rank)[0]]
        backend = dist.get_backend(group)
        # Collectives of the front end (loss, health check) use a device the backend supports.
        self.wire_device = self._local_device if backend == "nccl" else torch.device("cpu")
        self.receive_ahead = backend in RECEIVE_AHEAD_BACKENDS
        # Headers and descriptions: on the group itself where receiving ahead is safe,
        # otherwise on a gloo side group of the same processes.
        self._meta_group = group if self.receive_ahead else _gloo_twin(group)
        self._meta_device = self.wire_device if self.receive_ahead else torch.device("cpu")
        self._mailbox: dict[Message, Any] = {}
        self._plans = {training: self._plan(training) for training in (True, False)}
        self._points = (
            {}
            if self.receive_ahead
            else {
                training: receive_points(schedule, self.routes, rank, training)
                for training in (True, False)
            }
        )
        self._training = True
        self._incoming: dict[int, list[Message]] = {}
        self._cursor: dict[int, int] = {}
        self._outgoing: dict[int, list[Message]] = {}
        self._sent: dict[int, int] = {}
        # What each message looked like last time, on both ends of its wire.
        self._sent_meta: dict[tuple, _History] = {}
        self._recv_meta: dict[tuple, _History] = {}
        self._pending: dict[int, deque[_Posted]] = {}  # posted, from each peer, in order
        self._arriving: dict[Message, _Posted] = {}  # header in, tensors not yet waited for
        self._reaper = _SendReaper(timeout)
        # The reaper's thread ends with this transport (or at close()).
        self._finalizer = weakref.finalize(self, self._reaper.close)

    def close(self) -> None:
        """Stop the background send thread; the transport cannot send afterwards."""
        self._finalizer()

    # -- the order of messages on each wire ------------------------------------------------

    def _plan(self, training: bool) -> tuple[dict[int, list[Message]], dict[int, list[Message]]]:
        """Per peer: messages this rank receives from it, and sends to it, in order."""
        s2r = self.schedule.stage_to_rank
        incoming: dict[int, list[Message]] = {}
        outgoing: dict[int, list[Message]] = {}
        for rank, actions in enumerate(self.schedule.actions):
            for action in actions:
                if not training and action.kind.value != "F":
                    continue
                for message in self.routes.outgoing(action):
                    dst = s2r[message.stage]
                    if rank == dst:
                        continue
                    if dst == self.rank:
                        incoming.setdefault(rank, []).append(message)
                    if rank == self.rank:
                        outgoing.setdefault(dst, []).append(message)
        return incoming, outgoing

    def begin(self, training: bool) -> None:
        """Start a step: reset the per-peer positions and post the first receives."""
        self._training = training
        self._incoming, self._outgoing = self._plans[training]
        self._cursor = dict.fromkeys(self._incoming, 0)
        self._sent = dict.fromkeys(self._outgoing, 0)
        self._mailbox.clear()
        self._pending = {src: deque() for src in self._incoming}
        self._arriving.clear()
        for src in self._incoming:
            self._post_next(src)

    def prepare(self, action: Any) -> None:
        """This rank is about to run ``action``: post the tensor receives due here (NCCL)."""
        if self.receive_ahead:
            return
        for src, message in self._points[self._training].get(action, ()):
            self._take_headers(src, until=message)

    def finish(self) -> None:
        """End a step: wait until every send has completed."""
        self._reaper.drain()

    def _global(self, rank: int) -> int:
        return self._dist.get_global_rank(self.group, rank)

    def _key(self, peer: int, message: Message) -> tuple:
        # Inference sends no gradients along: its descriptions differ from training's.
        return (peer, self._training, message)

    # -- sending ----------------------------------------------------------------------------

    def send(self, message: Message, value: Any) -> None:
        dst = self.schedule.stage_to_rank[message.stage]
        if dst == self.rank:
            device = self._devices[message.stage]
            self._mailbox[message] = to_device(value, device, as_leaves=message.channel.forward)
            return
        leaves, spec = tree_flatten(value)
        described = [
            _TensorMeta(leaf.dtype, tuple(leaf.shape), leaf.requires_grad)
            if isinstance(leaf, torch.Tensor)
            else leaf
            for leaf in leaves
        ]
        meta = pickle.dumps((_spec_text(spec), described))
        payload = [leaf.detach().contiguous() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        history = self._sent_meta.setdefault(self._key(dst, message), _History())
        header = 0 if meta == history.last else len(meta)
        tag = self._sent[dst]
        if self.receive_ahead:
            self._post(dst, self._frames(history, header, meta, payload), self.group, tag)
        else:
            self._post(dst, self._frames(None, header, meta, []), self._meta_group, tag)
            self._post(dst, payload, self.group, tag)
        history.update(meta)
        self._sent[dst] += 1

    def _frames(
        self, history: _History | None, header: int, meta: bytes, payload: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """A message on the wire: header (0: described as last time), description, tensors.

        For a stable message the receiver has posted one packed buffer: header and
        tensors go in it, or the header alone when the message changed or failed.
        """
        if history is not None and history.stable:
            if header == 0:
                return [history.pack(0, payload, self._local_device)]
            frames = [history.pack(header, None, self._local_device)]
        else:
            frames = [torch.tensor([header], dtype=torch.int64, device=self._meta_device)]
        if header != 0:
            frames.append(_bytes_tensor(meta, self._meta_device))
        return frames + payload

    def _post(self, dst: int, frames: list[torch.Tensor], group: Any, tag: int) -> None:
        if not frames:
            return
        dist = self._dist
        peer = self._global(dst)
        ops = [dist.P2POp(dist.isend, t, peer, group, tag) for t in frames]
        works = dist.batch_isend_irecv(ops)
        self._reaper.add(works, frames, dst)

    # -- receiving --------------------------------------------------------------------------

    def ready(self, message: Message) -> bool:
        return True  # receiving blocks until the message is here

    def recv(self, message: Message) -> Any:
        if message in self._mailbox:
            return self._mailbox.pop(message)
        src = self.schedule.stage_to_rank[self.routes.sender(message)]
        self._post_while_waiting(src)
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
        history = self._recv_meta.setdefault(self._key(src, message), _History())
        posted = _Posted(message, history, tag=position)
        if self.receive_ahead and history.stable:
            device = self._devices[message.stage]
            posted.packed = torch.empty(history.layout[1], dtype=torch.uint8, device=device)
            posted.header = posted.packed[:8].view(torch.int64)
            (posted.header_work,) = self._irecv([(posted.packed, self.group)], src, position)
        else:
            posted.header = torch.empty(1, dtype=torch.int64, device=self._meta_device)
            (posted.header_work,) = self._irecv([(posted.header, self._meta_group)], src, position)
        self._pending[src].append(posted)

    def _post_while_waiting(self, src: int) -> None:
        """Gloo: if the next message from ``src`` is not in yet, post the one after it now.

        Posting costs a little time; spent while the rank would wait anyway, it is off the
        critical path. Tags keep the frames of the two messages apart.
        """
        pending = self._pending.get(src)
        waiting = bool(pending) and not pending[0].header_work.is_completed()
        if self.receive_ahead and waiting and len(pending) == 1:
            self._post_next(src)

    def _take_headers(self, src: int, *, until: Message) -> None:
        """Receive the headers from ``src`` up to ``until``'s; post what else each brings."""
        while until not in self._arriving:
            if not self._pending.get(src):
                raise RuntimeError(f"rank {self.rank} expects no more messages from rank {src}")
            posted = self._pending[src].popleft()
            self._arriving[posted.message] = self._complete_header(src, posted)

    def _allocate(self, history: _History, message: Message) -> list[Any]:
        device = self._devices[message.stage]
        return [
            torch.empty(d.shape, dtype=d.dtype, device=device) if isinstance(d, _TensorMeta) else d
            for d in history.decoded[1]
        ]

    def _complete_header(self, src: int, posted: _Posted) -> _Posted:
        """Wait for a message's header; post the receives of whatever else of it comes."""
        message, history = posted.message, posted.history
        self._wait([posted.header_work], src, message)
        size = int(posted.header.item())
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
                    failure = pickle.loads(data)
                    raise PipelineError(failure["message"], rank=failure["rank"])
                history.update(data)
            elif history.last is None:
                raise PipelineError(f"rank {src} sent {message} without describing it", rank=src)
            else:
                history.update(history.last)
            posted.leaves = self._allocate(history, message)
            frames = [(t, self.group) for t in _tensors(posted.leaves)]
            posted.works = self._irecv(frames, src, posted.tag)
        if not self._pending[src]:
            self._post_next(src)  # keep the next message's receive posted
        return posted

    def _finish(self, src: int, posted: _Posted) -> Any:
        """Wait for a message's tensors; its value, with inputs that require grad."""
        message = posted.message
        self._wait(posted.works, src, message)
        spec, described = posted.history.decoded
        leaves = posted.leaves
        assert leaves is not None
        for leaf, d in zip(leaves, described, strict=True):
            if isinstance(d, _TensorMeta) and d.requires_grad and message.channel.forward:
                leaf.requires_grad_(True)
        return tree_unflatten(leaves, spec)

    def _irecv(self, ops: list[tuple[torch.Tensor, Any]], src: int, tag: int) -> list[Any]:
        if not ops:
            return []
        dist = self._dist
        peer = self._global(src)
        return dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer, g, tag) for t, g in ops])

    def _wait(self, works: list, src: int, message: Message) -> None:
        try:
            for work in works:
                work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as error:  # a dead peer or a timeout: gloo and NCCL differ
            text = str(error).splitlines()[0] if str(error) else type(error).__name__
            if "imed out" in text or "imeout" in text:
                raise PipelineError(
                    f"rank {self.rank} waited {self.timeout:g} s for {message.channel} of "
                    f"micro-batch {message.microbatch} from rank {src} without an answer; "
                    "raise Pipe(timeout=...) if stages are this slow",
                    rank=src,
                ) from error
            raise PipelineError(
                f"rank {self.rank} lost rank {src} while waiting for its {message.channel} "
                f"of micro-batch {message.microbatch} (did that process die?): {text}",
                rank=src,
            ) from error

    # -- failures ---------------------------------------------------------------------------

    def announce_failure(self, description: dict) -> None:
        """Tell every peer still expecting a message from this rank in this step."""
        meta = pickle.dumps(description)
        for dst, sequence in self._outgoing.items():
            position = self._sent.get(dst, 0)
            if position >= len(sequence):
                continue
            # In place of the next message: what the peer posted for it gets the header.
            history = self._sent_meta.get(self._key(dst, sequence[position]))
            frames = self._frames(history if self.receive_ahead else None, -len(meta), meta, [])
            with contextlib.suppress(Exception):
                self._post(dst, frames, self._meta_group, position)
        self._reaper.abandon()

    def clear(self) -> None:
        self._mailbox.clear()
        self._arriving.clear()


def receive_points(
    schedule: Any, routes: Routes, rank: int, training: bool
) -> dict[Any, list[tuple[int, Message]]]:
    """Where ``rank`` posts each receive so that no transfer waits on a later one.

    The ranks' action lists are run in clock order (round robin, an action as soon as
    its inputs exist). A message from another rank is received at the point of
    ``rank``'s list where that rank stood when the message was sent: before the action
    returned here as key. Every process then issues its sends and receives in the order
    of one global sequence in which each send is followed by its receive, which is what
    backends that run operations in issue order (NCCL) need to never deadlock.
    """
    s2r = schedule.stage_to_rank
    lists = [
        [a for a in actions if training or a.kind.value == "F"] for actions in schedule.actions
    ]
    cursors = [0] * len(lists)
    produced: set[Message] = set()
    points: dict[Any, list[tuple[int, Message]]] = {}
    remaining = sum(map(len, lists))
    while remaining:
        progressed = False
        for r, actions in enumerate(lists):
            if cursors[r] == len(actions):
                continue
            action = actions[cursors[r]]
            if not all(message in produced for message in routes.incoming(action)):
                continue
            cursors[r] += 1
            remaining -= 1
            progressed = True
            for message in routes.outgoing(action):
                produced.add(message)
                if s2r[message.stage] == rank != r:
                    # rank has not consumed it yet, so its cursor is on a later action
                    points.setdefault(lists[rank][cursors[rank]], []).append((r, message))
        if not progressed:
            raise RuntimeError(f"schedule {schedule.name!r} cannot run: check Schedule.validate()")
    return points


@functools.lru_cache(maxsize=256)
def _spec_text(spec: Any) -> str:
    # Serializing a tree spec costs ~0.1 ms; a pipeline sends the same few over and over.
    return treespec_dumps(spec)


def _gloo_twin(group: Any) -> Any:
    """A gloo group of the same processes, for small host-side messages."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


def _tensors(leaves: list[Any]) -> list[torch.Tensor]:
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


class _SendReaper:
    """Waits for sends in a background thread and drops their buffers once complete."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._queue: queue.Queue = queue.Queue()
        self._errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="gpipe-send-reaper", daemon=True)
        self._thread.start()

    def add(self, works: list, tensors: list[torch.Tensor], dst: int) -> None:
        self._queue.put((works, tensors, dst))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:  # close()
                    return
                self._reap(*item)
            finally:
                # Nothing of a send may outlive it here: a Work object this frame still
                # held at interpreter exit would be freed by a thread Python is shutting
                # down, and its C++ destructor then aborts the process ("terminate called
                # without an active exception").
                del item
                self._queue.task_done()

    def _reap(self, works: list, tensors: list[torch.Tensor], dst: int) -> None:
        """Wait for one message's sends; its buffers go with this frame, once complete."""
        try:
            for work in works:
                work.wait(timeout=timedelta(seconds=self._timeout))
        except Exception as error:
            self._errors.append(f"send to rank {dst} failed: {error}")

    def drain(self) -> None:
        self._queue.join()
        if self._errors:
            errors, self._errors = self._errors, []
            raise PipelineError("; ".join(errors))

    def abandon(self) -> None:
        """After a failure: stop caring about sends the peers will never receive."""
        self._errors.clear()

    def close(self) -> None:
        """End the thread once the sends queued so far are done (or timed out).

        Joined, so that at interpreter exit (``weakref.finalize`` runs then) the thread
        has finished before Python tears threads down. A send that cannot complete (its
        peer died) is not waited for past a few seconds: the process is failing anyway.
        """
        if self._thread.is_alive():
            self._queue.put(None)
            # The garbage collector may run this finalizer in the thread itself.
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=min(self._timeout, 5.0))
