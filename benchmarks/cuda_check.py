"""The pipeline on NCCL, prepared for the day GPUs are lent: equivalence, then runtime cost.

    python benchmarks/cuda_check.py                               # the GPUs, NCCL
    python benchmarks/cuda_check.py --device cpu --backend gloo   # a dry run on the CPU

1. **Equivalence**: the suite's GPT (tests/distributed_cases.py: float64, dropout 0.1),
   schedules gpipe, 1f1b, zb-h1 and interleaved-1f1b, the loss and every parameter's
   gradient against the un-split model on the same device (relative error ≤ 1e-10):
   * K processes, one device each (K: the GPUs, at most 4; two on the CPU), through the
     process group (``transport="group"``: NCCL's point-to-point, receives in its order);
   * one process holding 2 stages on one device (device copies);
   * a world of one process holding every stage, so that NCCL's collectives run even
     with a single GPU.
2. **Runtime cost** (two devices or the CPU): runtime_cost.py's latency-bound case (MLP of
   4 × Linear(16) + ReLU, one sample per micro-batch, M = 8 and 32), gpipe over the process
   group against ``torch.distributed.pipelining`` on the same two stage modules, steps
   alternating; medians, and 95% bootstrap intervals of the paired ratios.

Prints a compact report and exits 1 if any loss or gradient differs. About a minute on
two GPUs at the default ``--rounds``; well under 5 minutes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the suite's cases

from pipeline_throughput import median_interval
from runtime_cost import PEERS, WIDTH, mlp, mse

import gpipe
from distributed_cases import FACTORIES, INIT_SEED, batch
from gpipe.layout import even_balance
from gpipe.materialize import build
from gpipe.models import lm_loss
from gpipe.parallel.launch import launch
from reference import reference_step, relative_error

LIMIT = 1e-10  # float64
LAYERS = len(FACTORIES["gpt"]())
SCHEDULES = [("gpipe", 1, 4), ("1f1b", 1, 4), ("zb-h1", 1, 5), ("interleaved-1f1b", 2, 4)]
TIMEOUT = 120.0  # seconds: the process group's, and each launch's grace


def _rank_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # launch set it to the rank
    return torch.device("cpu")


def _compare(pipe: gpipe.Pipe, device: torch.device, chunks: int) -> dict:
    """One step of ``pipe`` against the un-split model on ``device``: the loss's error and
    the worst of this process's parameters' gradient errors."""
    x, y = batch("gpt", 0)
    loss = float(pipe.step(x, y, lm_loss, seed=100))
    model = build(FACTORIES["gpt"], seed=INIT_SEED).to(device)
    expected = reference_step(model, x.to(device), y.to(device), lm_loss, chunks=chunks, seed=100)
    theirs = dict(model.named_parameters())
    errors = {n: relative_error(p.grad, theirs[n].grad) for n, p in pipe.named_parameters()}
    worst = max(errors, key=errors.__getitem__)
    loss_error = relative_error(torch.tensor(loss, dtype=torch.float64), expected.detach().cpu())
    return {"loss": loss_error, "grad": errors[worst], "where": worst, "params": len(errors)}


def _equivalence_rank(rank: int, schedules: list[tuple[str, int, int]], world: int) -> list:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rows = []
    for schedule, virtual, chunks in schedules:
        pipe = gpipe.Pipe(
            FACTORIES["gpt"],
            balance=even_balance(LAYERS, world * virtual),
            chunks=chunks,
            checkpoint="except_last",
            schedule=schedule,
            virtual_stages=virtual,
            group=dist.group.WORLD,
            init_seed=INIT_SEED,
            timeout=60,
            transport="group",
        )
        rows.append({"schedule": schedule, **_compare(pipe, _rank_device(), chunks)})
    return rows


def _one_process(device: torch.device) -> list[dict]:
    rows = []
    for schedule, virtual, chunks in SCHEDULES:
        pipe = gpipe.Pipe(
            build(FACTORIES["gpt"], seed=INIT_SEED),
            balance=even_balance(LAYERS, 2 * virtual),
            devices=[device, device],
            chunks=chunks,
            checkpoint="except_last",
            schedule=schedule,
            virtual_stages=virtual,
        )
        rows.append({"schedule": schedule, **_compare(pipe, device, chunks)})
    return rows


def equivalence(processes: int, backend: str, device: torch.device) -> list[dict]:
    """Every part's rows: where, schedule, loss and worst gradient error (over ranks)."""
    rows = []
    if processes >= 2:
        fitting = [s for s in SCHEDULES if processes * s[1] <= LAYERS]
        per_rank = launch(_equivalence_rank, processes, args=(fitting, processes),
                          backend=backend, timeout=TIMEOUT)  # fmt: skip
        for index, (schedule, *_) in enumerate(fitting):
            ranks = [r[index] for r in per_rank]
            worst = max(ranks, key=lambda r: r["grad"])
            rows.append({**worst, "where": f"{processes} processes: {worst['where']}",
                         "params": sum(r["params"] for r in ranks),
                         "loss": max(r["loss"] for r in ranks), "schedule": schedule})  # fmt: skip
    for row in _one_process(device):
        rows.append({**row, "where": f"1 process, 2 stages: {row['where']}"})
    alone = [("gpipe", 1, 4), ("interleaved-1f1b", 2, 4)]
    for row in launch(_equivalence_rank, 1, args=(alone, 1), backend=backend,
                      timeout=TIMEOUT)[0]:  # fmt: skip
        rows.append({**row, "where": f"world of 1: {row['where']}"})
    return rows


