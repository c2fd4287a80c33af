"""Where one measured run of the capacity benchmark spends its CPU: per process, the
interpreter's start (a fresh one: the allocator policy is read when a process starts), the
build, each training step (system time and page faults apart), and its peak.

    python benchmarks/capacity_launch.py GPT 4 2 379 --chunks 8 --per 2
    python benchmarks/capacity_launch.py ResNet 8 1 212 --chunks 8 --per 4
    python benchmarks/capacity_launch.py GPT 1 1 14 --chunks 2 --schedule gpipe --remat never

Each process runs ``gpipe.planner.measured._train_rank`` itself (what ``measure_fit``
runs, under the same policy), its Pipe's construction and steps timed from the outside,
so the peaks are the runs' own. CPU-seconds are the process's, its threads' included
(gloo's), and do not grow with the machine's load as wall time does.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any

from gpipe.base.allocator import started_with
from gpipe.layout import Layout
from gpipe.parallel.launch import launch
from gpipe.planner import measured
from gpipe.planner.capacity import fit_of, optimizer_state_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capacity import families  # a sibling: the benchmark's two families
from capacity_saved import kept_calibration

KEPT = Path(__file__).resolve().parent / "capacity_{}.json"  # the doc's rows


def _usage() -> tuple[float, float, int]:
    """This process's CPU-seconds (all of them, system's), and its minor page faults."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime, u.ru_stime, u.ru_minflt


def _timed_rank(rank: int, *args: Any) -> tuple[list[tuple[str, float, float, int]], float]:
    """``_train_rank`` with a mark after the start, the build and each step."""
    marks = [("start", *_usage())]
    plain = measured.Pipe

    class Timed(plain):  # the same Pipe, marked when built and after each step
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            marks.append(("build", *_usage()))

        def step(self, *a: Any, **k: Any) -> Any:
            out = super().step(*a, **k)
            marks.append((f"step {len(marks) - 1}", *_usage()))
            return out

    measured.Pipe = Timed
    try:
        peak, _ = measured._train_rank(rank, *args)
    finally:
        measured.Pipe = plain
    return marks, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=sorted(families()))
    parser.add_argument("stages", type=int)
    parser.add_argument("replicas", type=int, help="2: sharded replicas (shard='all')")
    parser.add_argument("depth", type=int)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--remat", default="always", help="checkpoint mode")
    parser.add_argument("--per", type=int, default=None, help="layers per remat group")
    args = parser.parse_args()
    family = families()[args.family]
    layout = Layout(stages=args.stages, replicas=args.replicas, chunks=args.chunks,
                    schedule=args.schedule, checkpoint=args.remat,
                    checkpoint_layers=args.per if args.remat != "never" else None,
                    shard="all" if args.replicas > 1 else None)  # fmt: skip
    # cut as the doc's rows are: by the memory model with the family's kept calibration
    overhead = kept_calibration([Path(str(KEPT).format(args.family.lower()))], families(),
                                args.family) or 0.0  # fmt: skip
    fit = fit_of(family, layout, args.depth, budget=float("inf"), overhead=overhead)
    # measure_fit's arguments of its runs: AdamW, 2 steps
    state = optimizer_state_of("adamw")
    ranks = (family, args.depth, layout, fit.balance, state, 2, 600.0)
    before, begun = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with started_with("return"):  # as measure_fit launches them
        out = launch(_timed_rank, layout.processes, args=ranks, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"{args.family} {layout.label()} depth {args.depth} {list(fit.balance)}: "
          f"{cpu:.1f} CPU-s ({after.ru_stime - before.ru_stime:.1f} system), "
          f"{time.perf_counter() - begun:.1f} s")  # fmt: skip
    for rank, (marks, peak) in enumerate(out):
        last, parts = (0.0, 0.0, 0), []
        for name, total, system, faults in marks:
            parts.append(f"{name} {total - last[0]:.1f} ({system - last[1]:.1f} sys, "
                         f"{(faults - last[2]) / 1e3:.0f}k faults)")  # fmt: skip
            last = (total, system, faults)
        print(f"  rank {rank}: peak {peak / 2**20:.1f} MiB; CPU-s: " + "; ".join(parts))


if __name__ == "__main__":
    main()
