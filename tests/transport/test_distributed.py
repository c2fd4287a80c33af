"""The group carrier (gloo's point-to-point, as between machines): frames down on a gloo
group of their own; the fault guarantees hold where its receives are posted ahead: after
steady steps (messages packed, a step's receives all posted when it begins), a stage that
raises reaches every rank with the same first error, naming it, within the timeout. (The
sockets and NCCL's order: tests/faults.)"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from gpipe.parallel.launch import launch
from gpipe.transport.distributed import GroupCarrier
from transport.group_cases import faulty_over_group


class _Group:
    def __init__(self, name: str) -> None:
        self.name, self.used = name, []

    def send(self, tensors, peer, tag):
        self.used.append(("send", peer))
        return self.name

    def recv(self, tensors, peer, tag):
        self.used.append(("recv", peer))
        return self.name


def test_on_gloo_the_frames_to_a_lower_rank_travel_on_a_group_of_their_own():
    """Incoming bytes then never wait for the pair's lock that the rank's own sends hold
    (gloo's pair thread only tries to take it, and spins)."""
    carrier = GroupCarrier.__new__(GroupCarrier)
    carrier.group, carrier._twin, carrier._rank = _Group("up"), _Group("back"), 1
    carrier.receive_ahead, carrier._tags = True, 0
    frame = [torch.zeros(4, dtype=torch.uint8)]
    assert carrier.post(True, 0, 3, frame) == ["back"]  # to rank 0, below
    assert carrier.post(False, 0, 3, frame, True) == ["up"]  # from rank 0: rank 0's sends
    assert carrier.post(True, 2, 3, frame, True) == ["up"]  # to rank 2, above
    assert carrier.post(False, 2, 3, frame) == ["back"]  # from rank 2: its sends down
    carrier.receive_ahead = False  # NCCL's order: heads and descriptions on the gloo twin
    assert carrier.post(True, 0, 3, frame) == carrier.post(False, 2, 3, frame) == ["back"]
    assert carrier.post(True, 0, 3, frame, True) == carrier.post(False, 2, 3, frame, True) == ["up"]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_stage_that_raises_after_steady_steps_reaches_every_rank_over_the_group():
    timeout, fault_stage = 20.0, 1
    outcomes = launch(faulty_over_group, 3, args=(fault_stage, timeout), timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert outcome["transport"] == "group"
        assert "injected fault at micro-batch 2" in outcome["message"], outcome
        assert outcome["seconds"] < timeout
        if rank == fault_stage:
            assert outcome["type"] == "KeyError"
        else:
            assert outcome["pipeline_error"] and outcome["rank"] == fault_stage, outcome
    assert not multiprocessing.active_children()
