"""The group carrier (gloo's point-to-point, as between machines) keeps the fault guarantees
where its receives are posted ahead: after steady steps (messages packed, a GPipe burst's
receives all posted where it begins), a stage that raises reaches every rank with the same
first error, naming it, within the timeout. (The sockets and NCCL's order: tests/faults.)"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe.parallel.launch import launch
from injected_faults import Fault, _outcome

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def _faulty_over_group(rank: int, fault_stage: int, timeout: float) -> dict:
    import torch.distributed as dist

    import gpipe

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for s in range(3):
        layers += [nn.Linear(8, 8), Fault(2, "raise", 2) if s == fault_stage else nn.ReLU()]
    pipe = gpipe.Pipe(nn.Sequential(*layers), balance=[2, 2, 2], chunks=4, schedule="gpipe",
                      group=dist.group.WORLD, timeout=timeout, transport="group")  # fmt: skip
    x = torch.randn(8, 8)
    for _ in range(2):
        pipe.step(x, torch.randn(8, 8), F.mse_loss)
    outcome = _outcome(lambda: pipe.step(x, torch.randn(8, 8), F.mse_loss))
    return {**outcome, "transport": pipe.transport}


def test_a_stage_that_raises_after_steady_steps_reaches_every_rank_over_the_group():
    timeout, fault_stage = 20.0, 1
    outcomes = launch(_faulty_over_group, 3, args=(fault_stage, timeout), timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert outcome["transport"] == "group"
        assert "injected fault at micro-batch 2" in outcome["message"], outcome
        assert outcome["seconds"] < timeout
        if rank == fault_stage:
            assert outcome["type"] == "KeyError"
        else:
            assert outcome["pipeline_error"] and outcome["rank"] == fault_stage, outcome
    assert not multiprocessing.active_children()
