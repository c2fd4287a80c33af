"""Code that runs inside the processes test_distributed.py launches.

It lives in a module (not in the test file) so that spawned processes can import it.
Every function returns plain data; the references are computed by the tests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe._utils import local_value
from gpipe.errors import PartitionError, PipelineError
from gpipe.models import GPTConfig, convnet, gpt, gpt_tied_names, lm_loss, unet
from gpipe.parallel.sharded import _param_groups, full_value

GPT = GPTConfig(vocab_size=32, context=8, d_model=16, n_heads=2, n_layers=4, dropout=0.1)
INIT_SEED = 3
BATCH = 12


def gpt_factory() -> nn.Sequential:
    return gpt(GPT).double()


def cnn_factory() -> nn.Sequential:
    return convnet(channels=4, blocks=2).double()


def unet_factory() -> nn.Sequential:
    return unet(channels=4).double()


def gpt_tied_factory() -> nn.Sequential:
    return gpt(GPT, tie_embeddings=True).double()


WIDE = 3 << 16  # features crossing each stage boundary: 9 MiB per message of 6 samples (float64)


def wide_factory() -> nn.Sequential:
    """Small weights, wide boundaries (balance [4, 4]): every message between the stages
    is larger than a socket's kernel buffer."""
    layers = [nn.Linear(16, WIDE), nn.Tanh()]
    for _ in range(2):
        layers += [nn.Linear(WIDE, 16), nn.Linear(16, WIDE)]
    layers += [nn.Linear(WIDE, 16), nn.Tanh()]
    return nn.Sequential(*layers).double()


GPT_TIED = gpt_tied_names(GPT)
FACTORIES = {
    "wide": wide_factory,
    "gpt": gpt_factory,
    "gpt-tied": gpt_tied_factory,
    "cnn": cnn_factory,
    "unet": unet_factory,
}


def batch(model: str, step: int, length: int = GPT.context, replica: int = 0):
    """The (inputs, targets) of one step; the same in every process and in the test."""
    generator = torch.Generator().manual_seed(1000 * replica + step)
    if model.startswith("gpt"):
        x = torch.randint(0, GPT.vocab_size, (BATCH, length), generator=generator)
        y = torch.randint(0, GPT.vocab_size, (BATCH, length), generator=generator)
        return x, y
    if model == "wide":
        x = torch.randn(BATCH, 16, generator=generator, dtype=torch.float64)
        return x, torch.randn(BATCH, 16, generator=generator, dtype=torch.float64)
    if model == "unet":
        x = torch.randn(BATCH, 1, 8, 8, generator=generator, dtype=torch.float64)
        return x, torch.randint(0, 3, (BATCH, 8, 8), generator=generator)
    x = torch.randn(BATCH, 1, 6, 6, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 10, (BATCH,), generator=generator)


def loss_of(model: str):
    if model == "wide":
        return F.mse_loss
    return lm_loss if model.startswith("gpt") else F.cross_entropy


def train_steps(rank, cases, group=None, data_parallel_group=None, replica=0, keep=None):
    """Run each case's steps; return its last loss, gradients, buffers and gradient norm.

    ``keep``: a list the pipes are appended to, to outlive this call."""
    torch.set_num_threads(1)
    group = group or dist.group.WORLD
    results = []
    for case in cases:
        model = case["model"]
        pipe = _pipe_of(case, group, data_parallel_group)
        early = _count_buckets_started_during_backward(pipe, case.get("bucket_bytes"))
        whole = _whole_gradients_after_backward(pipe)
        reduce_inputs, largest_layer = _reduce_inputs_held(pipe)
        losses = []
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2) if case.get("train") else None
        for step, length in enumerate(case.get("lengths", [GPT.context])):
            pipe.zero_grad(set_to_none=True)
            x, y = batch(model, step, length, replica)
            losses.append(float(pipe.step(x, y, loss_of(model), seed=100 + step)))
            if optimizer is not None and step < len(case["lengths"]) - 1:
                optimizer.step()
        norm = float(pipe.clip_grad_norm_(case.get("clip", 1e12)))
        if keep is not None:
            keep.append(pipe)
        # sharded (shard="params"): each replica holds a part; gathered whole to compare
        results.append(
            {
                "losses": losses,
                "norm": norm,
                "grads": {n: full_value(p.grad).clone() for n, p in pipe.named_parameters()},
                "buffers": {n: b.clone() for n, b in pipe.named_buffers()},
                "params": {n: full_value(p.detach()).clone() for n, p in pipe.named_parameters()},
                "receive_ahead": pipe._transport.receive_ahead,
                "transport": pipe.transport,
                "elements": sum(p.numel() for p in pipe.parameters()),
                "local_elements": sum(local_value(p).numel() for p in pipe.parameters()),
                "buckets_started_during_backward": early,
                "whole_gradient_elements": max(whole, default=0),
                "reduce_inputs_held": max(reduce_inputs, default=0),
                "largest_layer": largest_layer,
            }
        )
    return results


