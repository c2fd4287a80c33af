"""A failure on the wire (``gpipe.transport.failures``): a peer's notice that blames this
rank says so in this rank's words, and gloo's and NCCL's error texts are read in one place."""

from __future__ import annotations

import pytest

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
