"""A failure on the wire (``gpipe.transport.inquest``'s ``heard`` and ``left``,
``PeerTransport.announce_failure``): a peer's notice says its statement in the job's store,
one that blames this rank says so in this rank's words, and gloo's and NCCL's error texts are
read in one place."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpipe.base.errors import PipelineError
from gpipe.schedule.builders import fill_drain
from gpipe.transport import inquest
from gpipe.transport.framing import NOTICE, NOTICE_ROW, SEED, read_head, row_of
from gpipe.transport.inquest import heard, left, said_in
from gpipe.transport.peers import PeerTransport


@pytest.fixture
def store(monkeypatch):
    """The job's store, in memory; group ranks 0, 1 are global ranks 4, 5."""
    store = dist.HashStore()
    monkeypatch.setattr(inquest, "_store", lambda: store)
    monkeypatch.setattr(inquest, "_gone", [])
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank + 4)
    return store


def test_a_notice_says_the_sender_s_statement_and_one_that_blames_this_rank_who_gave_up(store):
    error = heard(None, 0, 1, [1, 5, 0])
    assert str(error) == "rank 5 failed; its statement is not in the job's store"
    inquest.state(5, [6], "rank 6 raised ValueError: x")  # rank 5 relays rank 6's failure
    error = heard(None, 0, 1, [2, 6, 0])
    assert str(error) == "rank 6 raised ValueError: x"
    assert (error.rank, error.global_rank) == (2, 6)
    inquest.state(5, [4], "rank 5 waited 2 s for rank 4")
    error = heard(None, 0, 1, [0, 4, 1])
    assert str(error) == "rank 4: rank 5 gave up on this pipeline: rank 5 waited 2 s for rank 4"
    assert (error.rank, error.global_rank) == (1, 5)


def test_a_peer_that_left_says_why_if_it_gave_up_else_that_it_died(store):
    closed = RuntimeError("[gloo/pair.cc:598] Connection closed by peer [127.0.0.1]:4711")
    error = left(None, 0, 1, closed, "send to", timeout=5.0)
    assert str(error).startswith("rank 4 could not send to rank 5, which left (died, or gave up ")
    assert "Connection closed by peer" in str(error) and (error.rank, error.global_rank) == (1, 5)
    inquest.state(5, [4], "rank 5 waited 2 s for rank 4")
    error = left(None, 0, 1, closed, "send to", timeout=5.0)
    assert str(error) == "rank 4: rank 5 gave up on this pipeline: rank 5 waited 2 s for rank 4"


@pytest.mark.parametrize(
    ("text", "first", "timed_out"),
    [
        (
            "[gloo/pair.cc:520] Timed out waiting 2000ms for recv operation to complete This is "
            "typically ...\nmore",
            "[gloo/pair.cc:520] Timed out waiting 2000ms for recv operation to complete",
            True,
        ),
        ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3)", None, True),
        ("[gloo/pair.cc:598] Connection closed by peer [127.0.0.1]:4711", None, False),
        ("", "RuntimeError", False),
    ],
)
def test_gloo_s_and_nccl_s_errors_read_as_their_first_line_and_whether_they_timed_out(
    text, first, timed_out
):
    assert said_in(RuntimeError(text)) == (first or text, timed_out)


def test_a_notice_raises_the_failed_rank_s_words_and_the_first_told_is_what_a_left_peer_says(
    store,
):
    transport = PeerTransport.__new__(PeerTransport)
    transport.rank, transport.group, transport.timeout, transport._told = 0, None, 5.0, {}
    assert not transport.peer_gave_up()  # none yet
    inquest.state(5, [], "rank 5 (stage 1) raised ValueError: bad")
    transport._told[1] = (heard(None, 0, 1, [1, 5, 0]), False)
    transport._told[2] = (PipelineError("later"), True)
    error = transport._left(RuntimeError("Connection closed by peer"), 1, "receive from")
    assert str(error) == "rank 5 (stage 1) raised ValueError: bad"
    assert (error.rank, error.global_rank) == (1, 5) and transport.peer_gave_up()


class _Carrier:
    """Records the frames a transport posts (sends: peer, position, head)."""

    kind, receive_ahead = "fake", True
    wire_device = torch.device("cpu")

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, torch.Tensor]] = []

    def post(self, sends, peer, position, tensors, data=False):
        if sends:
            self.sent += [(peer, position, t) for t in tensors]
        return [self for _ in tensors]

    def is_completed(self):
        return False

    def flush(self, seconds):
        pass


def test_a_failure_is_stated_in_the_store_and_a_notice_takes_the_next_frame(store):
    carrier = _Carrier()
    transport = PeerTransport(fill_drain(2, 2), 0, None, [torch.device("cpu")] * 2, carrier,
                              timeout=5.0)  # fmt: skip
    transport.begin(training=True)
    transport._emit(1, SEED, row=torch.zeros(2, dtype=torch.int64))  # frame 0 sent
    words = "rank 4 (stage 0) raised ValueError: x"
    transport.announce_failure(0, 4, words, gave_up=False)
    assert inquest.said_by(4) == words
    (peer, position, frame) = carrier.sent[-1]
    assert (peer, position, read_head(frame)) == (1, 1, (NOTICE, 1, 0))
    assert row_of(frame, NOTICE_ROW).tolist() == [0, 4, 0]
    assert str(heard(None, 0, 1, [0, 4, 0])).startswith("rank 4: rank 5 gave up")
