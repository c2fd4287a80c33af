"""What both carriers between processes share: each pair's sequence of frames
(``gpipe.transport.framing``), the step's rows, the ranks' names, the errors that name who
failed, failure notices once received, messages to this rank's own stages, tied copies."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from gpipe.base._utils import to_device
from gpipe.base.errors import PipelineError
from gpipe.schedule.comm_plan import wire_order
from gpipe.schedule.routes import Message, Routes
from gpipe.transport.codec import CodecError
from gpipe.transport.framing import AGREEMENT, SEED, History, TensorMeta, flatten, read_notice
from gpipe.transport.inquest import REMEDY, blame, said_by

__all__ = ["PeerTransport", "said_in"]


class PeerTransport:
    """One rank of a pipeline spread over the processes of a ``torch.distributed`` group.

    Subclasses (the carriers) move the frames between processes; this holds the rest: each
    pair's sequence of frames (``gpipe.transport.framing``), the step's rows, a mailbox for
    messages between two stages of this rank, and the errors of a peer that failed, left
    or went silent.
    """

    wire_device: torch.device  # where the group's collectives take tensors

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
        self._mailbox: dict[Message, Any] = {}
        self._plans = {training: self._sequences(training) for training in (True, False)}
        self._training = True
        # Per peer, this step's frames in wire order (messages, and the rows' kinds): from
        # it, and to it.
        self._incoming: dict[int, list[Any]] = {}
        self._outgoing: dict[int, list[Any]] = {}
        self._notices: dict[str, Any] | None = None  # a peer's failure, once noticed
        self._sent: dict[int, int] = {}  # to each peer: frames of the step sent
        # What each message looked like last time, on both ends of its wire.
        self._sent_meta: dict[tuple, History] = {}
        self._recv_meta: dict[tuple, History] = {}

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

    def _begin_plan(self, training: bool) -> None:
        self._training = training
        self._incoming, self._outgoing = self._plans[training]
        self._mailbox.clear()

    def _key(self, peer: int, message: Message) -> tuple:
        # Inference sends no gradients along: its descriptions differ from training's.
        return (peer, self._training, message)

    def _send_here(self, message: Message, value: Any) -> bool:
        """Deliver ``message`` to a stage of this rank, if it is one's."""
        if self.schedule.stage_to_rank[message.stage] != self.rank:
            return False
        device = self._devices[message.stage]
        self._mailbox[message] = to_device(value, device, as_leaves=message.channel.forward)
        return True

    def _described(
        self, dst: int, message: Message, value: Any
    ) -> tuple[History, bytes, int, list[torch.Tensor]]:
        """``message`` to rank ``dst`` as it goes on the wire: its history on that wire, its
        description (encoded only when it changed), the size the header says (0: described
        as last time), and its tensors (contiguous). Update the history once it is sent."""
        leaves, spec = flatten(value)
        described = [
            TensorMeta(leaf.dtype, tuple(leaf.shape), leaf.requires_grad)
            if isinstance(leaf, torch.Tensor)
            else leaf
            for leaf in leaves
        ]
        payload = [leaf.detach().contiguous() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        history = self._sent_meta.setdefault(self._key(dst, message), History())
        try:
            meta = history.describe(spec, described)
        except CodecError as error:  # on the sending side, where the value was made
            raise CodecError(f"the {message.channel} of micro-batch {message.microbatch} for "
                             f"stage {message.stage}: {error}") from None  # fmt: skip
        return history, meta, 0 if meta == history.last else len(meta), payload

    def prepare(self, action: Any) -> None:
        """This rank is about to run ``action``; nothing to do unless receives are posted
        at points (NCCL's order)."""

    def ready(self, message: Message) -> bool:
        return True  # receiving blocks until the message is here

    # -- the step's rows: frames of the same sequences ------------------------------------

    def broadcast_row(self, row: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``row`` (of one dtype and length on every rank): the step's seed, which
        rank 0 sends ahead of its messages without waiting for anyone. Raises
        ``TimeoutError`` when it is not in within the timeout, ``ConnectionError`` when
        rank 0 left or failed."""
        if self.rank == 0:
            for peer in self._outgoing:
                self._send_row(peer, SEED, row)
            return row
        return self._take_row(0, SEED, row, time.monotonic() + self.timeout)

    def all_gather_row(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's ``row`` (of one dtype and length on every rank), stacked by rank:
        the step's agreement, sent after this rank's messages of the step and received
        after the peers' (a rank that failed still sends its row, after its notice). Raises
        ``TimeoutError`` when a row is not in within the timeout, ``ConnectionError`` when
        its rank left, or gave up and will send none."""
        for peer in self._outgoing:
            self._send_row(peer, AGREEMENT, row)
        deadline = time.monotonic() + self.timeout
        rows = {p: self._take_row(p, AGREEMENT, row, deadline) for p in self._incoming}
        return torch.stack([rows.get(r, row) for r in range(self.schedule.num_ranks)])

    def _send_row(self, dst: int, kind: int, row: torch.Tensor) -> None:
        """``row``'s frame of ``kind`` (``SEED`` or ``AGREEMENT``) to ``dst``."""
        raise NotImplementedError

    def _take_row(self, src: int, kind: int, like: torch.Tensor, deadline: float) -> torch.Tensor:
        """``src``'s row of ``kind``, shaped as ``like``, by ``deadline``."""
        raise NotImplementedError

    # -- failures ---------------------------------------------------------------------------

    def check_notices(self) -> None:
        """Raise the failure a peer announced, if one has."""
        if self._notices:
            raise _announced(self._notices)

    def _notice_from(self, peer: int, data: bytes | bytearray) -> dict[str, Any]:
        """The failure notice ``peer`` sent (``framing.notice``), as this rank tells it: one
        that blames this rank (the peer gave up waiting on it) says so, in its words."""
        me, other = self._global(self.rank), self._global(peer)
        said = read_notice(data, peer, f"rank {other}")
        if said.get("global_rank") != me:
            return said
        words = f"rank {me}: rank {other} gave up on this pipeline: {said['message']}"
        return {**said, "rank": peer, "global_rank": other, "message": words}

    def peer_gave_up(self) -> bool:
        """Whether a peer announced that it left the pipeline without agreeing on the
        failure (a collective of its timed out): nobody is left to agree with."""
        return bool(self._notices and self._notices.get("gave_up"))

    def _global(self, rank: int) -> int:
        return self._dist.get_global_rank(self.group, rank)

    def _local(self, rank: int) -> int | None:
        """The rank in this pipeline's group of global rank ``rank``, or None (another
        replica's)."""
        try:
            return self._dist.get_group_rank(self.group, rank)
        except (RuntimeError, ValueError):
            return None

    def _left(self, error: Exception, peer: int, doing: str) -> PipelineError:
        """Posting a transfer failed: ``peer`` left. The failure it announced, if any."""
        try:
            self.check_notices()  # it gave up on this step, and said why
        except PipelineError as announced:
            return announced
        me, other = self._global(self.rank), self._global(peer)
        said = said_by(other, timeout=self.timeout)
        if said is not None:  # it gave up on this pipeline: its words, which may name this rank
            return PipelineError(f"rank {me}: rank {other} gave up on this pipeline: {said}",
                                 rank=peer, global_rank=other)  # fmt: skip
        return PipelineError(
            f"rank {me} could not {doing} rank {other}, which left (died, or gave up on this "
            f"pipeline): {said_in(error)[0]}; look for that rank's own error",
            rank=peer,
            global_rank=other,
        )

    def _wait_failed(self, error: Exception, src: int, message: Message) -> PipelineError:
        """The error of a receive from ``src`` that failed: naming the rank that caused it,
        which may not be ``src`` (``gpipe.transport.inquest``)."""
        text, timed_out = said_in(error)
        me, peer = self._global(self.rank), self._global(src)
        what = f"{message.channel} of micro-batch {message.microbatch}"
        waited = (
            f"rank {me} waited {self.timeout:g} s for the {what} from rank {peer}"
            if timed_out
            else f"rank {me} lost rank {peer} while waiting for its {what} ({text})"
        )
        verdict = blame(me, [peer], waited, timeout=self.timeout)
        if verdict.failed:
            culprit = next(iter(verdict.failed))
            return PipelineError(f"{verdict.describe(me)}; {waited}", rank=self._local(culprit),
                                 global_rank=culprit)  # fmt: skip
        if verdict.silent and verdict.silent != [peer]:
            culprit = verdict.silent[0]
            return PipelineError(
                f"{verdict.describe(me)}: {waited}; look for why rank {culprit} stopped {REMEDY}",
                rank=self._local(culprit),
                global_rank=culprit,
            )
        if timed_out:  # rank src itself, or nobody could tell
            # Silent for a grace more, with no one else to wait on (two ranks): it hung.
            alone = verdict.silent and self.schedule.num_ranks == 2
            maybe = "" if alone else "; it may itself be waiting on another rank"
            return PipelineError(
                f"{waited} without an answer{maybe}: rank {peer} stalled or is slower than "
                f"that; look for why {REMEDY}",
                rank=src,
                global_rank=peer,
            )
        return PipelineError(
            f"{waited}: rank {peer} died or left; look for its own error, or why it was "
            "killed (out of memory?)",
            rank=src,
            global_rank=peer,
        )

    # -- outside the schedule -----------------------------------------------------------------

    def swap(
        self, tensor: torch.Tensor, peers: list[int], *, wait: Callable[[Callable[[], Any]], Any]
    ) -> dict[int, torch.Tensor]:
        """Send ``tensor`` to each rank of ``peers`` and receive from each one of the same
        shape and dtype (tied copies: ``gpipe.parallel.tied``); all of them by rank, this
        rank's own included, on :attr:`wire_device`.

        Between steps, not part of the schedule's wire order: through the group's own
        point-to-point operations. The caller decides what to swap and waits, with
        ``wait(start)``: ``start()`` posts the transfers and returns their works (the caller
        bounds the wait, ``gpipe.parallel.collectives``).
        """
        dist = self._dist
        wire = tensor.to(self.wire_device).contiguous()
        received = {self.rank: wire}
        ops = []
        for peer in peers:
            received[peer] = torch.empty_like(wire)
            ops.append(dist.P2POp(dist.isend, wire, self._global(peer), self.group))
            ops.append(dist.P2POp(dist.irecv, received[peer], self._global(peer), self.group))
        if ops:
            wait(lambda: dist.batch_isend_irecv(ops))
        return received


def _announced(notice: dict[str, Any]) -> PipelineError:
    return PipelineError(notice["message"], rank=notice["rank"],
                         global_rank=notice.get("global_rank"))  # fmt: skip


def said_in(error: Exception) -> tuple[str, bool]:
    """What a failed transfer's error says (its first line, gloo's advice after the cause
    dropped), and whether it timed out, in gloo's words or NCCL's."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    text = text.split(" This is typically")[0]
    return text, "imed out" in text or "imeout" in text
