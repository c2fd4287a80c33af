"""A failure on the wire between the ranks of a pipeline: the notices a failed rank sends
(in place of its next frame, and to every peer outside the sequences) and those it
receives, in this rank's words, and the error of a transfer that could not be posted (its
peer left). A failed wait's error is ``gpipe.transport.inquest.failure``'s."""

from __future__ import annotations

import contextlib
from typing import Any

from gpipe.base.errors import PipelineError
from gpipe.transport.framing import NOTICE, head, notice, read_notice
from gpipe.transport.inquest import DIED, global_rank, said_by, said_in

__all__ = ["Failures", "announced", "said_in"]


class Failures:
    """The failure half of ``gpipe.transport.peers.PeerTransport``: uses its ``carrier``,
    ``group``, ``rank``, ``schedule``, ``timeout``, its step's frames, its notices and
    ``_emit``."""

    def check_notices(self) -> None:
        """Raise the failure a peer announced, if one has (outside this step's frames too)."""
        if (said := self._notice()) is not None:
            raise announced(said)

    def peer_gave_up(self) -> bool:
        """Whether a peer announced that it left the pipeline without agreeing on the
        failure (a collective of its timed out): nobody is left to agree with."""
        self._notice()
        return any(said.get("gave_up") for said in self._told.values())

    def _notice(self) -> dict[str, Any] | None:
        """The notice this rank raises: the first, but a neighbour's (a rank it exchanges
        messages with: its words are nearer the cause) over a farther rank's."""
        for data in self.carrier.notices.heard():
            said = self._notice_from(None, data)
            self._told.setdefault(said["from"] if type(said.get("from")) is int else None, said)
        near = [said for peer, said in self._told.items() if peer in self._neighbours]
        return next(iter(near or self._told.values()), None)

    def said(self, rank: int) -> str | None:
        """What failed rank ``rank`` said in its notice, else what a peer's notice says of it
        (or of the step's failure)."""
        heard = list(self._told.values())
        said = self._told.get(rank) or next((s for s in heard if s["rank"] == rank), None)
        said = said or (heard[0] if heard else None)
        return None if said is None else said["message"]

    def announce_failure(self, description: dict) -> None:
        """Tell every peer: outside the sequences (it may be waiting for another rank, or
        between steps; on a socket, ahead of what follows), and in place of the next frame
        of its sequence if it still expects one (then, unless this rank gave up, its
        agreement row follows); written within a second."""
        self._failed, text = True, notice({**description, "from": self.rank})
        others = [p for p in range(self.schedule.num_ranks) if p != self.rank]
        self.carrier.notices.announce(head(NOTICE, -1, len(text)) + text, others)
        for dst, sequence in self._outgoing.items():
            if self._sent.get(dst, 0) < len(sequence):
                with contextlib.suppress(Exception):
                    self._emit(dst, NOTICE, size=len(text), data=text)
        self.carrier.flush(min(1.0, self.timeout))
        self.clear()

    def _global(self, rank: int) -> int:
        return global_rank(self.group, rank)

    def _notice_from(self, peer: int | None, data: bytes | bytearray) -> dict[str, Any]:
        """The failure notice ``peer`` sent (``framing.notice``; None: the one it names, a
        notice outside the step's frames), as this rank tells it: one that blames this rank
        (the peer gave up waiting on it) says so, in its words."""
        said = read_notice(data, peer, "a peer" if peer is None else f"rank {self._global(peer)}")
        peer = said.get("from") if peer is None else peer
        if type(peer) is not int or said.get("global_rank") != self._global(self.rank):
            return said
        me, other = self._global(self.rank), self._global(peer)
        words = f"rank {me}: rank {other} gave up on this pipeline: {said['message']}"
        return {**said, "rank": peer, "global_rank": other, "message": words, "from": peer}

    def _left(self, error: Exception, peer: int, doing: str) -> PipelineError:
        """Posting a transfer failed: ``peer`` left. The failure it announced, if any."""
        if (notice := self._notice()) is not None:  # it gave up on this step, and said why
            return announced(notice)
        me, other = self._global(self.rank), self._global(peer)
        said = said_by(other, timeout=self.timeout)
        if said is not None:  # it gave up on this pipeline: its words, which may name this rank
            return PipelineError(f"rank {me}: rank {other} gave up on this pipeline: {said}",
                                 rank=peer, global_rank=other)  # fmt: skip
        return PipelineError(
            f"rank {me} could not {doing} rank {other}, which left (died, or gave up on this "
            f"pipeline): {said_in(error)[0]}; {DIED}",
            rank=peer,
            global_rank=other,
        )


def announced(notice: dict[str, Any]) -> PipelineError:
    """The error a peer's failure notice says."""
    return PipelineError(notice["message"], rank=notice["rank"],
                         global_rank=notice.get("global_rank"))  # fmt: skip
