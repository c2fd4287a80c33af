"""The step's rows over ``torch.distributed`` point-to-point: rank 0's row of the step's seed,
sent ahead of its messages, and every rank's row of the end-of-step agreement, sent after
them; each received into a receive posted at the end of the last step, so that neither
waits for a round trip (a gloo collective costs a hand-off to its worker thread and a
rendezvous, twice a step).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch

from gpipe.transport.framing import AGREEMENT, NOTICE, SEED, read_row, row_frame
from gpipe.transport.peers import said_in

__all__ = ["RowsOverP2P"]

# Frames outside a step's sequence of messages (``framing.NOTICE``, ``AGREEMENT``, ``SEED``)
# each on a tag no message uses and no other transport of this process uses: the n-th
# transport built on a group takes the n-th set, the same on every rank since every rank
# builds its pipelines in the same order.
_NOTICE_TAG = 1 << 30


class RowsOverP2P:
    """The rows' carrier of :class:`~gpipe.transport.distributed.DistributedTransport`,
    whose ``_post``, ``_irecv``, ``_meta_group`` and ``_notice_tag`` it uses."""

    def _init_rows(self) -> None:
        self._rows: dict[int, dict[int, tuple[Any, torch.Tensor]]] = {SEED: {}, AGREEMENT: {}}
        self._row_sent = True  # this step's agreement row (a rank that gives up sends none)
        self._row_like: torch.Tensor | None = None  # the last agreement row, and seed row
        self._seed_like: torch.Tensor | None = None

    def _tag(self, kind: int) -> int:
        return self._notice_tag + NOTICE - kind  # notices, agreement rows, seed rows: +0, 1, 2

    def _send_row(
        self, kind: int, peers: Iterable[int], row: torch.Tensor, gave_up: bool = False
    ) -> None:
        frame = row_frame(row, gave_up).to(self._meta_device)
        at = -1 if kind == SEED else 1 << 61  # an agreement's is waited for at finish()
        for peer in peers:
            self._post(peer, [frame], self._meta_group, self._tag(kind), at=at)
        if kind == AGREEMENT and not gave_up:
            self._row_sent, self._row_like = True, row

    def _post_row(self, kind: int, peer: int, like: torch.Tensor) -> None:
        frame = torch.empty(8 + like.nbytes, dtype=torch.uint8, device=self._meta_device)
        works = self._irecv([(frame, self._meta_group)], peer, self._tag(kind))
        self._rows[kind][peer] = (works[0], frame)

    def _take_rows(self, kind: int, peers: list[int], like: torch.Tensor) -> list[torch.Tensor]:
        if kind == SEED:
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
                text, timed_out = said_in(error)
                failure = TimeoutError if timed_out else ConnectionError
                raise failure(f"rank {self._global(peer)}: {text}") from error
            row = read_row(frame.cpu(), like)
            if row is None:  # it gave up: its notice says why
                said = (self._notices or {}).get("message", "it gave up on this pipeline")
                raise ConnectionError(f"rank {self._global(peer)}: {said}")
            rows.append(row)
        if kind == AGREEMENT:  # the next step's rows, posted ahead as messages are
            for peer in peers:
                self._post_row(AGREEMENT, peer, like)
            if self.rank != 0 and self._seed_like is not None:
                self._post_row(SEED, 0, self._seed_like)
        return rows
