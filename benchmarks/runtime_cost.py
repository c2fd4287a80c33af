"""The runtime's own cost, where it (not compute) sets the pace: tiny layers, many micro-batches.

    python benchmarks/runtime_cost.py [--out docs/benchmarks.md] [--profile DIR SCHEDULE,M]

Three measurements, each side by side in one run, steps alternating so that both sides see
the same machine; medians, and 95% bootstrap intervals of the paired ratios:

1. **Latency-bound pipeline**: a 4-layer MLP of width 16 (Linear + ReLU), batch = M (one
   sample per micro-batch), K=2 gloo processes with one thread each, gpipe's ``gpipe`` and
   ``1f1b`` schedules against ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and
   ``Schedule1F1B`` on the same two stage modules, at M = 8 and 32. Three sides: gpipe as
   it chooses (one machine, CPU stages: Unix sockets, ``gpipe.transport.sockets``), gpipe
   over the process group's gloo (``transport="group"``, as between machines), the peer.
2. **One process, per micro-batch**: the same MLP, M = 32 micro-batches of one sample:
   ``Pipe(K=1)`` against plain gradient accumulation (``loss / M`` backward per micro-batch),
   the difference per micro-batch.
3. **``Pipe(K=1, M=1)`` against the plain model**: an MLP of 16 × Linear(1024) at batch 256
   and the GPT of ``gpipe.models`` (4 blocks, d_model 256), one thread.

``--profile DIR SCHEDULE,M`` also profiles 30 steps of both gpipe sides of one row of case 1
with cProfile on both ranks and writes each rank's top functions to ``DIR/rank-R-SIDE.txt``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.models import GPTConfig, gpt, lm_loss
from gpipe.parallel.launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measured_timeline import machine, source, write_section  # a sibling script
from pipeline_throughput import median_interval  # a sibling script

SECTION = "runtime-cost"
# One process's rows are timed in the process's CPU time: one thread does all the work
# (torch.set_num_threads(1); autograd runs CPU backward on the caller's thread), so what
# other processes of a shared machine do changes the wall clock much more than this.
CLOCK = time.process_time
WIDTH, LAYERS = 16, 4
# --compute-bound: the same MLP wide enough, and micro-batches large enough, that the layers'
# compute sets the pace (a stage's step ~10x the latency-bound one's messages).
COMPUTE_WIDTH, COMPUTE_ROWS = 512, 32
PEERS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
SIDES = ("gpipe", "gpipe-gloo", "peer")  # gpipe as it chooses (sockets); over gloo; the peer


def mlp(width: int = WIDTH, layers: int = LAYERS) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())))


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


# -- 1. two processes, latency-bound ------------------------------------------------------


def _sides(
    rank: int, schedule: str, m: int, width: int = WIDTH, rows: int = 1
) -> dict[str, Callable[[], None]]:
    """One training step of each side on this rank (``SIDES``), same stages; micro-batches
    of ``rows`` samples."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    model = mlp(width)
    half = len(model) // 2
    mine = copy.deepcopy(model[:half] if rank == 0 else model[half:])
    stage = pipelining.PipelineStage(mine, rank, 2, torch.device("cpu"), group=dist.group.WORLD)
    peer = getattr(pipelining, PEERS[schedule])(stage, n_microbatches=m, loss_fn=mse)
    pipes = {
        transport: gpipe.Pipe(
            copy.deepcopy(model),
            balance=[half, half],
            chunks=m,
            checkpoint="never",
            schedule=schedule,
            group=dist.group.WORLD,
            transport=transport,
        )
        for transport in ("auto", "group")
    }
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(m * rows, width, generator=generator)
    y = torch.randn(m * rows, width, generator=generator)

    def ours(pipe: gpipe.Pipe) -> Callable[[], None]:
        def step() -> None:
            pipe.step(x, y, mse)
            pipe.zero_grad(set_to_none=True)

        return step

    def theirs() -> None:
        if rank == 0:
            peer.step(x)
        else:
            peer.step(target=y)
        mine.zero_grad(set_to_none=True)

    return {"gpipe": ours(pipes["auto"]), "gpipe-gloo": ours(pipes["group"]), "peer": theirs}


