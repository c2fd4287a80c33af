"""What both carriers between processes share (``gpipe.transport.peers``): each pair's
sequence of frames, a message that cannot cross names itself on the sending side, a peer's
notice that blames this rank says so in this rank's words, and gloo's and NCCL's error texts
read in one place."""

from __future__ import annotations

import pytest
import torch

from gpipe.schedule.builders import fill_drain
from gpipe.schedule.routes import Channel, Message, Routes
from gpipe.transport.codec import CodecError
from gpipe.transport.framing import AGREEMENT, SEED, notice
from gpipe.transport.peers import PeerTransport, said_in


def test_a_stage_output_that_cannot_cross_names_the_message_and_the_remedy():
    transport = PeerTransport.__new__(PeerTransport)
    transport._sent_meta, transport._training = {}, True
    message = Message(Channel.ACTIVATION, 1, 2)
    with pytest.raises(CodecError, match=r"activation of micro-batch 2 for stage 1: .*send tens"):
        transport._described(1, message, (torch.zeros(2), torch.device("cpu")))


def test_a_notice_that_blames_this_rank_says_who_gave_up_on_it():
    transport = PeerTransport.__new__(PeerTransport)
    transport.rank = 0
    transport._global = lambda rank: rank + 4  # group ranks 0, 1 are global ranks 4, 5
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


def test_each_pair_s_sequence_is_the_seed_row_the_messages_in_order_then_the_agreement_row():
    """The one protocol's frames of a step, per pair of ranks (K=3, M=2): rank 0's seed row
    first (to every peer, even one it sends no message), every rank's agreement row last."""
    transport = PeerTransport.__new__(PeerTransport)
    transport.schedule, transport.routes = fill_drain(3, 2), Routes(3)
    act, grad = Channel.ACTIVATION, Channel.GRADIENT
    for rank in range(3):
        transport.rank = rank
        incoming, outgoing = transport._sequences(training=True)
        assert set(incoming) == set(outgoing) == {0, 1, 2} - {rank}
        for peer in incoming:
            assert incoming[peer][0] == SEED if peer == 0 else incoming[peer][0] != SEED
            assert outgoing[peer][0] == SEED if rank == 0 else outgoing[peer][0] != SEED
            assert incoming[peer][-1] == outgoing[peer][-1] == AGREEMENT
    transport.rank = 1
    incoming, outgoing = transport._sequences(training=True)
    assert incoming[0] == [SEED, Message(act, 1, 0), Message(act, 1, 1), AGREEMENT]
    assert incoming[2] == [Message(grad, 1, 1), Message(grad, 1, 0), AGREEMENT]
    assert outgoing[0] == [Message(grad, 0, 1), Message(grad, 0, 0), AGREEMENT]
    assert transport._sequences(training=False)[0][2] == [AGREEMENT]  # inference: no gradients
