"""The job's store seen by one attempt of a torchrun job (``store.this_attempt``): what a
dead attempt left there is out of sight, and every rank of the new one agrees on where."""

from __future__ import annotations

import threading

import pytest

from gpipe.parallel.store import client, free_port, serve, this_attempt


def _attempt(port: int, size: int, ranks: range | None = None, timeout: float = 10.0) -> list:
    """Ranks ``ranks`` (all by default) of a job of ``size`` (threads, each with a client of
    its own) through this_attempt: the store each got, or its error."""
    ranks = range(size) if ranks is None else ranks
    seen: list = [None] * len(ranks)

    def rank(r: int) -> None:
        try:
            seen[r] = this_attempt(client("127.0.0.1", port, size, timeout), r, size, timeout)
        except Exception as error:  # the test reads it
            seen[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    return seen


@pytest.mark.timeout(60)
def test_a_restarted_attempt_sees_none_of_the_dead_attempts_keys():
    port = free_port()
    server = serve("127.0.0.1", port, 3, timeout=10)
    first = _attempt(port, 3)
    first[2].set("rank_2", "the dead attempt's gloo address")  # as gloo's mesh would
    second = _attempt(port, 3)  # the same store, the dead attempt's hello keys still there
    assert all(store.check(["rank_2"]) for store in first)  # one namespace for the attempt
    assert not any(store.check(["rank_2"]) for store in second)
    second[0].set("rank_0", "this attempt's")
    assert all(store.get("rank_0") == b"this attempt's" for store in second)
    assert server.num_keys() > 2


@pytest.mark.timeout(60)
def test_a_rank_that_never_comes_is_named_within_the_timeout():
    port = free_port()
    server = serve("127.0.0.1", port, 3, timeout=10)
    server.set("gpipe/hello/2", "a dead attempt's nonce")  # rank 2's, from before
    zero, one = _attempt(port, 3, ranks=range(2), timeout=0.5)  # rank 2 never comes
    assert isinstance(zero, TimeoutError) and "rank 2 did not come within 0.5 s" in str(zero)
    assert not isinstance(one, Exception)  # answered: rank 0 named the one that did not come