def _one_side_rank(rank: int, side: str, schedule: str, m: int, steps: int) -> None:
    """``steps`` steps of one side only, for a tool watching the processes from outside
    (``strace -f -c``: the system calls of gpipe's steps against the peer's)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    step = _sides(rank, schedule, m)[side]
    for _ in range(5):  # warm-up
        step()
    dist.barrier()
    for _ in range(steps):
        step()


def _pipeline_rank(
    rank: int,
    cases: list[tuple[str, int]],
    rounds: int,
    profile: tuple[str, str] | None,
    shape: tuple[int, int],
):
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = []
    for schedule, m in cases:
        sides = _sides(rank, schedule, m, *shape)

        def timed(step: Callable[[], None]) -> tuple[float, float, float]:
            """The step's wall time (to the slower rank), this process's CPU time, and the
            main thread's part of it (the rest is the backend's threads: gloo's loop)."""
            dist.barrier()
            start, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
            step()
            cpu, main = time.process_time() - cpu, time.thread_time() - main
            dist.barrier()
            return time.perf_counter() - start, cpu, main

        for _ in range(3):  # warm-up
            for step in sides.values():
                timed(step)
        times: dict[str, list[float]] = {
            f"{side}{part}": [] for side in SIDES for part in ("", "_cpu", "_main")
        }
        for _ in range(rounds):
            for name, step in sides.items():
                wall, cpu, main = timed(step)
                times[name].append(wall)
                times[f"{name}_cpu"].append(cpu)
                times[f"{name}_main"].append(main)
        results.append({"schedule": schedule, "chunks": m, **times})
        if profile is not None and f"{schedule},{m}" == profile[1]:
            for side in ("gpipe", "gpipe-gloo"):
                _profile(sides[side], Path(profile[0]) / f"rank-{rank}-{side}.txt")
    return results


def _profile(step: Callable[[], None], out: Path, steps: int = 30) -> None:
    """cProfile of ``steps`` steps on this rank, its top functions written to ``out``."""
    import torch.distributed as dist

    profiler = cProfile.Profile()
    dist.barrier()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    elapsed = (time.perf_counter() - start) / steps
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"{elapsed * 1e3:.2f} ms per step ({steps} steps, profiled)\n" + text.getvalue())


def pipeline_rows(
    rounds: int, profile: tuple[str, str] | None, compute_bound: bool = False
) -> list[dict]:
    shape = (COMPUTE_WIDTH, COMPUTE_ROWS) if compute_bound else (WIDTH, 1)
    cases = [(s, m) for m in ((8,) if compute_bound else (8, 32)) for s in ("gpipe", "1f1b")]
    per_rank = launch(_pipeline_rank, 2, args=(cases, rounds, profile, shape), timeout=1200)
    rows = []
    for r0, r1 in zip(*per_rank, strict=True):
        row = {"schedule": r0["schedule"], "chunks": r0["chunks"]}
        # A step is the slower rank's; CPU time is both ranks' together: the work each
        # runtime does per step, which a busy machine changes far less than the wall clock
        # (waiting costs no CPU time).
        wall = {s: [max(a, b) for a, b in zip(r0[s], r1[s], strict=True)] for s in SIDES}
        cpu = {
            s: [a + b for a, b in zip(r0[f"{s}_cpu"], r1[f"{s}_cpu"], strict=True)] for s in SIDES
        }
        for side in SIDES:
            row[side] = statistics.median(wall[side])
            row[f"{side}_cpu"] = statistics.median(cpu[side])
            row[f"{side}_main"] = statistics.median(
                a + b for a, b in zip(r0[f"{side}_main"], r1[f"{side}_main"], strict=True)
            )
        for side in ("gpipe", "gpipe-gloo"):  # the peer's time over this side's, paired
            ratios = [b / a for a, b in zip(wall[side], wall["peer"], strict=True)]
            cpu_ratios = [b / a for a, b in zip(cpu[side], cpu["peer"], strict=True)]
            row[f"{side}_ratio"] = statistics.median(ratios)
            row[f"{side}_interval"] = median_interval(ratios)
            row[f"{side}_cpu_ratio"] = statistics.median(cpu_ratios)
            row[f"{side}_cpu_interval"] = median_interval(cpu_ratios)
        rows.append(row)
    return rows


# -- 2. one process, per micro-batch ------------------------------------------------------------


