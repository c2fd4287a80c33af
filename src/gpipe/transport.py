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
import pickle
import queue
import threading
from dataclasses import dataclass
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


class DistributedTransport:
    """Point-to-point transport between processes through ``torch.distributed``.

    Every message to another rank is framed as: a one-element ``int64`` header, the
    pickled description of the value (its structure, and each tensor's dtype, shape and
    ``requires_grad``) when it differs from the previous message of that kind to that
    peer, then the tensors themselves — all queued together with ``batch_isend_irecv``.
    Shapes may therefore change from step to step; an unchanged step costs one extra
    8-byte message.

    Messages between two ranks are received in the order the sender sends them, which
    the schedule fixes: a receiver waiting for message X first takes (and buffers) any
    that its peer sent before X. That keeps the wire order identical on both sides, as
    NCCL requires, without tags.

    Sends never block the runtime. A background thread waits for each send to complete
    and then drops its tensors, so sent buffers are freed as soon as the peer has them.
    A negative header announces a failure: the message that follows describes it, and
    the receiver raises :class:`PipelineError` and passes the news on to its own peers.
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
        backend = dist.get_backend(group)
        local = devices[schedule.stages_of(rank)[0]]
        # Headers and descriptions travel on a device the backend supports.
        self.wire_device = local if backend == "nccl" else torch.device("cpu")
        self._mailbox: dict[Message, Any] = {}
        self._sent_meta: dict[tuple[int, Channel, str], bytes] = {}
        self._recv_meta: dict[tuple[int, Channel, str], Any] = {}
        self._plans = {training: self._plan(training) for training in (True, False)}
        self._incoming: dict[int, list[Message]] = {}
        self._cursor: dict[int, int] = {}
        self._outgoing: dict[int, list[Message]] = {}
        self._sent: dict[int, int] = {}
        self._headers: dict[int, tuple[Any, torch.Tensor]] = {}  # posted ahead, by peer
        self._reaper = _SendReaper(timeout)

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
        """Start a step: reset the per-peer positions in the message sequences."""
        self._incoming, self._outgoing = self._plans[training]
        self._cursor = dict.fromkeys(self._incoming, 0)
        self._sent = dict.fromkeys(self._outgoing, 0)
        self._mailbox.clear()
        self._headers.clear()
        for src in self._incoming:
            self._post_header(src)

    def _post_header(self, src: int) -> None:
        """Post the receive of the next header from ``src`` now, if this step has one.

        Receiving ahead lets the header land while this rank computes; only the tensors'
        receive, whose sizes the header decides, waits for the action that needs them.
        """
        if self._cursor[src] < len(self._incoming[src]):
            header = torch.empty(1, dtype=torch.int64, device=self.wire_device)
            self._headers[src] = (self._irecv(header, src), header)

    def finish(self) -> None:
        """End a step: wait until every send has completed."""
        self._reaper.drain()

    def _global(self, rank: int) -> int:
        return self._dist.get_global_rank(self.group, rank)

    # -- sending ----------------------------------------------------------------------------

    def send(self, message: Message, value: Any) -> None:
        dst = self.schedule.stage_to_rank[message.stage]
        if dst == self.rank:
            device = self._devices[message.stage]
            self._mailbox[message] = to_device(value, device, as_leaves=message.channel.forward)
            return
        leaves, spec = tree_flatten(value)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        described = [
            _TensorMeta(leaf.dtype, tuple(leaf.shape), leaf.requires_grad)
            if isinstance(leaf, torch.Tensor)
            else leaf
            for leaf in leaves
        ]
        meta = pickle.dumps((treespec_dumps(spec), described))
        key = (dst, message.channel, message.name)
        changed = self._sent_meta.get(key) != meta
        self._sent_meta[key] = meta
        payload = [t.detach().contiguous() for t in tensors]
        self._post(dst, len(meta) if changed else 0, meta if changed else None, payload)
        self._sent[dst] += 1

    def _post(self, dst: int, header: int, meta: bytes | None, tensors: list[torch.Tensor]) -> None:
        dist = self._dist
        peer = self._global(dst)
        frames = [torch.tensor([header], dtype=torch.int64, device=self.wire_device)]
        if meta is not None:
            frames.append(_bytes_tensor(meta, self.wire_device))
        ops = [dist.P2POp(dist.isend, t, peer, self.group) for t in frames + tensors]
        works = dist.batch_isend_irecv(ops)
        self._reaper.add(works, frames + tensors, dst)

    # -- receiving --------------------------------------------------------------------------

    def ready(self, message: Message) -> bool:
        return True  # receiving blocks until the message is here

    def recv(self, message: Message) -> Any:
        if message in self._mailbox:
            return self._mailbox.pop(message)
        src = self.schedule.stage_to_rank[self.routes.sender(message)]
        while message not in self._mailbox:
            sequence = self._incoming.get(src, [])
            position = self._cursor.get(src, 0)
            if position >= len(sequence):
                raise RuntimeError(f"rank {self.rank} expects no more messages from rank {src}")
            expected = sequence[position]
            work, header = self._headers.pop(src)
            self._wait([work], src, expected)
            self._cursor[src] = position + 1
            self._mailbox[expected] = self._receive(src, expected, int(header.item()))
        return self._mailbox.pop(message)

    def _receive(self, src: int, message: Message, size: int) -> Any:
        """The rest of a message whose header (``size``) has arrived."""
        key = (src, message.channel, message.name)
        if size != 0:
            meta = torch.empty(abs(size), dtype=torch.uint8, device=self.wire_device)
            self._wait([self._irecv(meta, src)], src, message)
            decoded = pickle.loads(meta.cpu().numpy().tobytes())
            if size < 0:
                raise PipelineError(decoded["message"], rank=decoded["rank"])
            self._recv_meta[key] = (treespec_loads(decoded[0]), decoded[1])
        spec, described = self._recv_meta[key]
        device = self._devices[message.stage]
        leaves = [
            torch.empty(d.shape, dtype=d.dtype, device=device) if isinstance(d, _TensorMeta) else d
            for d in described
        ]
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        works = [self._irecv(t, src) for t in tensors]
        self._post_header(src)  # the next message's header may come in behind these
        if works:
            self._wait(works, src, message)
        for leaf, d in zip(leaves, described, strict=True):
            if isinstance(d, _TensorMeta) and d.requires_grad and message.channel.forward:
                leaf.requires_grad_(True)
        return tree_unflatten(leaves, spec)

    def _irecv(self, tensor: torch.Tensor, src: int):
        dist = self._dist
        op = dist.P2POp(dist.irecv, tensor, self._global(src), self.group)
        return dist.batch_isend_irecv([op])[0]

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
            if self._sent.get(dst, 0) < len(sequence):
                with contextlib.suppress(Exception):
                    self._post(dst, -len(meta), meta, [])
        self._reaper.abandon()

    def clear(self) -> None:
        self._mailbox.clear()


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
                if item is None:
                    continue
                works, tensors, dst = item
                try:
                    for work in works:
                        work.wait(timeout=timedelta(seconds=self._timeout))
                except Exception as error:
                    self._errors.append(f"send to rank {dst} failed: {error}")
                del works, tensors, item  # the buffers go as soon as the send is done
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        self._queue.join()
        if self._errors:
            errors, self._errors = self._errors, []
            raise PipelineError("; ".join(errors))

    def abandon(self) -> None:
        """After a failure: stop caring about sends the peers will never receive."""
        self._errors.clear()
