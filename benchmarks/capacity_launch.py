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

``--compare N`` asks whether one step would do: N runs each of two steps as measured (the
optimizer's state made by the first) and of two steps with the state made before the
first, alternating; per process, the peak of the first against what one step with the
state made first reads (its peak after the first step's optimizer), and after both.

    python benchmarks/capacity_launch.py GPT 1 1 46 --chunks 16 --remat never --compare 2
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gpipe.base._utils import MiB
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


def _with_state(optimizer: Any) -> Any:
    """``optimizer`` with its state made now, as its first step would make it (a step on
    zero gradients at learning rate 0, which leaves the parameters as they are): the way
    one step might read the peak that two steps read when the first makes the state, which
    ``--compare`` measures (docs/capacity.md: it does not)."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    for p in parameters:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    return optimizer


def _timed_rank(
    rank: int, prepared: bool, *args: Any
) -> tuple[list[tuple[str, float, float, int, float]], float]:
    """``_train_rank`` with a mark after the start, the build, each step and each optimizer
    step (each mark with the peak so far); ``prepared``: the optimizer's state made before
    the first step (``--compare``'s new way), not by it."""
    marks = [("start", *_usage(), measured._peak_resident_bytes())]
    plain, optimizer = measured.Pipe, measured._optimizer
    if prepared:
        measured._optimizer = lambda *a: _with_state(optimizer(*a))

    class Timed(plain):  # the same Pipe, marked when built and after each step
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            marks.append(("build", *_usage(), measured._peak_resident_bytes()))

        def step(self, *a: Any, **k: Any) -> Any:
            if len(marks) > 2:  # the optimizer's step since the last mark
                marks.append(("optimizer", *_usage(), measured._peak_resident_bytes()))
            out = super().step(*a, **k)
            marks.append(
                (f"step {(len(marks) + 1) // 2}", *_usage(), measured._peak_resident_bytes())
            )
            return out

    measured.Pipe = Timed
    try:
        peak, _ = measured._train_rank(rank, *args)
    finally:
        measured.Pipe, measured._optimizer = plain, optimizer
    return marks, peak


def _run(layout: Layout, ranks: tuple, prepared: bool) -> dict[str, Any]:
    """One measured run of ``layout``'s processes: its CPU-seconds (every process's) and each
    process's marks and peak."""
    before, begun = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with started_with("return"):  # as measure_fit launches them
        out = launch(_timed_rank, layout.processes, args=(prepared, *ranks), timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "prepared": prepared, "steps": ranks[5], "wall": time.perf_counter() - begun,
        "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        "system": after.ru_stime - before.ru_stime,
        "marks": [marks for marks, _ in out], "peaks": [peak for _, peak in out],
    }  # fmt: skip


def _print(run: dict[str, Any]) -> None:
    way = "state made first" if run["prepared"] else "state made by step 1"
    print(f"{run['steps']} step(s), {way}: {run['cpu']:.1f} CPU-s ({run['system']:.1f} "
          f"system), {run['wall']:.1f} s")  # fmt: skip
    for rank, (marks, peak) in enumerate(zip(run["marks"], run["peaks"], strict=True)):
        last, parts = (0.0, 0.0, 0), []
        for name, total, system, faults, high in marks:
            parts.append(
                f"{name} {total - last[0]:.1f} ({system - last[1]:.1f} sys, "
                f"{(faults - last[2]) / 1e3:.0f}k faults, peak {high / MiB:.2f})"
            )
            last = (total, system, faults)
        print(f"  rank {rank}: peak {peak / MiB:.2f} MiB; CPU-s: " + "; ".join(parts))


def _compare(runs: list[dict[str, Any]]) -> None:
    """Per process: the peak of 2 steps with the state made by the first (old), and with it
    made before them: after the first step's optimizer (new, what 1 step reads) and after
    both (new 2); the spread of one process within a way; new less old."""
    old = [r["peaks"] for r in runs if not r["prepared"]]
    new = [[marks[3][-1] for marks in r["marks"]] for r in runs if r["prepared"]]
    new2 = [r["peaks"] for r in runs if r["prepared"]]
    spread = max(max(p) - min(p) for way in (old, new) for p in zip(*way, strict=True))
    print(f"per process, MiB (the largest spread of one process within old or new: "
          f"{spread / MiB:.2f}):")  # fmt: skip
    ways = zip(zip(*old, strict=True), zip(*new, strict=True), zip(*new2, strict=True),
               strict=True)  # fmt: skip
    for rank, (a, b, c) in enumerate(ways):
        diff = statistics.mean(b) - statistics.mean(a)
        print(f"  rank {rank}: old {' / '.join(f'{x / MiB:.2f}' for x in a)}; new "
              f"{' / '.join(f'{x / MiB:.2f}' for x in b)}; new - old {diff / MiB:+.2f}; "
              f"new 2 {' / '.join(f'{x / MiB:.2f}' for x in c)}")  # fmt: skip
    largest = [max(p) for p in old], [max(p) for p in new]
    print(f"  largest: old {' / '.join(f'{x / MiB:.2f}' for x in largest[0])}; new "
          f"{' / '.join(f'{x / MiB:.2f}' for x in largest[1])}")  # fmt: skip


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
    parser.add_argument("--compare", type=int, default=0, metavar="N",
                        help="N runs each of 2 steps with the optimizer's state made by the "
                        "first step (as before) and made before it, alternating")  # fmt: skip
    parser.add_argument("--log", type=Path, help="append each run as a JSON line")
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
    print(f"{args.family} {layout.label()} depth {args.depth} {list(fit.balance)}")
    # measure_fit's arguments of its runs: AdamW, its steps
    steps = inspect.signature(measured.measure_fit).parameters["steps"].default
    ranks = (family, args.depth, layout, fit.balance, optimizer_state_of("adamw"), steps, 600.0)
    ways = [(False, ranks)]
    if args.compare:  # both ways 2 steps: the new way's first step read at its optimizer
        old, new = (False, (*ranks[:5], 2, ranks[6])), (True, (*ranks[:5], 2, ranks[6]))
        ways = [w for i in range(args.compare) for w in ((old, new), (new, old))[i % 2]]
    runs = []
    for prepared, arguments in ways:
        runs.append(_run(layout, arguments, prepared))
        _print(runs[-1])
        if args.log:
            with args.log.open("a") as log:
                log.write(json.dumps({"row": f"{args.family} {layout.label()}",
                                      "depth": args.depth, **runs[-1]}) + "\n")  # fmt: skip
    if args.compare:
        _compare(runs)


if __name__ == "__main__":
    main()
