"""Which carrier a rank's messages take (``gpipe.transport.choice``): one of the three
names, refused with the remedy otherwise, and chosen by every rank together."""

from __future__ import annotations

import pytest

import gpipe
from distributed_cases import told_transports
from gpipe.models import mlp
from gpipe.parallel.launch import launch

pytestmark = pytest.mark.timeout(600)


def test_the_transport_is_one_of_three():
    model = mlp([4, 4, 4, 4, 4])
    with pytest.raises(ValueError, match="transport must be one of"):
        gpipe.Pipe(model, balance=[2, 2], devices=["cpu"] * 2, transport="tcp")


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
        said = "- transport: rank 1 has 'auto', rank 0 has 'group'"  # each repr once
        assert said in outcome["error"]
