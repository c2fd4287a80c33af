"""The step's rows over ``torch.distributed`` point-to-point: rank 0's row of the step's seed,
sent ahead of its messages, and every rank's row of the end-of-step agreement, sent after
them; each received into a receive posted at the end of the last step, so that neither
waits for a round trip (a gloo collective costs a hand-off to its worker thread and a
rendezvous, twice a step).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

__all__ = ["RowsOverP2P"]

# Frames outside a step's sequence of messages, each on a tag no message uses and no other
# transport of this process uses (the n-th transport built on a group takes the n-th set,
# the same on every rank since every rank builds its pipelines in the same order): a
# failure notice (one fixed-size frame per peer), rank 0's row of the step's seed, each
# rank's row of the step's agreement.
_NOTICE_TAG, _SEED, _AGREEMENT = 1 << 30, 1, 2


class RowsOverP2P:
    """The rows of :class:`~gpipe.transport.distributed.DistributedTransport`, whose
    ``_post``, ``_irecv``, ``_meta_group`` and ``_notice_tag`` they use."""

    def _init_rows(self) -> None:
        self._rows: dict[int, dict[int, tuple[Any, torch.Tensor]]] = {_SEED: {}, _AGREEMENT: {}}
        self._row_sent = True  # this step's agreement row (a rank that gives up sends none)
        self._row_like: torch.Tensor | None = None  # the last agreement row, and seed row
        self._seed_like: torch.Tensor | None = None

    def broadcast_row(self, row: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``row`` (of one dtype and length on every rank): the step's seed, which
        rank 0 sends ahead of its messages without waiting; the others take it from the
        receive they posted at the end of the last step. Raises ``TimeoutError`` when it is
        not in within the timeout, ``ConnectionError`` when rank 0 left."""
        if self.rank == 0:
            self._send_row(_SEED, range(1, self.schedule.num_ranks), row, at=-1)
            return row
        return self._take_rows(_SEED, [0], row)[0]

    def all_gather_row(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's ``row`` (of one dtype and length on every rank), stacked by rank:
        the step's agreement, sent after this rank's messages of the step (a rank that
        failed still sends its row, which says so; one that gave up sends a notice in its
        place). Raises ``TimeoutError`` when a row is not in within the timeout,
        ``ConnectionError`` when its rank left or gave up."""
        peers = [p for p in range(self.schedule.num_ranks) if p != self.rank]
        self._send_row(_AGREEMENT, peers, row, at=1 << 61)  # waited for at finish()
        self._row_sent, self._row_like = True, row
        rows = dict(zip(peers, self._take_rows(_AGREEMENT, peers, row), strict=True))
        for peer in peers:  # the next step's rows, posted ahead as messages are
            self._post_row(_AGREEMENT, peer, row)
        if self.rank != 0 and self._seed_like is not None:
            self._post_row(_SEED, 0, self._seed_like)
        return torch.stack([rows.get(r, row) for r in range(len(peers) + 1)])

    def _send_row(self, kind: int, peers: Any, row: torch.Tensor, *, at: int, flag: int = 0):
        """A row's frame (an int64 flag, 1: a notice in its place; the row's bytes) to each
        of ``peers``."""
        frame = torch.empty(8 + row.nbytes, dtype=torch.uint8)
        frame[:8].view(torch.int64).fill_(flag)
        frame[8:].copy_(row.contiguous().view(-1).view(torch.uint8))
        frame = frame.to(self._meta_device)
        for peer in peers:
            self._post(peer, [frame], self._meta_group, self._notice_tag + kind, at=at)

    def _post_row(self, kind: int, peer: int, like: torch.Tensor) -> None:
        frame = torch.empty(8 + like.nbytes, dtype=torch.uint8, device=self._meta_device)
        works = self._irecv([(frame, self._meta_group)], peer, self._notice_tag + kind)
        self._rows[kind][peer] = (works[0], frame)

    def _take_rows(self, kind: int, peers: list[int], like: torch.Tensor) -> list[torch.Tensor]:
        if kind == _SEED:
            self._seed_like = like
        deadline = time.monotonic() + self.timeout
        rows = []
        for peer in peers:
            if peer not in self._rows[kind]:
                self._post_row(kind, peer, like)
            work, frame = self._rows[kind].pop(peer)
            if self.peer_gave_up():
                raise ConnectionError(self._notices["message"])
            try:
                work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except Exception as error:  # a timeout, or the peer left: named by the caller
                text = str(error).splitlines()[0] if str(error) else type(error).__name__
                timed_out = "imed out" in text or "imeout" in text
                failure = TimeoutError if timed_out else ConnectionError
                raise failure(f"rank {self._global(peer)}: {text}") from error
            frame = frame.cpu()
            if frame[:8].view(torch.int64).item():  # it gave up: its notice says why
                said = (self._notices or {}).get("message", "it gave up on this pipeline")
                raise ConnectionError(f"rank {self._global(peer)}: {said}")
            rows.append(frame[8:].view(like.dtype).reshape(like.shape))
        return rows
