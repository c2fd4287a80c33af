"""Code that runs inside the processes of the fault tests (tests/faults/, the sharded ones):
faults to inject (a raise, a kill, a stall, an overflow, a disagreement) and what each rank
raised, and when.

It lives in a module (not in a test file) so that spawned processes can import it; the
runs that go right are tests/distributed_cases.py's.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gpipe
from distributed_cases import nccl_order
from gpipe.base.errors import PipelineError


class Fault(nn.Module):
    """Identity that fails on one micro-batch's forward: raises, or kills its process."""

    def __init__(self, microbatch: int, how: str, after_steps: int = 0, chunks: int = 4) -> None:
        super().__init__()
        self.microbatch, self.how, self.calls = microbatch, how, 0
        self.fault_at = after_steps * chunks + microbatch + 1  # forward calls, counting from 1

    def forward(self, x):
        if not gpipe.is_recomputing():
            self.calls += 1
            if self.calls == self.fault_at:
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise KeyError(f"injected fault at micro-batch {self.microbatch}")
        return x


def faulty(rank, stages, fault_stage, microbatch, how, timeout, after_steps=0, ordered=False):
    """A pipeline whose stage ``fault_stage`` fails; report what this rank raised, and when.

    ``after_steps`` good steps come first (receives of a fixed shape are then posted
    ahead); ``ordered`` posts receives as on NCCL (``distributed_cases.nccl_order``).
    """
    torch.set_num_threads(1)

    def factory():
        layers = []
        for s in range(stages):
            fault = Fault(microbatch, how, after_steps)
            layers += [nn.Linear(8, 8), fault if s == fault_stage else nn.ReLU()]
        return nn.Sequential(*layers)

    _together()
    with nccl_order(ordered):
        pipe = gpipe.Pipe(
            factory,
            balance=[2] * stages,
            chunks=4,
            group=dist.group.WORLD,
            timeout=timeout,
            transport="group" if ordered else "auto",
        )
    x = torch.randn(8, 8)
    for _ in range(after_steps):
        pipe.step(x, torch.randn(8, 8), F.mse_loss)
    return _outcome(lambda: pipe.step(x, torch.randn(8, 8), F.mse_loss))


class _Backward(torch.autograd.Function):
    """Identity whose backward raises ``KeyError`` (``how="raise"``) or overflows."""

    @staticmethod
    def forward(ctx, x, how):
        ctx.how = how
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.how == "raise":
            raise KeyError("injected fault in backward")
        return grad * float("inf"), None


class BackwardFault(nn.Module):
    """Identity whose backward raises, on its ``at``-th forward that builds a graph."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        if not torch.is_grad_enabled():
            return x
        self.calls += 1
        return _Backward.apply(x, "raise") if self.calls == self.at else x


def faulty_backward(rank, stages, fault_stage, at, schedule, checkpoint, timeout, before=0):
    """A pipeline whose stage ``fault_stage`` fails in a backward; what each rank raised.
    ``before`` healthy pipelines are built (and stepped) first in the same processes."""
    torch.set_num_threads(1)
    for _ in range(before):
        healthy = gpipe.Pipe(nn.Sequential(*[nn.Linear(8, 8) for _ in range(stages)]),
                             balance=[1] * stages, chunks=2, group=dist.group.WORLD)  # fmt: skip
        healthy.step(torch.randn(4, 8), torch.randn(4, 8), F.mse_loss)

    def factory():
        layers = [nn.Linear(8, 8) if i % 2 == 0 else nn.ReLU() for i in range(2 * stages)]
        layers[2 * fault_stage + 1] = BackwardFault(at)
        return nn.Sequential(*layers)

    _together()
    pipe = gpipe.Pipe(factory, balance=[2] * stages, chunks=4, group=dist.group.WORLD,
                      timeout=timeout, schedule=schedule, checkpoint=checkpoint)  # fmt: skip
    return _outcome(lambda: pipe.step(torch.randn(8, 8), torch.randn(8, 8), F.mse_loss))


def _outcome(call, start: float | None = None, pace: float = 0.0) -> dict:
    """What ``call()`` raised (type, message, the rank it names) and the seconds it took,
    counted from ``start`` (default: now); ``pace``: ``_paced``'s measure of the load."""
    start = time.monotonic() if start is None else start
    try:
        call()
    except BaseException as error:  # what each rank raised is the test's subject
        return {
            "type": type(error).__name__,
            "message": str(error),
            "rank": getattr(error, "rank", None),
            "seconds": time.monotonic() - start,
            "pipeline_error": isinstance(error, PipelineError),
            "pace": pace,
        }
    return {"type": None, "seconds": time.monotonic() - start, "pace": pace}


