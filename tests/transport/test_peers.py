"""The one sequencing over both carriers (``gpipe.transport.peers``): each pair's sequence
of frames, a message that cannot cross names itself on the sending side, sends let go
oldest first, a step's receives posted when it begins."""

from __future__ import annotations

import pytest
import torch

from gpipe.schedule.builders import fill_drain
from gpipe.schedule.routes import Channel, Message, Routes
from gpipe.transport.codec import CodecError
from gpipe.transport.framing import AGREEMENT, SEED, History, flatten
from gpipe.transport.peers import AHEAD, PeerTransport


def test_a_stage_output_that_cannot_cross_names_the_message_and_the_remedy():
    transport = PeerTransport.__new__(PeerTransport)
    transport._history = {}
    transport.schedule, transport.rank = fill_drain(2, 3), 0
    message = Message(Channel.ACTIVATION, 1, 2)
    with pytest.raises(CodecError, match=r"activation of micro-batch 2 for stage 1: .*send tens"):
        transport.send(message, (torch.zeros(2), torch.device("cpu")))


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


class _Send:
    def __init__(self, done: bool) -> None:
        self.done, self.waited = done, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> bool:
        self.waited = True
        return True


def test_sends_already_done_are_let_go_oldest_first_not_kept_to_the_steps_end():
    """A stage's sent activations (packed copies on gloo, the tensors themselves on NCCL)
    must not all live until the step ends, beside the inputs the stage keeps."""
    sends = [_Send(True), _Send(True), _Send(False), _Send(True)]
    transport = PeerTransport.__new__(PeerTransport)  # only its list of sends
    transport._works = [(send, []) for send in sends]
    transport._release_sent()
    assert [work for work, _ in transport._works] == sends[2:]  # in order: the rest waits
    assert [send.waited for send in sends] == [True, True, False, False]


class _Carrier:
    """Records the receives a transport posts (group rank, position, bytes)."""

    kind, receive_ahead = "fake", True
    wire_device = torch.device("cpu")

    def __init__(self) -> None:
        self.posted: list[tuple[int, int, int]] = []

    def post(self, sends, peer, position, tensors, data=False):
        assert not sends
        self.posted += [(peer, position, t.numel()) for t in tensors]
        return [object() for _ in tensors]


def _stable(size: int) -> History:
    """A message's history as after two steps of one float32 tensor of ``size`` elements."""
    history = History()
    _, spec = flatten(torch.zeros(size))
    meta = history.describe(spec, [torch.zeros(size)])
    history.update(meta)
    history.update(meta)
    return history


@pytest.mark.parametrize("size", [16, 1 << 19])
def test_a_step_s_receives_are_all_posted_when_it_begins_up_to_a_bound_in_bytes(size):
    """Small messages: every receive of the step at once, so that none is posted while the
    peer's bytes come in (gloo's thread spins on its pair's lock then). Large ones: one
    ahead, so that 1F1B does not allocate all M inputs at once."""
    carrier = _Carrier()
    transport = PeerTransport(fill_drain(2, 8), 1, None, [torch.device("cpu")] * 2, carrier,
                              timeout=5.0)  # fmt: skip
    for message in transport._plans[True][0][0][1:-1]:
        transport._histories[True][message] = _stable(size)
    transport.begin(training=True)
    frames = [(0, p) for p, _ in enumerate(transport._plans[True][0][0])]  # seed, 8, agreement
    assert [(peer, p) for peer, p, _ in carrier.posted] == (frames if size == 16 else frames[:2])
    assert carrier.posted[1][2] > AHEAD or size == 16