def _alternate(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(3):
        for step in steps.values():
            step()
    for _ in range(rounds):
        for name, step in steps.items():
            start = CLOCK()
            step()
            times[name].append(CLOCK() - start)
    return times


def per_microbatch(rounds: int, m: int = 32) -> dict:
    torch.set_num_threads(1)
    model = mlp()
    plain = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[len(model)], chunks=m, checkpoint="never")
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(m, WIDTH, generator=generator)
    y = torch.randn(m, WIDTH, generator=generator)
    xs, ys = x.split(1), y.split(1)

    def accumulate() -> None:
        for xm, ym in zip(xs, ys, strict=True):
            (mse(plain(xm), ym) / m).backward()
        plain.zero_grad(set_to_none=True)

    def pipelined() -> None:
        pipe.step(x, y, mse)
        pipe.zero_grad(set_to_none=True)

    times = _alternate({"plain": accumulate, "pipe": pipelined}, rounds)
    extra = [(p - a) / m for a, p in zip(times["plain"], times["pipe"], strict=True)]
    return {
        "chunks": m,
        "plain": statistics.median(times["plain"]) / m,
        "pipe": statistics.median(times["pipe"]) / m,
        "extra": statistics.median(extra),
        "interval": median_interval(extra),
    }


# -- 3. Pipe(K=1, M=1) against the plain model ------------------------------------------------


def one_stage(rounds: int) -> list[dict]:
    torch.set_num_threads(1)
    cases = []
    torch.manual_seed(0)
    wide = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(16)))
    x = torch.randn(256, 1024)
    cases.append(("MLP 16 x Linear(1024), batch 256", wide, x, torch.randn(256, 1024), mse))
    config = GPTConfig(vocab_size=256, context=64, d_model=256, n_heads=4, n_layers=4, dropout=0.0)
    tokens = torch.randint(0, 256, (16, 64))
    cases.append(("GPT 4 blocks, d_model 256, batch 16 x 64", gpt(config), tokens, tokens, lm_loss))
    rows = []
    for label, model, x, y, loss_fn in cases:
        plain = copy.deepcopy(model)
        pipe = gpipe.Pipe(model, balance=[len(model)], chunks=1, checkpoint="never")

        def direct(plain=plain, x=x, y=y, loss_fn=loss_fn) -> None:
            loss_fn(plain(x), y).backward()
            plain.zero_grad(set_to_none=True)

        def pipelined(pipe=pipe, x=x, y=y, loss_fn=loss_fn) -> None:
            pipe.step(x, y, loss_fn)
            pipe.zero_grad(set_to_none=True)

        times = _alternate({"plain": direct, "pipe": pipelined}, rounds)
        overhead = [p / a - 1 for a, p in zip(times["plain"], times["pipe"], strict=True)]
        rows.append(
            {
                "label": label,
                "plain": statistics.median(times["plain"]),
                "pipe": statistics.median(times["pipe"]),
                "overhead": statistics.median(overhead),
                "interval": median_interval(overhead),
            }
        )
    return rows


# -- the report ----------------------------------------------------------------------------------


