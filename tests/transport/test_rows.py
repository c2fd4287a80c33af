"""The step's rows over ``torch.distributed`` point to point (``gpipe.transport.rows``), two
ranks as two gloo groups of one process on threads: rank 0's seed needs no wait on its side,
the agreement is every rank's row by rank, the next step's rows are received into receives
posted a step ahead, and a row that says its rank gave up, or that does not come, raises
what the caller names (``ConnectionError``, ``TimeoutError``). (A rank that left: the
fault tests, tests/faults.)"""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gpipe.transport.framing import AGREEMENT
from gpipe.transport.peers import PeerTransport
from gpipe.transport.rows import _NOTICE_TAG, RowsOverP2P

pytestmark = pytest.mark.timeout(60)


class _Rows(RowsOverP2P, PeerTransport):
    """The rows' half of a group carrier: its posting is the process group's own."""

    def __init__(self, group, rank: int, timeout: float) -> None:
        self.group = self._meta_group = group
        self._meta_device = torch.device("cpu")
        self._notice_tag, self.timeout, self.rank = _NOTICE_TAG, timeout, rank
        self.schedule = SimpleNamespace(num_ranks=2)
        self._notices, self._works = None, []
        self._init_rows()

    def _post(self, dst, frames, group, tag, at=None):
        self._works += [group.send([t], dst, tag) for t in frames]

    def _irecv(self, ops, src, tag):
        return [group.recv([t], src, tag) for t, group in ops]

    def _global(self, rank):
        return rank


def _on_two_ranks(work, timeout=5.0):
    """``work(rows, rank)`` on both ranks at once; what each returned or raised."""
    store, results = dist.HashStore(), [None, None]

    def rank_(rank):
        group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=20))
        try:
            results[rank] = work(_Rows(group, rank, timeout), rank)
        except Exception as error:  # what the test looks at
            results[rank] = error

    threads = [threading.Thread(target=rank_, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_the_seed_goes_ahead_and_the_agreement_is_every_row_by_rank_step_after_step():
    def steps(rows, rank):
        seen = []
        for step in range(3):
            seed = rows.broadcast_row(torch.tensor([100 + step, 8]) if rank == 0 else
                                      torch.zeros(2, dtype=torch.int64))  # fmt: skip
            row = torch.tensor([float(rank), step, 0.5], dtype=torch.float64)
            seen.append((seed.tolist(), rows.all_gather_row(row).tolist()))
        return seen

    for outcome in _on_two_ranks(steps):
        assert outcome == [([100 + s, 8], [[0.0, s, 0.5], [1.0, s, 0.5]]) for s in range(3)], (
            outcome
        )


def test_a_rank_that_gave_up_sends_a_row_that_says_so():
    answered = threading.Event()

    def gives_up(rows, rank):
        like = torch.zeros(3, dtype=torch.float64)
        if rank == 1:  # and stays until rank 0 has read it (a process that gave up lives on)
            rows._send_row(AGREEMENT, [0], like, gave_up=True)
            return answered.wait(10)
        try:
            return rows.all_gather_row(like)
        finally:
            answered.set()

    error = _on_two_ranks(gives_up)[0]
    assert isinstance(error, ConnectionError) and "rank 1: it gave up" in str(error), error


def test_a_row_that_does_not_come_times_out_naming_its_rank():
    answered = threading.Event()

    def silent(rows, rank):
        if rank == 1:  # alive, and silent until rank 0 has its outcome
            return answered.wait(10)
        try:
            return rows.all_gather_row(torch.zeros(3, dtype=torch.float64))
        finally:
            answered.set()

    error = _on_two_ranks(silent, timeout=0.5)[0]
    assert isinstance(error, TimeoutError) and str(error).startswith("rank 1: "), error
