"""Fault cases only the fault matrix runs (``benchmarks/faults.py``): a rank that carries on
after its own error, and a fault in each kind of action under each schedule. The cases the
tests share with it are in ``tests/distributed_cases.py``."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.base.errors import PipelineError
from injected_faults import BackwardFault, Fault, _outcome


def carries_on(rank, timeout):
    """Rank 1's stage raises in step 2; every rank catches its error and carries on as a
    careless script would: ``clip_grad_norm_``, then another step. What each later call
    raised, and the longest it took."""
    torch.set_num_threads(1)

    def factory():
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), Fault(0, "raise", 1, 2))

    pipe = gpipe.Pipe(factory, balance=[2, 2], chunks=2, group=dist.group.WORLD, timeout=timeout)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe.step(x, y, F.mse_loss)
    with contextlib.suppress(KeyError, PipelineError):
        pipe.step(x, y, F.mse_loss)
    raised, longest, message = [], 0.0, ""
    for call in (lambda: pipe.clip_grad_norm_(1.0), lambda: pipe.step(x, y, F.mse_loss)):
        start = time.monotonic()
        try:
            call()
            raised.append("None")
        except BaseException as error:
            raised.append(type(error).__name__)
            message = str(error)
        longest = max(longest, time.monotonic() - start)
    return {"type": "+".join(raised), "seconds": longest, "message": message}


def faulty_in(rank, stages, where, fault_rank, schedule, timeout):
    """Under ``schedule``, rank ``fault_rank`` fails in a forward (its third micro-batch),
    a backward (the first) or, on the last rank, the loss (the second call); what each rank
    raised, and when. interleaved-1f1b: two stages a rank, the fault in the first rank's
    first stage or the last rank's last one."""
    torch.set_num_threads(1)
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    count = stages * virtual
    fault_stage = count - 1 if fault_rank == stages - 1 else fault_rank

    def factory():
        layers = []
        for s in range(count):
            fault = nn.ReLU()
            if s == fault_stage and where == "forward":
                fault = Fault(2, "raise")
            elif s == fault_stage and where == "backward":
                fault = BackwardFault(1)
            layers += [nn.Linear(8, 8), fault]
        return nn.Sequential(*layers)

    calls = [0]

    def loss(output, target):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyError("injected fault in the loss")
        return F.mse_loss(output, target)

    pipe = gpipe.Pipe(factory, balance=[2] * count, chunks=4, group=dist.group.WORLD,
                      timeout=timeout, schedule=schedule, virtual_stages=virtual)  # fmt: skip
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    return _outcome(lambda: pipe.step(x, y, loss if where == "loss" else F.mse_loss))
