"""Does "exact" repeat, and does the tool's reading agree with an independent one?

    python benchmarks/capacity_repeats.py --rows 1:no-remat 2:remat --repeats 3 \
        --out /tmp/repeats.jsonl
    # the independent check alone, of a row kept by capacity.py --save:
    python benchmarks/capacity_repeats.py --rows 8:remat --kept benchmarks/capacity_gpt.json

For rows of the GPT family of ``benchmarks/capacity.py`` (K stages, no remat or remat), each
row is verified ``--repeats`` times from its prediction (``verify_capacity(refine=True,
repeats=2)``: every run refines on its own and measures its own scatter), and each run's
verdict (exact, or the range it decides) printed. Then the independent check: the found
depth and the next size up of the last run are trained again by K processes each started
on its own (a fresh ``python``, its process group formed from the environment as under
torchrun, not forked by ``gpipe.launch``), each reading its own ``VmHWM`` (the kernel's
high-water mark of the whole process, never reset) as it ends, and what it held before
the build; each is set next to the tool's readings of the same process at the same depth
(how far outside them it lies, against the scatter: one process's largest spread between
the tool's runs), and the check's decided range is tested against it (a depth called
fitting that this launch finds over the budget, or one beyond the range that fits, is a
contradiction). One JSON line per result in ``--out``.

The memory beyond the model is ``--calibration`` (baseline, per process, per layer of the
model, per layer of a stage, MiB; default: docs/capacity.md's calibration of this family
at a637992): it moves the prediction the refinement starts from, not what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from gpipe.base._utils import MiB
from gpipe.base.allocator import started_with
from gpipe.estimate.memory_model import Calibration
from gpipe.planner import CapacityCheck, Measured, capacity, verify_capacity
from gpipe.planner.capacity import optimizer_state_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capacity import CHUNKS, families  # a sibling

BUDGET = 512 * MiB
MODES = {"no-remat": ["never"], "remat": ["always", "except_last"]}


def predicted(family, k: int, mode: str, overhead: Calibration):
    result = capacity(family, memory_budget=BUDGET, processes=8, overhead=overhead,
                      chunks=CHUNKS, stages=[k], replicas=[1], checkpoints=MODES[mode])  # fmt: skip
    return result.best


def independent(name: str, fit, timeout: float = 600.0) -> list[tuple[float, float]]:
    """Each rank's VmHWM and what it held before the build (bytes) when ``fit`` is trained
    by K processes started on their own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layout = fit.layout
    job = {"family": name, "depth": fit.depth, "balance": list(fit.balance),
           "layout": {"stages": layout.stages, "chunks": layout.chunks,
                      "schedule": layout.schedule, "checkpoint": layout.checkpoint,
                      "checkpoint_layers": layout.checkpoint_layers}}  # fmt: skip
    processes = []
    with started_with("return"):  # the allocator policy the tool measures with
        for rank in range(layout.stages):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(layout.stages),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
            processes.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(job)], env=env,
                stdout=subprocess.PIPE, text=True,
            ))  # fmt: skip
    outs = [p.communicate(timeout=timeout)[0] for p in processes]
    if any(p.returncode for p in processes):
        raise RuntimeError(f"an independent rank failed: {[p.returncode for p in processes]}")
    return [tuple(map(float, out.strip().splitlines()[-1].split())) for out in outs]


def worker(job: dict) -> None:
    """One rank started on its own: train as the tool's rank does, then print VmHWM."""
    import torch.distributed as dist

    from gpipe.layout import Layout
    from gpipe.planner import measured

    measured._reset_peak = lambda: False  # the whole process's high-water mark, never reset
    dist.init_process_group("gloo")
    layout = Layout(**job["layout"])
    state = optimizer_state_of("adamw")
    family = families()[job["family"]]
    peak, before = measured._train_rank(dist.get_rank(), family, job["depth"], layout,
                                        tuple(job["balance"]), state, 2, 300.0)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    print(int(peak), int(before), flush=True)


def run_row(name: str, k: int, mode: str, repeats: int, overhead, emit, parallel: int) -> None:
    family = families()[name]
    fit = predicted(family, k, mode, overhead)
    checks = []
    for i in range(1, repeats + 1):
        start = time.perf_counter()
        check = verify_capacity(family, fit, refine=True, moves=16, repeats=2, parallel=parallel)
        checks.append(check)
        runs = [m for m in (check.found, check.next_size, *check.again) if m is not None]
        emit({"row": f"{name} K={k} {mode}", "repeat": i, "layout": fit.layout.label(),
              "predicted": fit.depth, "exact": check.exact, "depths": check.depths,
              "scatter_mib": check.scatter / MiB,
              "peaks_mib": {str(d): [round(m.peak / MiB, 2) for m in runs if m.fit.depth == d]
                            for d in sorted({m.fit.depth for m in runs})},
              "minutes": (time.perf_counter() - start) / 60})  # fmt: skip
    last = checks[-1]
    for m in (last.found, last.next_size):
        emit(compared(name, f"{name} K={k} {mode}", last, m))


