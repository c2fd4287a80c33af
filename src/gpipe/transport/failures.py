"""A failure on the wire between the ranks of a pipeline, told one way: a failed rank states
its words in the job's store (``gpipe.transport.inquest``, which outlives broken connections),
then sends every peer whose sequence it has not finished a ``NOTICE`` in place of its next
frame (``gpipe.transport.framing``). A peer that takes one reads the words from the store;
so does a peer that finds the sender gone (a transfer it could not post). A failed wait's
error is ``gpipe.transport.inquest.failure``'s."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from gpipe.base.errors import PipelineError
from gpipe.transport.framing import NOTICE
from gpipe.transport.inquest import DIED, said_by, said_in, state

__all__ = ["Failures", "said_in"]


class Failures:
    """The failure half of ``gpipe.transport.peers.PeerTransport``: uses its ``group``,
    ``rank``, ``schedule``, ``timeout``, ``carrier``, its step's frames and ``_emit``; fills
    ``_told`` (each peer's notice: the error it raises, whether the peer gave up)."""

    def peer_gave_up(self) -> bool:
        """Whether a peer announced that it left the pipeline without agreeing on the
        failure (a collective of its timed out): nobody is left to agree with."""
        return any(gave_up for _, gave_up in self._told.values())

    def said(self, rank: int) -> str | None:
        """What failed rank ``rank`` stated (None: nothing in the job's store)."""
        return said_by(self._global(rank))

    def announce_failure(self, description: dict) -> None:
        """State ``description``'s message (what failed: ``rank``, ``global_rank``, and
        ``gave_up`` when this rank leaves the pipeline), then tell every peer that still
        expects a frame of this step (its agreement row follows unless this rank gave up);
        written within a second."""
        me, culprit = self._global(self.rank), description["global_rank"]
        others = [self._global(r) for r in range(self.schedule.num_ranks) if r != self.rank]
        waits_on = [] if culprit == me else others if culprit is None else [culprit]
        state(me, waits_on, description["message"])  # before the notices: they point here
        self._failed = True
        row = [description["rank"], -1 if culprit is None else culprit, description["gave_up"]]
        row = torch.tensor(row, dtype=torch.int64)
        for dst, sequence in self._outgoing.items():
            if self._sent.get(dst, 0) < len(sequence):
                with contextlib.suppress(Exception):
                    self._emit(dst, NOTICE, row=row)
        self.carrier.flush(min(1.0, self.timeout))
        self.clear()

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def _heard(self, peer: int, row: list[int]) -> tuple[PipelineError, bool]:
        """The error ``peer``'s notice (its ``row``) makes this rank raise, and whether the
        peer gave up: its statement, in this rank's words where it gave up waiting on it."""
        origin, culprit, gave_up = row
        me, other = self._global(self.rank), self._global(peer)
        words = said_by(other) or f"rank {other} failed; its statement is not in the job's store"
        if culprit == me:
            return _gave_up(me, peer, other, words), bool(gave_up)
        culprit = None if culprit < 0 else culprit
        return PipelineError(words, rank=origin, global_rank=culprit), bool(gave_up)

    def _left(self, error: Exception, peer: int, doing: str) -> PipelineError:
        """Posting a transfer failed: ``peer`` left. The failure it announced, if any."""
        for told, _ in self._told.values():  # it gave up on this step, and said why
            return told
        me, other = self._global(self.rank), self._global(peer)
        said = said_by(other, timeout=self.timeout)
        if said is not None:  # it gave up on this pipeline: its words, which may name this rank
            return _gave_up(me, peer, other, said)
        return PipelineError(
            f"rank {me} could not {doing} rank {other}, which left (died, or gave up on this "
            f"pipeline): {said_in(error)[0]}; {DIED}",
            rank=peer,
            global_rank=other,
        )


def _gave_up(me: int, peer: int, other: int, words: str) -> PipelineError:
    return PipelineError(f"rank {me}: rank {other} gave up on this pipeline: {words}",
                         rank=peer, global_rank=other)  # fmt: skip
