"""The same-host carrier (``gpipe.transport.sockets``): transfers matched by tag as gloo's,
messages larger than a socket's buffer both ways at once, and a peer's last row read before
its leaving counts, against the un-split model. (How the carrier is chosen and who may
connect: test_choice.py.)"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from distributed_cases import (
    _leaving_batch,
    _leaving_model,
    leaves_after_its_last_row,
    train_steps,
)
from gpipe.parallel.launch import launch
from parallel.test_distributed import check
from reference import reference_step, relative_error

pytestmark = pytest.mark.timeout(600)

# In 1F1B's steady state both ranks send a 9 MiB message to each other in the same actions,
# more than a socket's kernel buffer holds (8 MiB here, often a few hundred KiB): a send that
# fills its socket must keep reading the peer's, or both would wait.
WIDE_CASES = [
    {"model": "wide", "balance": [4, 4], "chunks": 2, "schedule": "1f1b", "checkpoint": "never"},
]


@pytest.mark.slow
def test_messages_larger_than_the_socket_buffer_both_ways_at_once():
    results = launch(train_steps, 2, args=(WIDE_CASES,), timeout=60)
    for index, case in enumerate(WIDE_CASES):
        check(case, [r[index] for r in results])


@pytest.mark.slow
def test_what_a_peer_sent_before_it_left_is_read_before_its_leaving_counts():
    """Rank 1 ends its step and leaves while rank 0 has yet to read its last row: the row
    was sent, so rank 0's step ends as the un-split model's (it failed under load when the
    closed connection behind the row was taken for a peer lost before sending it)."""
    outcomes = launch(leaves_after_its_last_row, 2, args=(0.5,), timeout=60)
    model = _leaving_model()
    x, y = _leaving_batch()
    expected = reference_step(model, x, y, F.mse_loss, chunks=2, seed=3)
    assert relative_error(torch.tensor(outcomes[1]["loss"]).double(), expected) < 1e-6
    grads = {**outcomes[0]["grads"], **outcomes[1]["grads"]}
    assert set(grads) == {name for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert relative_error(grads[name], p.grad) < 1e-6, name


def _pair():
    import socket

    from gpipe.transport.sockets import SocketCarrier

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    return SocketCarrier({1: a}, 5.0), SocketCarrier({0: b}, 5.0)


def test_a_transfer_lands_in_the_receive_posted_with_its_tag_as_gloo_matches_them():
    """Receives posted ahead for later frames take none of an earlier frame's bytes; one not
    posted yet is held in the socket (and what follows it); what a peer sent before it
    closed is read, then receives fail."""
    sender, receiver = _pair()
    later = torch.empty(2, dtype=torch.int64)
    (later_work,) = receiver.post(False, 0, 1, [later])  # frame 1's, posted first
    head = torch.empty(3, dtype=torch.int64)
    (head_work,) = receiver.post(False, 0, 0, [head])
    sender.post(True, 1, 0, [torch.tensor([1, 2, 3])])
    sender.post(True, 1, 0, [torch.tensor([4.0])])  # the rest of frame 0: not posted yet
    sender.post(True, 1, 1, [[b"\x07" * 8, torch.tensor([9])]])  # one transfer of parts
    head_work.wait()
    assert head.tolist() == [1, 2, 3] and not later_work.is_completed()  # held behind 4.0
    rest = torch.empty(1)
    receiver.post(False, 0, 0, [rest])
    later_work.wait()
    assert rest.tolist() == [4.0] and later.tolist() == [0x0707070707070707, 9]
    sender._links[1].close()
    (gone,) = receiver.post(False, 0, 2, [torch.empty(1)])
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        gone.wait()


def test_a_send_the_socket_takes_in_part_goes_on_in_order_before_what_follows_it():
    """Written at once as far as the socket takes it; the rest is queued, and a transfer
    posted after it goes behind it (not at once), whole and in order."""
    sender, receiver = _pair()
    big = torch.arange(1 << 20, dtype=torch.int64)  # 8 MB: more than a socket buffer
    small = torch.tensor([7, 8, 9])
    (big_send,) = sender.post(True, 1, 0, [[b"\x01" * 5, big]])
    (small_send,) = sender.post(True, 1, 1, [small])
    assert not big_send.is_completed() and not small_send.is_completed()
    into = [torch.empty(5 + big.nbytes, dtype=torch.uint8), torch.empty(3, dtype=torch.int64)]
    works = receiver.post(False, 0, 0, into[:1]) + receiver.post(False, 0, 1, into[1:])
    while not all(w.is_completed() for w in [*works, big_send, small_send]):
        sender.pump(0.01)
        receiver.pump(0.01)
    assert into[0][:5].tolist() == [1] * 5
    assert torch.equal(into[0][5:], big.view(torch.uint8)) and into[1].tolist() == [7, 8, 9]
