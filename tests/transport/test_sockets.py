"""The same-host transport (``gpipe.transport.sockets``): messages larger than a socket's
buffer both ways at once, against the un-split model; and how the transport is chosen."""

from __future__ import annotations

import pytest

import gpipe
from distributed_cases import told_transports, train_steps
from gpipe.models import mlp
from gpipe.parallel.launch import launch
from parallel.test_distributed import check

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


def test_the_transport_is_one_of_three_and_sockets_cannot_post_in_nccls_order():
    model = mlp([4, 4, 4, 4, 4])
    with pytest.raises(ValueError, match="transport must be one of"):
        gpipe.Pipe(model, balance=[2, 2], devices=["cpu"] * 2, transport="tcp")
    with pytest.raises(ValueError, match="receive_ahead=False"):
        gpipe.Pipe(model, balance=[2, 2], devices=["cpu"] * 2, transport="sockets",
                   receive_ahead=False)  # fmt: skip


@pytest.mark.slow
def test_the_ranks_choose_the_transport_together():
    """Chosen by every rank at once: a rank told otherwise stops the build on every rank
    (never one rank on sockets and its peer on gloo, waiting for each other)."""
    chosen = launch(told_transports, 2, args=(["sockets", "sockets"],), timeout=60)
    assert chosen == [{"transport": "sockets"}] * 2
    chosen = launch(told_transports, 2, args=(["group", "group"],), timeout=60)
    assert chosen == [{"transport": "group"}] * 2
    refused = launch(told_transports, 2, args=(["group", "auto"],), timeout=60)
    for outcome in refused:
        assert "given different transports (rank 0: 'group', rank 1: 'auto')" in outcome["error"]