def _timed(step: Callable[[], None], device: torch.device) -> float:
    """The step's wall time, to the slower rank (between barriers, the device drained)."""
    import torch.distributed as dist

    def drained() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    drained()
    start = time.perf_counter()
    step()
    drained()
    return time.perf_counter() - start


def _sides(rank: int, schedule: str, m: int, device: torch.device) -> dict[str, Callable]:
    """One training step of gpipe (over the process group) and of the peer, same stages."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    model = mlp()
    half = len(model) // 2
    mine = copy.deepcopy(model[:half] if rank == 0 else model[half:]).to(device)
    stage = pipelining.PipelineStage(mine, rank, 2, device, group=dist.group.WORLD)
    peer = getattr(pipelining, PEERS[schedule])(stage, n_microbatches=m, loss_fn=mse)
    pipe = gpipe.Pipe(copy.deepcopy(model), balance=[half, half], chunks=m, checkpoint="never",
                      schedule=schedule, group=dist.group.WORLD, transport="group")  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(m, WIDTH, generator=generator).to(device)
    y = torch.randn(m, WIDTH, generator=generator).to(device)

    def ours() -> None:
        pipe.step(x, y, mse)
        pipe.zero_grad(set_to_none=True)

    def theirs() -> None:
        peer.step(x) if rank == 0 else peer.step(target=y)
        mine.zero_grad(set_to_none=True)

    return {"gpipe": ours, "peer": theirs}


def _cost_rank(rank: int, cases: list[tuple[str, int]], rounds: int) -> list[dict]:
    torch.set_num_threads(1)
    device = _rank_device()
    results = []
    for schedule, m in cases:
        sides = _sides(rank, schedule, m, device)
        times: dict[str, list[float]] = {side: [] for side in sides}
        for round_ in range(3 + rounds):  # three warm-up rounds
            for side, step in sides.items():
                elapsed = _timed(step, device)
                if round_ >= 3:
                    times[side].append(elapsed)
        results.append({"schedule": schedule, "chunks": m, **times})
    return results


def runtime_cost(backend: str, rounds: int) -> list[dict]:
    cases = [(s, m) for m in (8, 32) for s in ("gpipe", "1f1b")]
    first, _ = launch(_cost_rank, 2, args=(cases, rounds), backend=backend, timeout=TIMEOUT)
    rows = []
    for row in first:  # the barriers make both ranks' times the slower rank's
        ratios = [p / g for g, p in zip(row["gpipe"], row["peer"], strict=True)]
        rows.append({"schedule": row["schedule"], "chunks": row["chunks"],
                     "gpipe": statistics.median(row["gpipe"]),
                     "peer": statistics.median(row["peer"]),
                     "ratio": statistics.median(ratios),
                     "interval": median_interval(ratios)})  # fmt: skip
    return rows


def report(where: str, rows: list[dict], cost: list[dict], rounds: int) -> str:
    lines = [f"cuda_check on {where}", "",
             f"Equivalence (float64; loss and every parameter's gradient, limit {LIMIT:.0e}):",
             "| part: worst parameter | schedule | loss error | gradient error | params | ok |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ok = "ok" if max(r["loss"], r["grad"]) <= LIMIT else "**MISMATCH**"
        lines.append(f"| {r['where']} | {r['schedule']} | {r['loss']:.1e} | {r['grad']:.1e} "
                     f"| {r['params']} | {ok} |")  # fmt: skip
    if cost:
        lines += ["", f"Runtime cost (latency-bound MLP, 2 processes, {rounds} rounds; medians; "
                  "gpipe over the process group):",
                  "| schedule | M | gpipe step | peer step | peer / gpipe | 95% interval |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in cost:
            lo, hi = r["interval"]
            lines.append(f"| {r['schedule']} | {r['chunks']} | {r['gpipe'] * 1e3:.2f} ms "
                         f"| {r['peer'] * 1e3:.2f} ms | {r['ratio']:.2f} "
                         f"| {lo:.2f}–{hi:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                        help="default: nccl on cuda, gloo on cpu")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds per cost row")
    args = parser.parse_args(argv)
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if (args.device, backend) not in (("cuda", "nccl"), ("cpu", "gloo")):
        parser.error(f"--device {args.device} runs with --backend "
                     f"{'nccl' if args.device == 'cuda' else 'gloo'}, not {backend}")  # fmt: skip
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no GPU here; for a dry run on the CPU: --device cpu --backend gloo")
    processes = min(torch.cuda.device_count(), 4) if args.device == "cuda" else 2
    start = time.perf_counter()
    rows = equivalence(processes, backend, torch.device(args.device, 0)
                       if args.device == "cuda" else torch.device("cpu"))  # fmt: skip
    cost = runtime_cost(backend, args.rounds) if processes >= 2 else []
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    where = (f"{processes if processes >= 2 else 1} × {name}, {backend}, torch "
             f"{torch.__version__}")  # fmt: skip
    print(report(where, rows, cost, args.rounds))
    if not cost:
        print("\nRuntime cost: needs two devices; skipped.")
    print(f"\n{time.perf_counter() - start:.0f} s in all")
    return 0 if all(max(r["loss"], r["grad"]) <= LIMIT for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