def compared(name: str, label: str, check: CapacityCheck, run: Measured, **extra) -> dict:
    """``run``'s depth of ``check`` trained once more by processes started on their own,
    against the tool's runs of that depth: per process, how far its own VmHWM lies outside
    the tool's readings of the same process (0 inside them), against the scatter (one
    process's largest spread between the tool's runs); and whether it contradicts the range
    the check decides (a depth it calls fitting over the budget, or one beyond it within)."""
    runs = [r for r in (check.found, check.next_size, *check.again) if r is not None and r.ran]
    tool = [r.measured for r in runs if r.fit.depth == run.fit.depth]
    own = independent(name, run.fit)
    peaks = [p for p, _ in own]
    by_process = zip(*tool, strict=True)
    outside = [max(p - max(t), min(t) - p, 0.0) for p, t in zip(peaks, by_process, strict=True)]
    low, high = check.depths
    depth, fits = run.fit.depth, max(peaks) <= BUDGET
    return {"row": label, "independent_depth": depth,
            "vmhwm_mib": [round(p / MiB, 2) for p in peaks],
            "before_mib": [round(b / MiB, 2) for _, b in own],
            "tool_mib": [[round(p / MiB, 2) for p in t] for t in tool],
            "difference_mib": round((max(peaks) - max(map(max, tool))) / MiB, 2),
            "outside_mib": round(max(outside) / MiB, 2),
            "scatter_mib": round(check.scatter / MiB, 2), "depths": list(check.depths),
            "independent_fits": fits,
            "contradicts": (depth <= low and not fits) or (depth > high and fits),
            **extra}  # fmt: skip


def kept_row(path: Path, name: str, k: int, mode: str, emit) -> None:
    """The independent check alone, of a row kept by ``capacity.py --save``: its found depth
    and next size up, each trained once more by processes started on their own, against
    the readings kept for the same depth (its runs and repeats)."""
    from capacity_saved import load  # a sibling

    _, rows, _ = load(path, families())[name]
    kind = "remat" if mode == "remat" else "no remat"
    row = next(r for r in rows if r.kind == kind and r.fit.layout.stages == k)
    check = row.check
    for m in (check.found, check.next_size):
        emit(compared(name, f"{name} K={k} {mode}", check, m, commit=row.commit))


def markdown(records: list[dict]) -> str:
    """The repeats, then the independent check, as the doc's tables."""
    lines = ["| row | run | layout | predicted | measured | scatter MiB | peaks MiB (depth: runs) "
             "| minutes |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in (r for r in records if "repeat" in r):
        low, high = r["depths"]
        verdict = f"{low} (exact)" if r["exact"] else f"{low}–{high} (within the scatter)"
        peaks = "; ".join(f"{d}: {' / '.join(map(str, p))}" for d, p in r["peaks_mib"].items())
        cells = [r["row"], r["repeat"], r["layout"], r["predicted"], verdict,
                 f"{r['scatter_mib']:.2f}", peaks, f"{r['minutes']:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "| row | depth | VmHWM, each process on its own (MiB) | the tool's runs, by "
              "process (MiB) | difference of the largest | farthest outside the tool's runs | "
              "scatter | decided | contradicts |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in (r for r in records if "independent_depth" in r):
        low, high = r.get("depths", (None, None))
        cells = [r["row"], r["independent_depth"], r["vmhwm_mib"], r["tool_mib"],
                 f"{r['difference_mib']:+.2f}", f"{r.get('outside_mib', float('nan')):.2f}",
                 f"{r['scatter_mib']:.2f}", f"{low}–{high}" if low != high else low,
                 "yes" if r.get("contradicts") else "no"]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--family", default="GPT")
    parser.add_argument("--rows", nargs="+", default=["1:no-remat", "2:remat"],
                        help="K:MODE, MODE no-remat or remat")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=2, help="runs side by side")
    parser.add_argument("--calibration", type=float, nargs=4,
                        default=[233.8, 98.0, 0.033, 0.211])  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("capacity_repeats.jsonl"))
    parser.add_argument("--kept", type=Path, help="no repeats: the independent check of "
                        "--rows as kept in this file by capacity.py --save")  # fmt: skip
    parser.add_argument("--table", type=Path, help="print --out's JSON lines kept in this file "
                        "as the doc's tables, measuring nothing")  # fmt: skip
    args = parser.parse_args()
    if args.table:
        return print(markdown([json.loads(line) for line in args.table.read_text().splitlines()]))
    if args.worker:
        return worker(json.loads(args.worker))
    base, process, per_layer, per_stage = (v * MiB for v in args.calibration)
    overhead = Calibration(process, per_layer, per_stage, base)

    def emit(record: dict) -> None:
        print(json.dumps(record), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    for row in args.rows:
        k, mode = row.split(":")
        if args.kept:
            kept_row(args.kept, args.family, int(k), mode, emit)
        else:
            run_row(args.family, int(k), mode, args.repeats, overhead, emit, args.parallel)


if __name__ == "__main__":
    main()