def _count_buckets_started_during_backward(pipe, bucket_bytes):
    """Per step: gradient buckets whose all-reduce began before their stage's backward ended."""
    reducer, counts = pipe._reducer, []
    if reducer is None or pipe._sharded is not None:
        return counts
    if bucket_bytes is not None:  # small buckets, so that a stage has several
        reducer.bucket_bytes = bucket_bytes
        reducer._buckets = {stage.index: reducer._bucket(stage) for stage in pipe.stages}

    def counted(stage):
        counts.append(len(reducer._pending))
        reducer.stage_done(stage)

    pipe._runtime._after_backward = counted  # the runtime calls it after the last backward
    return counts


def _whole_gradients_after_backward(pipe):
    """Sharded: after each backward action, the elements of whole (unsharded) gradients
    held by this process's layers, with the stage's own sharded parameters."""
    counts, sharded = [], pipe._sharded
    if sharded is None:
        return counts

    def count():
        for s in pipe.stages:
            unsharded = sharded._unsharded_parameters_of(s.index)()
            counts.append(sum(p.grad.numel() for p in unsharded if p.grad is not None))

    def counted(run):
        def call(*args, **kwargs):
            out = run(*args, **kwargs)
            count()
            return out

        return call

    for stage in pipe.stages:
        stage.backward = counted(stage.backward)
        stage.backward_weight = counted(stage.backward_weight)
    return counts


def _reduce_inputs_held(pipe):
    """Sharded: after each layer's reduce-scatter, the elements of every reduce-scatter
    input still held by this process's layers (FSDP keeps them alive), and of the largest
    layer's parameters."""
    from torch.distributed.fsdp import fully_shard

    held, sharded = [], pipe._sharded
    if sharded is None:
        return held, 0
    layers = [layer for units in sharded._layers.values() for layer in units]
    groups = [g for layer in layers for g in _param_groups(layer)]
    contexts = {id(fully_shard.state(layer)._comm_ctx): fully_shard.state(layer)._comm_ctx
                for layer in layers}.values()  # fmt: skip

    def counted(run):
        def call(*args):
            run(*args)
            held.append(sum(s.reduce_scatter_input.numel() for c in contexts
                            for s in c.reduce_scatter_states))  # fmt: skip

        return call

    for group in groups:
        group.post_backward = counted(group.post_backward)
    return held, max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)


def _pipe_of(case, group, data_parallel_group):
    model = case["model"]
    return gpipe.Pipe(
        FACTORIES[model],
        balance=case["balance"],
        chunks=case["chunks"],
        checkpoint=case["checkpoint"],
        schedule=case["schedule"],
        virtual_stages=case.get("virtual", 1),
        deferred_batch_norm=model == "cnn",
        group=group,
        data_parallel_group=data_parallel_group,
        shard=case.get("shard"),
        init_seed=INIT_SEED,
        timeout=30,
        tied=[GPT_TIED] if model == "gpt-tied" else (),
        # "ordered": post receives as on NCCL (at the plan's points), though gloo carries them.
        receive_ahead=False if case.get("ordered") else None,
        transport=case.get("transport", "auto"),
    )


