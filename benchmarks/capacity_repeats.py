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
high-water mark of the whole process, never reset) as it ends; they are set next to the
tool's readings of the same depth. One JSON line per result in ``--out``.

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
from gpipe.planner import capacity, verify_capacity
from gpipe.planner.capacity import optimizer_state_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capacity import CHUNKS, families  # a sibling

BUDGET = 512 * MiB
MODES = {"no-remat": ["never"], "remat": ["always", "except_last"]}


def predicted(family, k: int, mode: str, overhead: Calibration):
    result = capacity(family, memory_budget=BUDGET, processes=8, overhead=overhead,
                      chunks=CHUNKS, stages=[k], replicas=[1], checkpoints=MODES[mode])  # fmt: skip
    return result.best


def independent(name: str, fit, timeout: float = 600.0) -> list[float]:
    """Each rank's VmHWM (bytes) when ``fit`` is trained by K processes started on their own."""
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
    return [float(out.strip().splitlines()[-1]) for out in outs]


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
    peak, _ = measured._train_rank(dist.get_rank(), family, job["depth"], layout,
                                   tuple(job["balance"]), state, 2, 300.0)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    print(int(peak), flush=True)


def run_row(name: str, k: int, mode: str, repeats: int, overhead, emit) -> None:
    family = families()[name]
    fit = predicted(family, k, mode, overhead)
    checks = []
    for i in range(1, repeats + 1):
        start = time.perf_counter()
        check = verify_capacity(family, fit, refine=True, moves=16, repeats=2)
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
        tool = [r.peak for r in (last.found, last.next_size, *last.again)
                if r is not None and r.fit.depth == m.fit.depth]  # fmt: skip
        own = independent(name, m.fit)
        emit({"row": f"{name} K={k} {mode}", "independent_depth": m.fit.depth,
              "vmhwm_mib": [round(p / MiB, 2) for p in own],
              "tool_mib": [round(p / MiB, 2) for p in tool],
              "difference_mib": round((max(own) - max(tool)) / MiB, 2),
              "scatter_mib": round(last.scatter / MiB, 2),
              "independent_fits": max(own) <= BUDGET})  # fmt: skip


def kept_row(path: Path, name: str, k: int, mode: str, emit) -> None:
    """The independent check alone, of a row kept by ``capacity.py --save``: its found depth
    and next size up, each trained once more by processes started on their own, against
    the readings kept for the same depth (its runs and repeats)."""
    from capacity_saved import load  # a sibling

    _, rows, _ = load(path, families())[name]
    kind = "remat" if mode == "remat" else "no remat"
    row = next(r for r in rows if r.kind == kind and r.fit.layout.stages == k)
    check = row.check
    runs = [r for r in (check.found, check.next_size, *check.again) if r is not None]
    for m in (check.found, check.next_size):
        own = independent(name, m.fit)
        tool = [r.peak for r in runs if r.fit.depth == m.fit.depth]
        emit({"row": f"{name} K={k} {mode}", "independent_depth": m.fit.depth,
              "vmhwm_mib": [round(p / MiB, 2) for p in own],
              "tool_mib": [round(p / MiB, 2) for p in tool],
              "difference_mib": round((max(own) - max(tool)) / MiB, 2),
              "scatter_mib": round(check.scatter / MiB, 2),
              "independent_fits": max(own) <= BUDGET, "commit": row.commit})  # fmt: skip


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
    lines += ["", "| row | depth | VmHWM, each process on its own (MiB) | the tool's "
              "readings (MiB) | difference of the largest | scatter |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in (r for r in records if "independent_depth" in r):
        cells = [r["row"], r["independent_depth"], r["vmhwm_mib"], r["tool_mib"],
                 f"{r['difference_mib']:+.2f}", f"{r['scatter_mib']:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--family", default="GPT")
    parser.add_argument("--rows", nargs="+", default=["1:no-remat", "2:remat"],
                        help="K:MODE, MODE no-remat or remat")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
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
            run_row(args.family, int(k), mode, args.repeats, overhead, emit)


if __name__ == "__main__":
    main()