def late(outcome: dict, timeout: float) -> float:
    """The latest a rank waiting on a stalled one may raise: the timeout, its grace and its
    notice (``grace``: at most the timeout + 5 s), plus twice the good step's seconds on this
    rank (the load) up to one grace more, so that a second wait (``_long_stall``) still shows."""
    from gpipe.transport.inquest import grace

    return timeout + 5 + min(2 * outcome["pace"], grace(timeout))


def _paced(good_step) -> float:
    """Run the good step before a fault, then wait for every rank (the job's timeout): the
    timed part starts together however loaded the machine, so no rank's short timeout runs
    out on a peer still busy with the good step. Returns the step's seconds: this machine's
    load, measured in the same test, that bounds of the timed part may allow for."""
    began = time.monotonic()
    good_step()
    pace = time.monotonic() - began
    dist.barrier()
    return pace


DISAGREEMENT_TIMEOUT = 20.0


def disagreeing(rank, setting):
    """Two ranks that were given different Pipe arguments (or batches); what each raised."""
    torch.set_num_threads(1)
    kwargs = {"balance": [2, 2], "chunks": 4, "schedule": "gpipe"}
    if setting in kwargs:
        kwargs[setting] = (
            {"balance": [1, 3], "chunks": 2, "schedule": "1f1b"}[setting]
            if rank
            else kwargs[setting]
        )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    start = time.monotonic()
    try:
        pipe = gpipe.Pipe(model, group=dist.group.WORLD, timeout=DISAGREEMENT_TIMEOUT, **kwargs)
        rows = 6 if setting == "batch" and rank == 1 else 8
        pipe.step(torch.randn(8, 8), torch.randn(rows, 8), F.mse_loss)
    except BaseException as error:
        return {
            "type": type(error).__name__,
            "message": str(error),
            "seconds": time.monotonic() - start,
        }
    return {"type": None, "seconds": time.monotonic() - start}


class Overflows(nn.Module):
    """Identity whose backward overflows: the loss is finite, a gradient is not."""

    def forward(self, x):
        return _Backward.apply(x, "overflow")