def data_and_pipeline(rank, cases):
    """DP2 x PP2 on four processes: a 2-D mesh of replicas and stages."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    results = train_steps(
        rank,
        cases,
        group=mesh.get_group("pp"),
        data_parallel_group=mesh.get_group("dp"),
        replica=replica,
    )
    return {"replica": replica, "results": results}


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
    ahead); ``ordered`` posts receives as on NCCL.
    """
    torch.set_num_threads(1)

    def factory():
        layers = []
        for s in range(stages):
            fault = Fault(microbatch, how, after_steps)
            layers += [nn.Linear(8, 8), fault if s == fault_stage else nn.ReLU()]
        return nn.Sequential(*layers)

    pipe = gpipe.Pipe(
        factory,
        balance=[2] * stages,
        chunks=4,
        group=dist.group.WORLD,
        timeout=timeout,
        receive_ahead=False if ordered else None,
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

    pipe = gpipe.Pipe(factory, balance=[2] * stages, chunks=4, group=dist.group.WORLD,
                      timeout=timeout, schedule=schedule, checkpoint=checkpoint)  # fmt: skip
    return _outcome(lambda: pipe.step(torch.randn(8, 8), torch.randn(8, 8), F.mse_loss))


def _outcome(call, start: float | None = None) -> dict:
    """What ``call()`` raised (type, message, the rank it names) and the seconds it took,
    counted from ``start`` (default: now)."""
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
        }
    return {"type": None, "seconds": time.monotonic() - start}


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


def _stall_or_die(how: str, timeout: float) -> float:
    """Rank 1's fault: sleep past the timeout (alive, silent), or die at once. Returns the
    time it woke."""
    if how == "die":
        os._exit(3)
    time.sleep(timeout + 3)
    return time.monotonic()


def stalled(rank, before, how, timeout, out=None, who=1):
    """Rank ``who`` stalls (alive, silent) or dies right before ``before``: "step" (the next
    step's seed broadcast, which rank 0 starts), "clip" (``clip_grad_norm_``'s all-reduce) or
    "save" (the first barrier of ``gpipe train``'s checkpoint save into ``out``), after one
    good step.

    Returns what this rank raised there and after how long; the stalled rank, once awake,
    what its own call raised and how long that took.
    """
    torch.set_num_threads(1)
    if before == "save":
        from gpipe.train import Trainer, resolve

        options = {"size": "tiny", "out": out, "timeout": timeout, "sample_tokens": 0}
        trainer = Trainer(rank, resolve(options, world_size=2))
        trainer.train_step(1)
        call = lambda: trainer.save(1)  # noqa: E731
    else:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        pipe = gpipe.Pipe(model, balance=[2, 1], chunks=2, group=dist.group.WORLD, timeout=timeout)
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        pipe.step(x, y, F.mse_loss)
        pipe.clip_grad_norm_(1.0)
        call = (lambda: pipe.step(x, y, F.mse_loss)) if before == "step" else (
            lambda: pipe.clip_grad_norm_(1.0)
        )  # fmt: skip
    return _outcome(call, start=_stall_or_die(how, timeout) if rank == who else None)


def data_parallel_stalled(rank, timeout):
    """DP2 x PP2 on four processes; after a good step, rank 3 (replica 1's last stage)
    sleeps past the timeout before its next step, so that replica 0 waits in the
    data-parallel gradient all-reduce. What each rank raised, and when (the stalled one:
    from when it wakes)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    pipe = gpipe.Pipe(model, balance=[2, 1], chunks=2, group=mesh.get_group("pp"),
                      data_parallel_group=mesh.get_group("dp"), timeout=timeout)  # fmt: skip
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe.step(x, y, F.mse_loss)
    start = None
    if rank == 3:
        time.sleep(timeout + 3)
        start = time.monotonic()
    return _outcome(lambda: pipe.step(x, y, F.mse_loss), start=start)


def _alive_until_all_have_raised(folder: str, rank: int, ranks: int, longest: float) -> None:
    """No rank exits (its closed sockets would wake the others) before every rank has its
    outcome, or ``longest`` seconds have passed: a file per rank in ``folder`` says so."""
    (Path(folder) / str(rank)).touch()
    deadline = time.monotonic() + longest
    while len(list(Path(folder).iterdir())) < ranks and time.monotonic() < deadline:
        time.sleep(0.05)


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

    pipe = gpipe.Pipe(factory, balance=[2, 2], chunks=4, group=mesh.pp, timeout=timeout,
                      data_parallel_group=mesh.dp, shard=shard, schedule=schedule)  # fmt: skip
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.step(x, y, F.mse_loss)
    fault.calls, fault.at = 0, at
    outcome = _outcome(lambda: pipe.step(x, y, F.mse_loss))
    _alive_until_all_have_raised(folder, rank, 4, longest=2 * timeout + 5)
    return outcome


class TwinOf(nn.Module):
    """A second module holding another module's weight (a shared parameter)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight

    def forward(self, x):
        return x @ self.weight.t()


