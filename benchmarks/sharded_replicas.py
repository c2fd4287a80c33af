"""Sharded replicas (pipeline × FSDP): exactness, memory and step time against plain replicas.

2 replicas × 2 stages on 4 local processes (gloo), ``Pipe(shard="params")`` (the step's
gradients accumulated whole, reduce-scattered once) and ``Pipe(shard="all")`` (each
micro-batch's reduce-scattered into the shards) against ``Pipe(data_parallel_group=...)``
(every replica holds all of its stage):

1. **Exactness**: for every schedule × re-materialization mode, in float64 and float32, the
   worst relative error of any parameter's gradient (gathered whole from the shards)
   against the un-split, un-sharded model that steps both replicas' mini-batches (mean).
2. **Memory**: per process, the bytes of parameters + gradients + AdamW state it holds
   after an optimizer step (exact: the local tensors), and the growth of its peak RSS over
   its RSS before the model was built, for a GPT of ~11M parameters, each layout in its
   own launch.
3. **Step time**: the same GPT, 1F1B, M=4, plain and sharded pipes alternating in 15
   rounds in the same processes: the ratio sharded / plain per round, its median and 95 %
   bootstrap interval. Four processes share this machine's 2 cores: the ratio measures
   the extra work of sharding (an all-gather per layer per forward and backward, one
   reduce-scatter per step or per micro-batch instead of one all-reduce) under
   contention, not a speed-up.

    python benchmarks/sharded_replicas.py --out docs/sharded-replicas.md
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pipeline_throughput import median_interval
from torch import nn

import gpipe
from gpipe.base._utils import local_value
from gpipe.base.allocator import started_with
from gpipe.materialize import build
from gpipe.models import GPTConfig, gpt, lm_loss
from gpipe.parallel.launch import launch
from gpipe.parallel.mesh import Mesh
from gpipe.parallel.sharded import full_value

SMALL = GPTConfig(vocab_size=64, context=16, d_model=32, n_heads=4, n_layers=4, dropout=0.1)
LARGE = GPTConfig(vocab_size=8192, context=64, d_model=256, n_heads=8, n_layers=8, dropout=0.0)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2}
REMAT = ("never", "except_last", "always")
SHARDS = ("params", "all")
BATCH, CHUNKS, SEED = 8, 4, 5


def small(dtype: torch.dtype):
    def build() -> nn.Sequential:
        return gpt(SMALL).to(dtype)

    return build


def large() -> nn.Sequential:
    return gpt(LARGE)


def batch(config: GPTConfig, replica: int, step: int = 0):
    generator = torch.Generator().manual_seed(100 * replica + step)
    shape = (BATCH, config.context)
    return (
        torch.randint(0, config.vocab_size, shape, generator=generator),
        torch.randint(0, config.vocab_size, shape, generator=generator),
    )


def _pipe(factory, layers: int, mesh: Mesh, *, shard, schedule="1f1b",
          checkpoint="except_last", virtual=1):  # fmt: skip
    stages = 2 * virtual
    balance = [layers // stages + (i < layers % stages) for i in range(stages)]
    return gpipe.Pipe(
        factory, balance=balance, chunks=CHUNKS, schedule=schedule, checkpoint=checkpoint,
        virtual_stages=virtual, group=mesh.pp, data_parallel_group=mesh.dp, shard=shard,
        init_seed=SEED, timeout=120,
    )  # fmt: skip


# -- 1. exactness -------------------------------------------------------------------------


def _exactness_worker(rank: int, dtypes: list[str]) -> dict[tuple, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    mesh = Mesh.build(2, 2, timeout=120)
    replica = rank // 2
    out = {}
    for dtype in dtypes:
        factory = small(getattr(torch, dtype))
        for shard in SHARDS:
            for schedule, virtual in SCHEDULES.items():
                for checkpoint in REMAT:
                    pipe = _pipe(factory, SMALL.n_layers + 2, mesh, shard=shard,
                                 schedule=schedule, checkpoint=checkpoint,
                                 virtual=virtual)  # fmt: skip
                    x, y = batch(SMALL, replica)
                    pipe.step(x, y, lm_loss, seed=7)
                    out[(dtype, shard, schedule, checkpoint)] = {
                        n: full_value(p.grad) for n, p in pipe.named_parameters()
                    }
    return out


def _reference(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from gpipe.base import rng

    model = build(small(dtype), seed=SEED)
    grads: dict[str, torch.Tensor] = {}
    for replica in (0, 1):
        x, y = batch(SMALL, replica)
        model.zero_grad(set_to_none=True)
        # the micro-batches as the pipeline runs them, each with its own dropout draws
        for m, (xm, ym) in enumerate(zip(x.chunk(CHUNKS), y.chunk(CHUNKS), strict=True)):
            h = xm
            for index, layer in enumerate(model):
                with rng.seeded(rng.layer_seed(7, index, m), "cpu"):
                    h = layer(h)
            (lm_loss(h, ym) * len(xm) / len(x)).backward()
        for n, p in model.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / 2
    return grads


def exactness(dtypes: list[str]) -> list[dict[str, Any]]:
    per_rank = launch(_exactness_worker, 4, args=(dtypes,), timeout=600)
    rows = []
    for dtype in dtypes:
        expected = _reference(getattr(torch, dtype))
        for key in (k for k in per_rank[0] if k[0] == dtype):
            merged: dict[str, torch.Tensor] = {}
            for result in per_rank:
                merged.update(result[key])
            worst = max(
                float((merged[n].double() - g.double()).norm() / g.double().norm())
                for n, g in expected.items()
            )
            _, shard, schedule, checkpoint = key
            rows.append({"dtype": dtype, "shard": shard, "schedule": schedule,
                         "checkpoint": checkpoint, "worst": worst})  # fmt: skip
    return rows


# -- 2. memory ------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_worker(rank: int, shard: str | None) -> dict[str, float]:
    torch.set_num_threads(1)
    mesh = Mesh.build(2, 2, timeout=120)
    before = _rss()
    pipe = _pipe(large, LARGE.n_layers + 2, mesh, shard=shard)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    for step in range(2):
        x, y = batch(LARGE, rank // 2, step)
        pipe.step(x, y, lm_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    x, y = batch(LARGE, rank // 2, 2)
    pipe.step(x, y, lm_loss)  # gradients held, as before an optimizer step
    held = [*pipe.parameters()] + [p.grad for p in pipe.parameters() if p.grad is not None]
    held += [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    state = sum(local_value(t).numel() * t.element_size() for t in held)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"state": state, "rss_growth": peak - before,
            "parameters": sum(p.numel() for p in pipe.parameters())}  # fmt: skip


LABELS = {"plain": None, **{shard: shard for shard in SHARDS}}  # what each column runs


# glibc keeps freed blocks below its (growing) mmap threshold in the heap, so a process's
# resident memory stays at its high-water mark; under cpu_allocator("return") every large
# tensor is mapped and unmapped on its own, and peak RSS follows the live bytes.
def memory() -> dict[str, list[dict[str, float]]]:
    out = {}
    for allocator, policy in (("default", "default"), ("mmap", "return")):
        with started_with(policy):  # read by glibc when each spawned process starts
            for label, shard in LABELS.items():
                out[f"{label}, {allocator}"] = launch(_memory_worker, 4, args=(shard,), timeout=600)
    return out


# -- 3. step time -------------------------------------------------------------------------


def _timing_worker(rank: int, rounds: int, steps: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    mesh = Mesh.build(2, 2, timeout=300)
    layers = LARGE.n_layers + 2
    pipes = {label: _pipe(large, layers, mesh, shard=shard) for label, shard in LABELS.items()}
    x, y = batch(LARGE, rank // 2)

    def step(pipe) -> None:
        pipe.step(x, y, lm_loss)
        pipe.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {label: [] for label in pipes}
    for pipe in pipes.values():
        step(pipe)  # warm-up
    for _ in range(rounds):
        for label, pipe in pipes.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(pipe)
            dist.barrier()
            times[label].append((time.perf_counter() - start) / steps)
    return times


def timing(rounds: int, steps: int) -> dict[str, Any]:
    times = launch(_timing_worker, 4, args=(rounds, steps), timeout=900)[0]
    out: dict[str, Any] = {"rounds": rounds, "steps": steps}
    for label in LABELS:
        out[label] = statistics.median(times[label])
        if label != "plain":
            ratios = [s / p for p, s in zip(times["plain"], times[label], strict=True)]
            out[f"{label} ratio"] = statistics.median(ratios)
            out[f"{label} interval"] = median_interval(ratios)
    return out


# -- the report ----------------------------------------------------------------------------


def markdown(exact: list[dict], mem: dict[str, list[dict]], time_row: dict, command: str) -> str:
    mib = 2**20
    dtypes = sorted({r["dtype"] for r in exact}, reverse=True)  # float64 first
    columns = [(shard, d) for shard in SHARDS for d in dtypes]
    lines = [
        "# Sharded replicas: pipeline × FSDP",
        "",
        f"Generated by `{command}` on this machine "
        f"({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, gloo, "
        f"{os.cpu_count()} cores). 2 replicas × 2 stages = 4 processes. "
        "`Pipe(..., data_parallel_group=dp, shard=...)` shards each stage's parameters, "
        "gradients and AdamW state over its 2 replicas with FSDP2 (`fully_shard`, one unit per "
        "layer): a layer's parameters are gathered for each of its forward and backward "
        'passes and freed after. With `shard="params"` the gradients are accumulated '
        "unsharded over the micro-batches and reduce-scattered once per step; with "
        '`shard="all"` (`gpipe train --shard all`, the planner) each layer\'s gradient is '
        "reduce-scattered into the shards after each micro-batch's backward (see "
        "`gpipe.parallel.sharded`).",
        "",
        "## Exactness: every schedule × re-materialization mode",
        "",
        f"GPT ({SMALL.n_layers} blocks, d_model {SMALL.d_model}, vocabulary {SMALL.vocab_size}, "
        f"dropout {SMALL.dropout}), batch {BATCH} per replica in M={CHUNKS} micro-batches. "
        "Worst relative error (‖g − g_ref‖ / ‖g_ref‖) over every parameter's gradient, "
        "gathered whole from the shards, against the un-split, un-sharded model's gradient "
        "of the mean loss over both replicas' mini-batches (same dropout draws).",
        "",
        "| schedule | remat | " + " | ".join(f"{s!r}, {d}" for s, d in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    by = {(r["shard"], r["dtype"], r["schedule"], r["checkpoint"]): r["worst"] for r in exact}
    for schedule in SCHEDULES:
        for checkpoint in REMAT:
            cells = [f"{by[(s, d, schedule, checkpoint)]:.1e}" for s, d in columns]
            lines.append(f"| {schedule} | {checkpoint} | " + " | ".join(cells) + " |")
    worst = {d: max(r["worst"] for r in exact if r["dtype"] == d) for d in dtypes}
    bounds = {"float64": "1e-10", "float32": "1e-5"}
    lines += [
        "",
        "Worst: "
        + ", ".join(f"**{worst[d]:.1e}** in {d} (bound {bounds[d]})" for d in dtypes)
        + ".",
        "",
        "## Memory per process",
        "",
        f"GPT of {sum(r['parameters'] for r in mem['plain, default'][:2]) / 1e6:.1f}M parameters "
        f"({LARGE.n_layers} blocks, d_model {LARGE.d_model}, vocabulary {LARGE.vocab_size}, "
        f"sequence {LARGE.context}), AdamW, batch {BATCH} per replica, 1F1B, M={CHUNKS}. "
        "*State*: parameters + gradients + AdamW moments this process holds (its local "
        "tensors; measured after a step, before the optimizer's). *Peak RSS growth*: the "
        "process's peak resident memory over its resident memory before the model was built "
        "(activations, FSDP's gathered layers and the gradients during the step included).",
        "",
        "Peak RSS growth depends on the C allocator: by default glibc keeps freed blocks in "
        "its heap (below an mmap threshold that grows with use), so resident memory stays at "
        "its high-water mark of every allocation pattern seen; with "
        "`MALLOC_MMAP_THRESHOLD_=65536` (`--cpu-allocator return`) each large tensor is "
        "mapped and returned on its own, and the peak follows the live bytes. Both are shown, "
        'each sharded column with its ratio to plain replicas ("params" / "all").',
        "",
        "| rank | stage | state: plain | params | all | peak RSS growth: plain | params "
        "| all | with MALLOC_MMAP_THRESHOLD_=65536: plain | params | all |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(label: str, allocator: str, rank: int, of: str) -> str:
        value = mem[f"{label}, {allocator}"][rank][of]
        if label == "plain":
            return f"{value / mib:.1f} MiB"
        return f"{value / mib:.1f} MiB ({mem[f'plain, {allocator}'][rank][of] / value:.2f}×)"

    for rank in range(len(mem["plain, default"])):
        cells = [cell(label, "default", rank, "state") for label in LABELS]
        cells += [cell(x, a, rank, "rss_growth") for a in ("default", "mmap") for x in LABELS]
        lines.append(f"| {rank} | {rank % 2} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Reading it: sharding halves what each process holds between steps (state, 2.00×). "
        'During a step, `"params"` also holds its stage\'s unsharded gradient (P) and one '
        'gathered layer (P/R parameters + P gradients + 2P/R AdamW); `"all"` holds the '
        "gradient's shards and one layer's whole gradient instead (4P/R + a layer), against "
        "4P for plain replicas, activations on top of each. With glibc's default the freed "
        "gather and reduce buffers stay in the heap and the peak falls much less: a "
        "memory-bound run should return memory (`--cpu-allocator return`, or "
        "jemalloc/tcmalloc); on GPUs PyTorch's caching allocator manages these blocks "
        "instead (not measured here).",
    ]
    t = time_row
    lines += [
        "",
        "## Step time, sharded against plain replicas",
        "",
        f"The same GPT, the three pipes alternating in {t['rounds']} rounds of {t['steps']} "
        f"steps in the same 4 processes (one thread each, 2 cores), medians per step: plain "
        f"{t['plain'] * 1e3:.0f} ms, "
        + ", ".join(
            f'`"{label}"` {t[label] * 1e3:.0f} ms (**{t[f"{label} ratio"]:.2f}×** plain, 95 % '
            f"interval {t[f'{label} interval'][0]:.2f}–{t[f'{label} interval'][1]:.2f})"
            for label in SHARDS
        )
        + ". Sharding adds an all-gather per layer for each forward and each backward of each "
        "micro-batch (2·M per layer per step, 3·M with re-materialization) and swaps the "
        'all-reduce for one reduce-scatter per step (`"params"`) or one per micro-batch '
        '(`"all"`); on 4 processes sharing 2 cores that traffic is not hidden behind compute.',
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="float64 only, 3 rounds")
    args = parser.parse_args()
    exact = exactness(["float64"] if args.quick else ["float64", "float32"])
    print(f"exactness: worst {max(r['worst'] for r in exact):.1e}", flush=True)
    mem = memory()
    print(mem, flush=True)
    time_row = timing(3 if args.quick else args.rounds, args.steps)
    print(time_row, flush=True)
    command = "python benchmarks/sharded_replicas.py" + (f" --out {args.out}" if args.out else "")
    report = markdown(exact, mem, time_row, command)
    if args.out:
        args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