def _cpu_table(pipeline: Sequence[dict]) -> list[str]:
    """The CPU time of each side per step, and the peer's over each of gpipe's."""
    ms = 1e3
    lines = [
        "",
        "CPU time per step, both ranks' processes added (waiting costs none, so a busy machine "
        "changes it far less than the wall clock), and its main threads' part (Python, "
        "autograd, posting transfers; the rest is gloo's loop thread):",
        "",
        "| schedule | M | gpipe CPU (main) | gpipe over gloo CPU (main) | peer CPU (main) | "
        "CPU peer / gpipe | 95% interval | CPU peer / gpipe over gloo | 95% interval |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in pipeline:
        cells = " | ".join(
            f"{r[f'{side}_cpu'] * ms:.2f} ms ({r[f'{side}_main'] * ms:.2f})" for side in SIDES
        )
        ratios = " | ".join(
            f"{r[f'{side}_cpu_ratio']:.2f} | {lo:.2f}–{hi:.2f}"
            for side in ("gpipe", "gpipe-gloo")
            for lo, hi in [r[f"{side}_cpu_interval"]]
        )
        lines.append(f"| {r['schedule']} | {r['chunks']} | {cells} | {ratios} |")
    return lines


def report(
    pipeline: Sequence[dict],
    micro: dict | None,
    single: Sequence[dict],
    rounds: int,
    compute_bound: bool = False,
) -> str:
    ms = 1e3
    pace = (
        f"Compute-bound pipeline: MLP of {LAYERS} × Linear({COMPUTE_WIDTH}) + ReLU, "
        f"{COMPUTE_ROWS} samples per micro-batch"
        if compute_bound
        else f"Latency-bound pipeline: MLP of {LAYERS} × Linear({WIDTH}) + ReLU, batch = M (one "
        "sample per micro-batch)"
    )
    lines = [
        f"Measured by `python benchmarks/runtime_cost.py` on {machine()}, {source()}, "
        f"load {os.getloadavg()[0]:.1f} at the end; {rounds} rounds per row, the sides "
        "alternating; medians, 95% bootstrap intervals of the paired ratios.",
        "",
        f"{pace}, K=2 gloo processes, one thread each; a step is the slower "
        "rank's, between barriers. gpipe: as it chooses on one machine (Unix sockets, "
        '`gpipe.transport.sockets`); gpipe over gloo: `transport="group"`, the process '
        "group's point-to-point (as between machines); the peer: `torch.distributed.pipelining` "
        "(gloo's point-to-point).",
        "",
        "| schedule | M | gpipe step | gpipe over gloo | peer step | peer / gpipe | 95% interval "
        "| peer / gpipe over gloo | 95% interval |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in pipeline:
        lo, hi = r["gpipe_interval"]
        glo, ghi = r["gpipe-gloo_interval"]
        lines.append(
            f"| {r['schedule']} | {r['chunks']} | {r['gpipe'] * ms:.2f} ms | "
            f"{r['gpipe-gloo'] * ms:.2f} ms | {r['peer'] * ms:.2f} ms | "
            f"**{r['gpipe_ratio']:.2f}** | {lo:.2f}–{hi:.2f} | {r['gpipe-gloo_ratio']:.2f} | "
            f"{glo:.2f}–{ghi:.2f} |"
        )
    lines += _cpu_table(pipeline)
    if micro is not None:  # the parts left out (--only, --compute-bound) are not printed
        lo, hi = micro["interval"]
        lines += [
            "",
            f"One process, M={micro['chunks']} micro-batches of one sample: plain gradient "
            f"accumulation {micro['plain'] * 1e6:.0f} µs per micro-batch, `Pipe(K=1)` "
            f"{micro['pipe'] * 1e6:.0f} µs: the runtime adds **{micro['extra'] * 1e6:.0f} µs "
            f"per micro-batch** (95% interval {lo * 1e6:.0f}–{hi * 1e6:.0f}).",
        ]
    if single:
        lines += [
            "",
            "| `Pipe(K=1, M=1)` against the plain model | plain step | Pipe step | overhead | "
            "95% interval |",
            "|---|---|---|---|---|",
        ]
    for r in single:
        lo, hi = r["interval"]
        lines.append(
            f"| {r['label']} | {r['plain'] * ms:.2f} ms | {r['pipe'] * ms:.2f} ms | "
            f"{r['overhead']:+.1%} | {lo:+.1%} … {hi:+.1%} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="markdown file to update")
    parser.add_argument("--rounds", type=int, default=41, help="timed rounds per row")
    parser.add_argument(
        "--profile", nargs=2, default=None, metavar=("DIR", "SCHEDULE,M"),
        help="cProfile 30 steps of both gpipe sides of one row (e.g. gpipe,32) on each rank",
    )  # fmt: skip
    parser.add_argument(
        "--only", choices=["pipeline", "micro", "single"], default=None, help="one part"
    )
    parser.add_argument(
        "--compute-bound", action="store_true",
        help=f"part 1 only, at M=8 on an MLP of width {COMPUTE_WIDTH} with {COMPUTE_ROWS} samples "
        "per micro-batch: does the transport cost anything where compute sets the pace? "
        "(printed, never written into --out)",
    )  # fmt: skip
    parser.add_argument(
        "--one-side", nargs=4, default=None, metavar=("SIDE", "SCHEDULE", "M", "STEPS"),
        help="only run STEPS steps of one side (gpipe, gpipe-gloo or peer) of part 1, to watch "
        "from outside, e.g. strace -f -c python benchmarks/runtime_cost.py --one-side gpipe "
        "1f1b 8 200",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.one_side is not None:
        side, schedule, m, steps = args.one_side
        launch(_one_side_rank, 2, args=(side, schedule, int(m), int(steps)), timeout=1200)
        return
    if args.compute_bound:
        if args.out is not None:
            parser.error("--compute-bound prints its table: leave out --out")
        rows = pipeline_rows(args.rounds, None, compute_bound=True)
        print(report(rows, None, [], args.rounds, compute_bound=True))
        return
    pipeline = pipeline_rows(args.rounds, args.profile) if args.only in (None, "pipeline") else []
    micro = per_microbatch(args.rounds) if args.only in (None, "micro") else None
    single = one_stage(max(11, args.rounds // 2)) if args.only in (None, "single") else []
    text = report(pipeline, micro, single, args.rounds)
    print(text)
    if args.out is not None:
        write_section(args.out, SECTION, "## The runtime's own cost (latency-bound)\n\n" + text)


if __name__ == "__main__":
    main()