def nonfinite(rank, where):
    """A step with a NaN input, or an overflowing backward: what each rank raised."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)]
    if where == "gradient":
        layers.insert(2, Overflows())
    model = nn.Sequential(*layers)
    pipe = gpipe.Pipe(model, balance=[2, len(layers) - 2], chunks=2, group=dist.group.WORLD)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    if where == "input":
        x[0, 0] = float("nan")
    try:
        pipe.step(x, y, F.mse_loss)
    except BaseException as error:
        grads = [p.grad for p in pipe.parameters()]
        return {"type": type(error).__name__, "message": str(error), "grads": grads}
    return {"type": None}


def _stall_or_die(how: str, timeout: float, folder: str) -> float:
    """Rank 1's fault: stall past the timeout (alive, silent: ``_stall``), or die at once.
    Returns the time it woke."""
    if how == "die":
        os._exit(3)
    _stall(folder, 1, timeout + 3)
    return time.monotonic()


def stalled(rank, before, how, timeout, folder, out=None, who=1):
    """Rank ``who`` stalls (alive, silent) or dies right before ``before``: "step" (the next
    step's seed broadcast, which rank 0 starts), "clip" (``clip_grad_norm_``'s all-reduce) or
    "save" (the first barrier of ``gpipe train``'s checkpoint save into ``out``), after one
    good step.

    Returns what this rank raised there and after how long; the stalled rank, once awake,
    what its own call raised and how long that took. The waiting rank marks in ``folder``
    that it has its outcome.
    """
    torch.set_num_threads(1)
    if before == "save":
        from gpipe.train import Trainer, resolve

        options = {"size": "tiny", "out": out, "timeout": timeout, "sample_tokens": 0}
        config = resolve(options, world_size=2)
        _together()
        trainer = Trainer(rank, config)
        pace = _paced(lambda: trainer.train_step(1))
        call = lambda: trainer.save(1)  # noqa: E731
    else:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        _together()
        pipe = gpipe.Pipe(model, balance=[2, 1], chunks=2, group=dist.group.WORLD, timeout=timeout)
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        pace = _paced(lambda: (pipe.step(x, y, F.mse_loss), pipe.clip_grad_norm_(1.0)))
        call = (lambda: pipe.step(x, y, F.mse_loss)) if before == "step" else (
            lambda: pipe.clip_grad_norm_(1.0)
        )  # fmt: skip
    if rank == who:
        return _outcome(call, start=_stall_or_die(how, timeout, folder), pace=pace)
    outcome = _outcome(call, pace=pace)
    (Path(folder) / str(rank)).touch()
    return outcome


def data_parallel_stalled(rank, timeout, folder):
    """DP2 x PP2 on four processes; after a good step, rank 3 (replica 1's last stage)
    sleeps past the timeout before its next step, so that replica 0 waits in the
    data-parallel gradient all-reduce. What each rank raised, and when (the stalled one:
    from when it wakes; the others mark in ``folder`` that they have theirs)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    _together()
    pipe = gpipe.Pipe(model, balance=[2, 1], chunks=2, group=mesh.get_group("pp"),
                      data_parallel_group=mesh.get_group("dp"), timeout=timeout)  # fmt: skip
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    _paced(lambda: pipe.step(x, y, F.mse_loss))
    if rank == 3:
        _stall(folder, 3, timeout + 3)
        return _outcome(lambda: pipe.step(x, y, F.mse_loss))
    outcome = _outcome(lambda: pipe.step(x, y, F.mse_loss))
    (Path(folder) / str(rank)).touch()
    return outcome


def _alive_until_all_have_raised(folder: str, rank: int, ranks: int, longest: float) -> None:
    """No rank exits (its closed sockets would wake the others) before every rank has its
    outcome, or ``longest`` seconds have passed: a file per rank in ``folder`` says so."""
    (Path(folder) / str(rank)).touch()
    deadline = time.monotonic() + longest
    while len(list(Path(folder).iterdir())) < ranks and time.monotonic() < deadline:
        time.sleep(0.05)


def _together() -> None:
    """Wait for every rank (the job's own timeout, not the short one under test) before a
    Pipe is built: its configuration check is the first wait the short timeout bounds, and
    under load one rank's build came to it more than those few seconds after the others,
    which then raised there, not at the fault. The build's first imports (torch's dynamo,
    sympy and FSDP: 0.5-1 s of CPU, the build's 0.02 s without them) are done before it."""
    import torch._dynamo
    import torch.distributed.fsdp  # noqa: F401

    dist.barrier()


def sharded_faulty(rank, fault_rank, at, schedule, shard, timeout, folder):
    """2 sharded replicas × 2 stages; rank ``fault_rank`` fails in its ``at``-th backward
    of the second step, then stays alive (it must not be the one that ends the others'
    waits). What each rank raised, and when."""
    from gpipe.parallel.mesh import Mesh

    torch.set_num_threads(1)
    mesh = Mesh.build(2, 2, timeout=timeout)
    fault = BackwardFault(at=0)

    def factory():
        layers = [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU()]
        layers[1] = fault if rank == fault_rank and fault_rank % 2 == 0 else layers[1]
        layers[3] = fault if rank == fault_rank and fault_rank % 2 == 1 else layers[3]
        return nn.Sequential(*layers)

    _together()
    pipe = gpipe.Pipe(factory, balance=[2, 2], chunks=4, group=mesh.pp, timeout=timeout,
                      data_parallel_group=mesh.dp, shard=shard, schedule=schedule)  # fmt: skip
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    _paced(lambda: pipe.step(x, y, F.mse_loss))
    fault.calls, fault.at = 0, at
    outcome = _outcome(lambda: pipe.step(x, y, F.mse_loss))
    _alive_until_all_have_raised(folder, rank, 4, longest=2 * timeout + 5)
    return outcome


class Stall(nn.Module):
    """Identity that hangs (alive, silent) in its ``at``-th forward, as ``_stall`` does."""

    def __init__(self, at: int, seconds: float, folder: str | None = None, others: int = 0) -> None:
        super().__init__()
        self.at, self.calls = at, 0
        self.folder, self.others, self.seconds = folder, others, seconds

    def forward(self, x):
        if not gpipe.is_recomputing():
            self.calls += 1
            if self.calls == self.at:
                _stall(self.folder, self.others, self.seconds)
        return x


def _stall(folder: str | None, others: int, seconds: float) -> None:
    """Hang (alive, silent) until the ``others`` ranks have marked in ``folder`` that they
    have their outcome, or ``seconds`` have passed: a rank that waits twice keeps the stall
    at its longest and shows as late; the others done, waking early changes nothing they
    report. No ``folder``: the whole ``seconds``."""
    deadline = time.monotonic() + seconds
    while (folder is None or len(list(Path(folder).iterdir())) < others) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)


def _long_stall(timeout: float) -> float:
    """Longer than a failed wait, its inquest, and the same again: the failure's agreement
    once waited for the stalled rank a second time, and ended only when it woke."""
    from gpipe.transport.inquest import grace

    return 2 * (timeout + grace(timeout)) + 1


def stalled_two_hops(rank, timeout, folder):
    """K=3; in the second step rank 2 hangs in a forward for longer than everyone's
    timeout. Rank 1 waits on rank 2, rank 0 on rank 1: what each raised, and when."""
    torch.set_num_threads(1)
    stall = Stall(at=0, folder=folder, others=2, seconds=_long_stall(timeout))

    def factory():
        layers = [nn.Linear(8, 8) if i % 2 == 0 else nn.ReLU() for i in range(6)]
        layers[5] = stall
        return nn.Sequential(*layers)

    _together()
    pipe = gpipe.Pipe(factory, balance=[2, 2, 2], chunks=2, group=dist.group.WORLD,
                      timeout=timeout)  # fmt: skip
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pace = _paced(lambda: pipe.step(x, y, F.mse_loss))
    stall.calls, stall.at = 0, 1  # the first forward of the next step
    outcome = _outcome(lambda: pipe.step(x, y, F.mse_loss), pace=pace)
    _alive_until_all_have_raised(folder, rank, 3, longest=3 * timeout + 10)
    return outcome


def data_parallel_fault(rank, how, shard, timeout, folder):
    """2 replicas x 2 stages (``shard``: sharded over the replicas); in the second step
    rank 3 (replica 1, stage 1) raises in a forward (``how="raise"``) or sleeps past the
    timeout before it (``"stall"``), and stays alive. What each rank raised, and when."""
    from gpipe.parallel.mesh import Mesh

    torch.set_num_threads(1)
    mesh = Mesh.build(2, 2, timeout=timeout)
    fault = Fault(microbatch=0, how="raise", after_steps=1, chunks=2)

    def factory():
        layers = [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU()]
        if rank == 3 and how == "raise":
            layers[3] = fault
        return nn.Sequential(*layers)

    _together()
    pipe = gpipe.Pipe(factory, balance=[2, 2], chunks=2, group=mesh.pp, timeout=timeout,
                      data_parallel_group=mesh.dp, shard="params" if shard else None)  # fmt: skip
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pace = _paced(lambda: pipe.step(x, y, F.mse_loss))
    start = None
    if rank == 3 and how == "stall":
        _stall(folder, 3, _long_stall(timeout))
        start = time.monotonic()
    outcome = _outcome(lambda: pipe.step(x, y, F.mse_loss), start=start, pace=pace)
    _alive_until_all_have_raised(folder, rank, 4, longest=3 * timeout + 10)
    return outcome
