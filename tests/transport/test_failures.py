"""A failure on the wire (``gpipe.transport.failures``): a peer's notice that blames this
rank says so in this rank's words, and gloo's and NCCL's error texts are read in one place."""

from __future__ import annotations

import pytest

from gpipe.base.errors import PipelineError
from gpipe.transport import failures
from gpipe.transport.failures import said_in
from gpipe.transport.framing import notice
from gpipe.transport.peers import PeerTransport


def test_a_notice_that_blames_this_rank_says_who_gave_up_on_it(monkeypatch):
    # group ranks 0, 1 are global ranks 4, 5
    monkeypatch.setattr(failures, "global_rank", lambda group, rank: rank + 4)
    transport = PeerTransport.__new__(PeerTransport)
    transport.rank, transport.group = 0, None
    other = notice({"rank": 1, "global_rank": 6, "message": "rank 6 raised ValueError: x"})
    assert transport._notice_from(1, other)["message"] == "rank 6 raised ValueError: x"
    blamed = notice({"rank": 0, "global_rank": 4, "message": "rank 5 waited 2 s for rank 4"})
    said = transport._notice_from(1, blamed)
    assert said["message"] == ("rank 4: rank 5 gave up on this pipeline: rank 5 waited 2 s "
                               "for rank 4")  # fmt: skip
    assert (said["rank"], said["global_rank"]) == (1, 5)
    garbled = transport._notice_from(1, b"not a notice")
    assert garbled["rank"] == 1 and "not gpipe's wire format" in garbled["message"]


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


def test_the_notice_raised_is_a_neighbour_s_and_a_failed_rank_s_words_are_its_own(monkeypatch):
    monkeypatch.setattr(failures, "global_rank", lambda group, rank: rank)
    transport = PeerTransport.__new__(PeerTransport)
    transport.rank, transport.group, transport._neighbours = 0, None, {1}
    transport.carrier = type("Carrier", (), {"notices": type("Board", (), {})})()
    far = {"rank": 2, "message": "rank 2 raised", "from": 2}
    near = {"rank": 2, "message": "rank 1: the step failed at rank 2", "from": 1}
    transport.carrier.notices.heard = lambda: [notice(far), notice(near)]  # far came first
    transport._told = {}
    with pytest.raises(PipelineError, match="rank 1: the step failed at rank 2"):
        transport.check_notices()
    assert transport.said(2) == "rank 2 raised" and transport.said(1) == near["message"]
    assert not transport.peer_gave_up()
