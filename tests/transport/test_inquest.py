"""Who caused a failed wait: the statements each rank leaves in the job's store, followed
from the ranks waited on (``gpipe.transport.inquest``), on an in-memory store."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from gpipe.transport import inquest

TIMEOUT = 0.4  # grace(TIMEOUT) = 0.5 s: what a rank that never speaks costs


@pytest.fixture
def store(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(inquest, "_store", lambda: store)
    monkeypatch.setattr(inquest, "_last_blame", {})
    monkeypatch.setattr(inquest, "_gone", [])
    return store


def test_a_rank_two_hops_away_that_never_answers_is_named_not_the_neighbour(store):
    # rank 0 waits on rank 1, which waits on rank 2, which hangs (no statement)
    inquest.state(1, [2], "rank 1 waited for the gradient from rank 2")
    began = time.monotonic()
    verdict = inquest.blame(0, [1], "rank 0 waited for the gradient from rank 1", timeout=TIMEOUT)
    assert verdict.silent == [2] and not verdict.failed
    assert time.monotonic() - began >= inquest.grace(TIMEOUT)  # it gave rank 2 its chance
    assert verdict.via(2) == " (rank 1 waits on it)"


def test_a_rank_that_raised_is_named_with_its_own_words_at_once(store):
    # data parallel: rank 0 waits on its replica peer rank 2, which learnt that rank 3 raised
    inquest.state(3, [], "rank 3 (stage 1) raised KeyError: 'x'")
    inquest.state(2, [3], "rank 3 (stage 1) raised KeyError: 'x'")
    began = time.monotonic()
    verdict = inquest.blame(0, [2], "rank 0: the all-reduce failed", timeout=TIMEOUT)
    assert time.monotonic() - began < inquest.grace(TIMEOUT)  # nothing to wait for
    assert verdict.failed == {3: "rank 3 (stage 1) raised KeyError: 'x'"}
    assert verdict.via(3) == " (rank 2 waits on it)"


def test_a_chain_reads_from_the_waiting_rank_to_the_culprit(store):
    inquest.state(0, [2], "rank 0 waits on 2")
    inquest.state(2, [3], "rank 2 waits on 3")
    verdict = inquest.blame(1, [0], "rank 1 waits on 0", timeout=TIMEOUT)
    assert verdict.silent == [3]
    assert verdict.via(3) == " (rank 0 waits on rank 2, which waits on it)"


def test_ranks_waiting_on_each_other_in_a_collective_name_the_absent_one(store):
    # ranks 0, 1 and 2 in one all-reduce; rank 2 never came
    inquest.state(1, [0, 2], "rank 1: the agreement timed out")
    verdict = inquest.blame(0, [1, 2], "rank 0: the agreement timed out", timeout=TIMEOUT)
    assert verdict.silent == [2] and verdict.via(2) == ""


def test_the_grace_is_paid_once_per_failure_and_the_first_statement_stands(store):
    inquest.blame(0, [1], "rank 0 waited for rank 1's gradient", timeout=TIMEOUT)
    began = time.monotonic()
    verdict = inquest.blame(0, [1, 2], "rank 0: agreeing on the failure", timeout=TIMEOUT)
    assert time.monotonic() - began < inquest.grace(TIMEOUT) / 2
    assert verdict.silent == [1, 2]
    assert inquest.said_by(0, timeout=TIMEOUT) == "rank 0 waited for rank 1's gradient"


def test_a_rank_that_failed_by_itself_keeps_its_statement_and_waits_for_nobody(store):
    # rank 0 raised and stated it; in its failure's agreement rank 1 (told, done) is gone
    inquest.state(0, [], "rank 0 (stage 0) raised KeyError: 'x'")
    began = time.monotonic()
    verdict = inquest.blame(0, [1], "rank 0: the receive from rank 1 failed", timeout=TIMEOUT)
    assert time.monotonic() - began < inquest.grace(TIMEOUT) / 2
    assert verdict.silent == [1]  # what is known now; rank 0 raises its own error anyway
    assert inquest.said_by(0, timeout=TIMEOUT) == "rank 0 (stage 0) raised KeyError: 'x'"


def test_an_old_statement_is_an_earlier_failure_not_this_one(store, monkeypatch):
    inquest.state(1, [], "rank 1 raised long ago")
    later = time.time() + TIMEOUT + inquest.grace(TIMEOUT) + 1
    monkeypatch.setattr(inquest.time, "time", lambda: later)
    verdict = inquest.blame(0, [1], "rank 0 waited", timeout=TIMEOUT)
    assert verdict.silent == [1] and not verdict.failed


def test_without_a_store_nobody_is_blamed(monkeypatch):
    monkeypatch.setattr(inquest, "_store", lambda: None)
    verdict = inquest.blame(0, [1], "rank 0 waited", timeout=TIMEOUT)
    assert not verdict.failed and not verdict.silent  # names no one


def test_a_store_whose_host_died_ends_the_inquest_at_once(store, monkeypatch):
    class Gone:
        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")

        check = get = set

    monkeypatch.setattr(inquest, "_store", lambda: Gone())
    began = time.monotonic()
    verdict = inquest.blame(0, [1], "rank 0 waited", timeout=TIMEOUT)
    assert not verdict.failed and not verdict.silent  # names no one
    assert time.monotonic() - began < inquest.grace(TIMEOUT) / 2


@pytest.fixture
def one_group(monkeypatch):
    """Every process in one group: its ranks are the job's."""
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "get_group_rank", lambda group, rank: rank)


def test_a_failed_wait_names_its_cause_first_in_its_own_words_then_what_waited(store, one_group):
    late = RuntimeError("[gloo/pair.cc:520] Timed out waiting 400ms for recv operation")
    inquest.state(1, [2], "rank 1 waited for the gradient from rank 2")
    waited = "the receive from rank 1 of the gradient of micro-batch 1"
    error = inquest.failure(None, 0, [1], waited, late, timeout=TIMEOUT, cause_first=True)
    assert str(error).startswith(
        "rank 2 did not answer (stalled, or died) (rank 1 waits on it): rank 0: the receive "
        "from rank 1 of the gradient of micro-batch 1 did not complete within the pipeline's "
        "timeout of 0.4 s; look for why rank 2 stopped (its own error, py-spy dump)"
    )
    assert (error.rank, error.global_rank) == (2, 2)
    inquest.state(2, [], "rank 2 (stage 2) raised KeyError: 'x'")  # it spoke after all
    error = inquest.failure(None, 0, [1], waited, late, timeout=TIMEOUT)
    assert str(error) == (
        "rank 2 failed (rank 1 waits on it): rank 2 (stage 2) raised KeyError: 'x'; rank 0: the "
        "receive from rank 1 of the gradient of micro-batch 1 did not complete within the "
        "pipeline's timeout of 0.4 s"
    )
    assert (error.rank, error.global_rank) == (2, 2)
