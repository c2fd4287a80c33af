"""What the ranks of tests/transport/test_distributed.py run (a module of its own: spawned
ranks find a function by its module's name, and ``test_distributed`` is also
tests/parallel's)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from injected_faults import Fault, _outcome


def faulty_over_group(rank: int, fault_stage: int, timeout: float) -> dict:
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