def reused_factory(twin: bool):
    def factory():
        linear = nn.Linear(4, 4)
        extra = [TwinOf(linear)] if twin else []
        return nn.Sequential(linear, nn.Tanh(), linear, *extra, nn.Linear(4, 4)).double()

    return factory


def sharded_reuse(rank):
    """A module used twice in a stage, sharded: its gradients; and the error for two
    modules sharing a weight."""
    from gpipe.parallel.mesh import Mesh

    torch.set_num_threads(1)
    mesh = Mesh.build(2, 2, timeout=30)
    options = {"chunks": 2, "group": mesh.pp, "data_parallel_group": mesh.dp,
               "shard": "params", "init_seed": 2}  # fmt: skip
    pipe = gpipe.Pipe(reused_factory(False), balance=[3, 1], **options)
    generator = torch.Generator().manual_seed(rank // 2)
    x = torch.randn(4, 4, generator=generator, dtype=torch.float64)
    pipe.step(x, torch.randn(4, 4, generator=generator, dtype=torch.float64), F.mse_loss)
    grads = {n: full_value(p.grad) for n, p in pipe.named_parameters()}
    try:
        gpipe.Pipe(reused_factory(True), balance=[4, 1], **options)
        error = None
    except PartitionError as caught:
        error = str(caught)
    return grads, error


def thread_count(rank):
    """The threads ``launch`` left this process to compute with."""
    return torch.get_num_threads()


def environment_and_output(rank, name):
    """The variable ``name`` as this process sees it, after printing a line to fd 1."""
    print(f"rank {rank} says hello", flush=True)
    return os.environ.get(name)


def listening(port: int) -> list[tuple[str, str]]:
    """(local address in /proc/net's hex, socket inode) of each TCP socket listening at
    ``port`` on this machine."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, hexport = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hexport, 16) == port:
                found.append((address, fields[9]))
    return found


def _sockets_of(pid: int) -> set[str]:
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            held.add(os.readlink(fd))
    return held


def job_store(rank, launcher):
    """Where the job's store listens (``listening``), and which process holds it: the
    launcher (pid ``launcher``), this rank, or neither."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while not isinstance(store, dist.TCPStore):  # under the group's prefixes
        store = store.underlying_store
    found = listening(store.port)
    inodes = {f"socket:[{inode}]" for _, inode in found}
    return {
        "addresses": [address for address, _ in found],
        "launcher": bool(inodes) and inodes <= _sockets_of(launcher),
        "rank": bool(inodes & _sockets_of(os.getpid())),
    }


class Stall(nn.Module):
    """Identity that sleeps ``seconds`` in its ``at``-th forward (alive, silent: a hang)."""

    def __init__(self, at: int, seconds: float) -> None:
        super().__init__()
        self.at, self.seconds, self.calls = at, seconds, 0

    def forward(self, x):
        if not gpipe.is_recomputing():
            self.calls += 1
            if self.calls == self.at:
                time.sleep(self.seconds)
        return x


def _long_stall(timeout: float) -> float:
    """Longer than a failed wait, its inquest, and the same again: the failure's agreement
    once waited for the stalled rank a second time, and ended only when it woke."""
    from gpipe.transport.inquest import grace

    return 2 * (timeout + grace(timeout)) + 1


def stalled_two_hops(rank, timeout, folder):
    """K=3; in the second step rank 2 hangs in a forward for longer than everyone's
    timeout. Rank 1 waits on rank 2, rank 0 on rank 1: what each raised, and when."""
    torch.set_num_threads(1)
    stall = Stall(at=0, seconds=_long_stall(timeout))

    def factory():
        layers = [nn.Linear(8, 8) if i % 2 == 0 else nn.ReLU() for i in range(6)]
        layers[5] = stall
        return nn.Sequential(*layers)

    pipe = gpipe.Pipe(factory, balance=[2, 2, 2], chunks=2, group=dist.group.WORLD,
                      timeout=timeout)  # fmt: skip
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe.step(x, y, F.mse_loss)
    stall.calls, stall.at = 0, 1  # the first forward of the next step
    outcome = _outcome(lambda: pipe.step(x, y, F.mse_loss))
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

    pipe = gpipe.Pipe(factory, balance=[2, 2], chunks=2, group=mesh.pp, timeout=timeout,
                      data_parallel_group=mesh.dp, shard="params" if shard else None)  # fmt: skip
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe.step(x, y, F.mse_loss)
    start = None
    if rank == 3 and how == "stall":
        time.sleep(_long_stall(timeout))
        start = time.monotonic()
    outcome = _outcome(lambda: pipe.step(x, y, F.mse_loss), start=start)
    _alive_until_all_have_raised(folder, rank, 4, longest=3 * timeout + 10)
    return outcome


def told_transports(rank, transports):
    """Build a 2-stage Pipe with ``transports[rank]``; the error each rank raised, if any."""
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    try:
        pipe = gpipe.Pipe(model, balance=[2, 2], chunks=2, group=dist.group.WORLD, timeout=20,
                          transport=transports[rank])  # fmt: skip
    except PartitionError as error:
        return {"error": str(error)}
    pipe.step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
    return {"transport": pipe.transport}


FLAKY_MESH = "gpipe-flaky-mesh"  # a backend whose first mesh of a launch does not form


def _flaky_mesh(store, rank, size, timeout):
    """Gloo, but the first time in a folder (``GPIPE_FLAKY_MESH``) the ranks that come fail
    as gloo's full mesh does on a busy machine (one marker for all: a rank the launcher
    stopped before it came must not fail the next attempt)."""
    marker = Path(os.environ["GPIPE_FLAKY_MESH"]) / "tried"
    if not marker.exists():
        marker.touch()
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed "
                           "by peer [127.0.0.1]:4794 (simulated)")  # fmt: skip
    return dist.ProcessGroupGloo(store, rank, size, timeout)


