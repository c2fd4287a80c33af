"""Routes: which messages each action receives and sends, skip connections included."""

from types import SimpleNamespace

from gpipe.schedule import Action
from gpipe.schedule.routes import Channel, Message, Routes

A, G, S, SG = Channel.ACTIVATION, Channel.GRADIENT, Channel.SKIP, Channel.SKIP_GRADIENT


def test_a_chain_passes_activations_forward_and_gradients_back():
    routes = Routes(3)
    assert routes.incoming(Action.parse("F4@0")) == ()  # the first stage reads the batch
    assert routes.outgoing(Action.parse("F4@0")) == (Message(A, 1, 4),)
    assert routes.incoming(Action.parse("F4@1")) == (Message(A, 1, 4),)
    assert routes.outgoing(Action.parse("F4@2")) == ()  # the last stage computes the loss
    assert routes.incoming(Action.parse("B4@2")) == ()
    assert routes.outgoing(Action.parse("B4@2")) == (Message(G, 1, 4),)
    assert routes.incoming(Action.parse("B4@1")) == (Message(G, 1, 4),)
    assert routes.outgoing(Action.parse("B4@0")) == ()
    assert routes.incoming(Action.parse("W4@1")) == routes.outgoing(Action.parse("W4@1")) == ()
    assert routes.sender(Message(A, 1, 4)) == 0 and routes.sender(Message(G, 1, 4)) == 2


def test_a_skip_goes_from_the_stashing_stage_to_the_popping_one_and_its_gradient_back():
    # stage 0 stashes "x" for stage 2 (outputs: name -> stage it goes to); stage 2 pops it
    # (inputs: name -> the stage it comes from)
    skips = {
        0: SimpleNamespace(inputs={}, outputs={"x": 2}),
        2: SimpleNamespace(inputs={"x": 0}, outputs={}),
    }
    routes = Routes(3, skips)
    assert routes.outgoing(Action.parse("F1@0")) == (Message(A, 1, 1), Message(S, 2, 1, "x"))
    assert routes.incoming(Action.parse("F1@2")) == (Message(A, 2, 1), Message(S, 2, 1, "x"))
    assert routes.outgoing(Action.parse("B1@2")) == (Message(G, 1, 1), Message(SG, 0, 1, "x"))
    assert routes.incoming(Action.parse("B1@0")) == (Message(G, 0, 1), Message(SG, 0, 1, "x"))
    assert routes.sender(Message(S, 2, 1, "x")) == 0
    assert routes.sender(Message(SG, 0, 1, "x")) == 2
    assert S.forward and A.forward and not G.forward and not SG.forward
