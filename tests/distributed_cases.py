"""Code that runs inside the processes the multi-process tests launch: runs that go right
(their faults: tests/injected_faults.py).

It lives in a module (not in the test file) so that spawned processes can import it.
Every function returns plain data; the references are computed by the tests.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.base._utils import local_value
from gpipe.base.errors import PartitionError
from gpipe.materialize import build
from gpipe.models import GPTConfig, convnet, gpt, gpt_tied_names, lm_loss, unet
from gpipe.parallel.sharded import _param_groups, full_value
from reference import reference_step, running_stats_of_unsplit_batch

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


def trained_reference(case, replicas=(0,)):
    """The un-split model through ``case``'s steps as :func:`train_steps` takes them: per
    step the loss of each replica and the gradients averaged over them, AdamW between steps
    (``case["train"]``). Returns the last step's losses, gradients, and the weights."""
    model = build(FACTORIES[case["model"]], seed=INIT_SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lengths = case.get("lengths", [GPT.context])
    for step, length in enumerate(lengths):
        model.zero_grad(set_to_none=True)
        grads, losses = {}, []
        for replica in replicas:
            x, y = batch(case["model"], step, length, replica)
            losses.append(
                reference_step(model, x, y, loss_of(case["model"]), chunks=case["chunks"],
                               seed=100 + step)
            )  # fmt: skip
            for name, p in model.named_parameters():
                grads[name] = grads.get(name, 0) + p.grad / len(replicas)
            model.zero_grad(set_to_none=True)
        for name, p in model.named_parameters():
            p.grad = grads[name]
        if case.get("train") and step < len(lengths) - 1:
            optimizer.step()
    return losses, grads, {n: p.detach() for n, p in model.named_parameters()}


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


@contextlib.contextmanager
def nccl_order(ordered: bool):
    """With ``ordered``, a Pipe built here takes NCCL's paths on gloo (receives posted at the
    plan's points, a gloo side group, coalescing): its carrier is told the backend is 'nccl'
    (``gpipe.transport.distributed._backend``), which it reads once, when built."""
    from gpipe.transport import distributed

    told = distributed._backend
    if ordered:
        distributed._backend = lambda group: "nccl"
    try:
        yield
    finally:
        distributed._backend = told


def _pipe_of(case, group, data_parallel_group):
    with nccl_order(case.get("ordered", False)):
        return _built(case, group, data_parallel_group)


def _built(case, group, data_parallel_group):
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
        transport="group" if case.get("ordered") else case.get("transport", "auto"),
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


def sharded_cases_and_reuse(rank, cases):
    """:func:`data_and_pipeline` sharded, then :func:`sharded_reuse`: one launch of four."""
    return data_and_pipeline(rank, cases), sharded_reuse(rank)


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
    from gpipe.transport.framing import AGREEMENT, HEAD, read_head

    torch.set_num_threads(1)
    pipe = gpipe.Pipe(_leaving_model(), balance=[2, 2], chunks=2, group=dist.group.WORLD,
                      timeout=20, transport="sockets")  # fmt: skip
    carrier = pipe._transport.carrier
    post = carrier.post

    def row_late(sends, peer, tag, tensors, data=False):
        row = sends and tensors and tensors[0].numel() == HEAD
        row = row and read_head(tensors[0])[0] == AGREEMENT
        if row and rank == 1:
            time.sleep(wait)
        posted = post(sends, peer, tag, tensors, data)
        if row and rank == 0:
            time.sleep(3 * wait)
        return posted

    carrier.post = row_late
    x, y = _leaving_batch()
    loss = pipe.step(x, y, F.mse_loss, seed=3)
    return {
        "loss": None if loss is None else float(loss),
        "grads": {name: p.grad.clone() for name, p in pipe.named_parameters()},
    }


def reference(case, replicas=(0,)):
    """Loss, gradients (averaged over replicas) and BN statistics of the un-split model."""
    model_name = case["model"]
    lengths = case.get("lengths", [GPT.context])
    step = len(lengths) - 1
    grads, losses, stats = {}, [], {}
    for replica in replicas:
        model = build(FACTORIES[model_name], seed=INIT_SEED)
        x, y = batch(model_name, step, lengths[step], replica)
        if model_name == "cnn":
            stats = running_stats_of_unsplit_batch(model, x, case["chunks"])
        losses.append(
            reference_step(model, x, y, loss_of(model_name), chunks=case["chunks"], seed=100 + step)
        )
        for name, p in model.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad / len(replicas)
    return losses, grads, stats