dist.Backend.register_backend(FLAKY_MESH, _flaky_mesh, devices=["cpu"])


def rank_of(rank):
    return rank


def _leaving_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())


def _leaving_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=generator), torch.randn(4, 4, generator=generator)


def leaves_after_its_last_row(rank, wait):
    """One 2-stage step over the sockets. Rank 1 sends its row of the step's agreement
    ``wait`` s late, after rank 0 has read its last message; rank 0 reads that row only
    ``3 * wait`` s after sending its own, by when rank 1, done, has left. The loss (rank
    1's) and this rank's gradients by name."""
    from gpipe.transport.framing import AGREEMENT
    from gpipe.transport.sockets import _HEADER

    torch.set_num_threads(1)
    pipe = gpipe.Pipe(_leaving_model(), balance=[2, 2], chunks=2, group=dist.group.WORLD,
                      timeout=20, transport="sockets")  # fmt: skip
    transport, write = pipe._transport, pipe._transport._write

    def row_late(dst, parts):
        row = _HEADER.unpack(parts[0])[0] == AGREEMENT
        if row and rank == 1:
            time.sleep(wait)
        write(dst, parts)
        if row and rank == 0:
            time.sleep(3 * wait)

    transport._write = row_late
    x, y = _leaving_batch()
    loss = pipe.step(x, y, F.mse_loss, seed=3)
    return {
        "loss": None if loss is None else float(loss),
        "grads": {name: p.grad.clone() for name, p in pipe.named_parameters()},
    }
