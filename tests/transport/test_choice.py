"""Which carrier a rank's messages take (``gpipe.transport.choice``): one of the three
names, refused with the remedy otherwise, and chosen by every rank together; how the ranks
of one machine connect their sockets and who may: strangers refused and reported, by
token, by pickle and by user, and the job still trains exactly."""

from __future__ import annotations

import os
import socket
import struct

import pytest
import torch
from torch.nn import functional as F

import gpipe
from distributed_cases import _leaving_batch, _leaving_model, told_transports
from gpipe.models import mlp
from gpipe.parallel.launch import launch
from gpipe.transport import choice
from reference import reference_step, relative_error

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


@pytest.mark.slow
def test_a_stranger_on_the_socket_is_refused_reported_and_the_job_trains_exactly(tmp_path):
    """Processes not of the job connect to rank 0's socket before rank 1 can: a wrong token,
    a pickle (whose unpickling would create a marker file) and, as root, another user's
    process. Each is closed and reported by its uid or pid; nothing ran; the ranks still
    form their sockets (no silent change of transport) and the step is the un-split
    model's."""
    from transport.intruders import trains_with_intruders

    marker = tmp_path / "ran"
    outcomes = launch(trains_with_intruders, 2, args=(str(marker),), timeout=120)
    assert not marker.exists()
    assert [o["transport"] for o in outcomes] == ["sockets", "sockets"]
    assert set(outcomes[0]["intruders"]) == {"closed"} and len(outcomes[0]["intruders"]) >= 2
    refused = [w for w in outcomes[0]["warnings"] if "refused a connection" in w]
    assert len(refused) == len(outcomes[0]["intruders"])
    assert sum("did not present the job's token" in w for w in refused) == 2
    if os.geteuid() == 0:
        assert any("uid 65534" in w and "not this job's user" in w for w in refused)
    model = _leaving_model()
    x, y = _leaving_batch()
    expected = reference_step(model, x, y, F.mse_loss, chunks=2, seed=3)
    assert relative_error(torch.tensor(outcomes[1]["loss"]).double(), expected) < 1e-6
    grads = {**outcomes[0]["grads"], **outcomes[1]["grads"]}
    for name, p in model.named_parameters():
        assert relative_error(grads[name], p.grad) < 1e-6, name


def test_a_listener_refuses_strangers_and_fails_naming_them_when_no_peer_comes():
    """Alone with a caller of the wrong token: refused and reported, and the wait ends
    within the timeout with an error naming it, not taken for a peer."""
    listener, address, token = choice.listen()
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect(address)
    stranger.sendall(struct.pack("<q32s", 1, bytes(32)))
    with (
        pytest.warns(RuntimeWarning, match=r"refused a connection .* pid \d+, which did not pre"),
        pytest.raises(ConnectionError, match=r"refused connections .*pid \d+"),
    ):
        choice.connect(listener, [(address, token), ("", b"")], 0, timeout=0.5)
    assert stranger.recv(1) == b""  # closed on it
    stranger.close()
