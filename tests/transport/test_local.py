"""Stages of one process (``gpipe.transport.local``): a message is a copy in a mailbox, ready
once sent, taken once; a stage's inputs arrive as leaves of their own; a step or a failure
starts with an empty mailbox."""

from __future__ import annotations

import torch

from gpipe.schedule.routes import Channel, Message
from gpipe.transport.local import LocalTransport


def test_a_message_is_ready_once_sent_and_taken_once():
    transport = LocalTransport([torch.device("cpu")] * 2)
    transport.begin(training=True)
    message = Message(Channel.GRADIENT, 0, 3)
    assert not transport.ready(message)
    value = (torch.ones(2), 7)
    transport.send(message, value)
    assert transport.ready(message)
    got = transport.recv(message)
    assert torch.equal(got[0], value[0]) and got[1] == 7
    assert not transport.ready(message)


def test_forward_inputs_arrive_as_leaves_that_require_grad_where_the_sender_s_did():
    transport = LocalTransport([torch.device("cpu")] * 2)
    source = torch.ones(3, requires_grad=True)
    sent = (source * 2, torch.zeros(1))
    transport.send(Message(Channel.ACTIVATION, 1, 0), sent)
    got = transport.recv(Message(Channel.ACTIVATION, 1, 0))
    assert got[0].is_leaf and got[0].requires_grad and got[0].grad_fn is None
    assert not got[1].requires_grad
    got[0].sum().backward()
    assert source.grad is None  # the copy's graph does not reach back into the sender's


def test_a_new_step_or_a_failure_empties_the_mailbox():
    transport = LocalTransport([torch.device("cpu")] * 2)
    for end in (lambda: transport.begin(training=False), transport.clear):
        message = Message(Channel.ACTIVATION, 1, 0)
        transport.send(message, torch.ones(1))
        end()
        assert not transport.ready(message)
