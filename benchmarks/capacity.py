"""The largest model that trains within a fixed memory budget per process, for K = 1, 2, 4, 8.

    python benchmarks/capacity.py --out docs/capacity.md --plot docs/img/capacity.png
    python benchmarks/capacity.py --k1 --out docs/capacity.md   # K=1 against plain PyTorch
    python benchmarks/capacity.py --sharded --out docs/capacity.md  # 2 sharded replicas alone
    # a family per run, each kept, then the doc and plot from both:
    python benchmarks/capacity.py --family GPT --save gpt.json
    python benchmarks/capacity.py --load gpt.json resnet.json --out docs/capacity.md ...
    # rows measured alone (minutes), in place of the kept ones, with their calibration:
    python benchmarks/capacity.py --load gpt.json --rows GPT 1 no-remat --save gpt.json ...

GPipe's Table 1: with re-materialization the largest trainable model grows about linearly
with the number of stages K. For the GPT and the ResNet of ``gpipe.models`` (by depth), one
budget of resident memory per process and AdamW, each row is the largest depth that
``gpipe.planner.capacity`` predicts to fit, over micro-batch counts and schedules, for K
stages without re-materialization, with it, and with 2 sharded replicas
(``Pipe(shard="all")``). The budget is each process's whole peak resident memory
(Python, torch and gloo included). Rows are then trained for real (2 steps, one process per
stage and replica, ``gpipe.planner.verify_capacity``; sharded ones at ``--measure-sharded``
K) with the next size up (depth + 1) at ``--next-size`` K, and refined a block at a time
until the found depth measures within the budget and the next one over it: the measured
answer, next to the predicted one. The per-process memory beyond the model is calibrated
once per family (``gpipe.planner.calibrate``, on 8 processes). The ratios are shown next to
those of GPipe's Table 1.

``--sharded`` measures only what the sharded target needs, in its own section of the doc:
the GPT family's rows with remat and with 2 sharded replicas at ``--measure-sharded`` K,
each refined until exact, and their ratios (minutes instead of the whole table's hour).

``--k1``: one process against plain PyTorch (``benchmarks/capacity_k1.py``).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpipe.base._utils import MiB
from gpipe.estimate.memory_model import Calibration
from gpipe.planner import calibrate, capacity, verify_capacity
from gpipe.planner.capacity import fit_of
from gpipe.planner.families import Family, gpt_family, resnet_family

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capacity_doc import (  # a sibling: the rows and the doc's tables
    SHARDED_STAGES,
    STAGES,
    TARGETS,
    Row,
    order,
    paper,
    plot,
    ratio,
    ratios,
    table,
    targets,
    terms_table,
    write_doc,
)
from capacity_saved import Results, kept_calibration, load, save

CHUNKS = (1, 2, 4, 8, 16)
MODES = {"no-remat": "no remat", "remat": "remat", "sharded": "2 sharded replicas"}  # --rows


def families() -> dict[str, Family]:
    return {
        # activations per block ~ 8x its parameter bytes (tokens / d_model = 8), so that
        # both matter; sizes keep the measured runs within minutes on 2 cores
        "GPT": gpt_family(d_model=128, heads=4, seq=64, vocab=2048, batch=16),
        "ResNet": resnet_family(channels=32, image=32, batch=8),
    }


def search(
    family: Family, budget: float, overhead: Calibration, wanted: Callable[[str, int], bool]
) -> list[Row]:
    """The table's rows (kind, K) that ``wanted`` keeps, each the best layout the search
    predicts (a single row's search takes seconds; the whole table's minutes)."""
    rows = []
    common = {"memory_budget": budget, "processes": 8, "overhead": overhead, "chunks": CHUNKS}
    for k in STAGES:
        if k == 1 and wanted("no remat, gpipe", k):  # gpipe keeps every micro-batch: naive-1
            result = capacity(family, stages=[1], replicas=[1], checkpoints=["never"],
                              schedules=["gpipe"], **common)  # fmt: skip
            rows.append(Row("no remat, gpipe", result.best))
        for kind, modes in (("no remat", ["never"]), ("remat", ["always", "except_last"])):
            if wanted(kind, k):
                result = capacity(family, stages=[k], replicas=[1], checkpoints=modes, **common)
                rows.append(Row(kind, result.best))
    for k in SHARDED_STAGES:
        if wanted("2 sharded replicas", k):
            result = capacity(family, stages=[k], replicas=[2], shard=["all"], **common)
            rows.append(Row("2 sharded replicas", result.best))
    return rows


def every(kind: str, k: int) -> bool:
    return True


def measure(
    family: Family,
    rows: list[Row],
    next_size: tuple[int, ...],
    sharded: tuple[int, ...],
    moves: int = 12,
    starts: dict[tuple[str, str], int] | None = None,
    kept: list[Row] = (),
    done: Callable[[], None] = lambda: None,
    parallel: int = 2,
) -> None:
    """Measure each row (and its next size up where K is in ``next_size``, refined in at
    most ``moves`` more runs: K = 8's prediction can be 19 blocks off), from its depth in
    ``starts`` (by kind and layout: a previous run's answer) where it has one, else from
    its prediction scaled by the error of the last row of its kind measured (the
    prediction errs more the deeper the model: +6 blocks at K = 4, +19 at K = 8), or of the
    deepest row of its kind in ``kept`` (a file's rows, for rows measured alone);
    ``parallel`` runs at a time (``verify_capacity``'s); ``done`` after each row."""
    errors = {r.kind: r.final.depth / r.fit.depth  # kind -> measured depth / predicted
              for r in sorted(kept, key=lambda r: r.fit.layout.stages) if r.exact}  # fmt: skip
    for row in rows:
        if row.fit.layout.shard and row.fit.layout.stages not in sharded:
            continue
        start, load, cpu = time.perf_counter(), os.getloadavg()[0], cpu_seconds()
        bigger = row.fit.layout.stages in next_size
        first, depth = row.fit, (starts or {}).get((row.kind, row.fit.layout.label()))
        if depth is None:
            depth = round(first.depth * errors.get(row.kind, 1.0))
        if depth != first.depth:
            first = fit_of(family, first.layout, depth, budget=first.budget,
                           overhead=first.calibration)  # fmt: skip
        check = verify_capacity(
            family, first, next_size=bigger, refine=bigger, steps=2, moves=moves, parallel=parallel
        )
        row.found, row.bigger, row.check = check.found, check.next_size, check
        row.minutes, row.cpu = (time.perf_counter() - start) / 60, cpu_seconds() - cpu
        row.load, row.commit = (load, os.getloadavg()[0]), _commit()
        if bigger and check.found.fits:
            errors[row.kind] = check.found.fit.depth / row.fit.depth
        each = row.cpu / max(check.launches, 1)
        print(f"  {check.describe()}  ({row.minutes:.1f} min, {row.cpu / 60:.1f} CPU-min, "
              f"{check.launches} launches of {each:.0f} CPU-s)", flush=True)  # fmt: skip
        done()


def cpu_seconds() -> float:
    """CPU-seconds of this process and of every process it waited for (each measured rank):
    what a run costs whatever else the machine runs."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def _commit() -> str:
    """The code measured: this checkout's commit (+ "dirty" with changes not committed)."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True)
        return run.stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" dirty" if git("status", "--porcelain",
                                                                   "src") else "")  # fmt: skip


def sharded_check(budget: float, stages: tuple[int, ...]) -> str:
    """The GPT family's remat and sharded rows at ``stages``, measured and refined; the
    sharded replicas' ratios to one replica, as measured."""
    start = time.perf_counter()
    family = families()["GPT"]
    overhead = calibrate(family, processes=8)
    kinds = ("remat", "2 sharded replicas")
    rows = search(family, budget, overhead, lambda kind, k: kind in kinds and k in stages)
    measure(family, rows, stages, stages)
    lines = [
        f"{family.describe()}, {budget / MiB:.0f} MiB per process (calibrated: {overhead}).",
        "",
        *table(rows),
        "",
    ]
    for k in stages:
        sharded = ratio(rows, "2 sharded replicas", k, "remat", k)
        met = "met" if sharded >= TARGETS["sharded"] else "missed"
        exact = all(r.exact for r in rows if r.fit.layout.stages == k)
        lines.append(
            f"- 2 sharded replicas at K={k} fit **{sharded:.2f}x** one replica with remat, "
            f"measured (target >= {TARGETS['sharded']}): {met}"
            + ("." if exact else "; not refined to an exact depth, so not final.")
        )
    elapsed = time.perf_counter() - start
    lines += ["", f"Benchmark wall time: {elapsed / 60:.1f} min on this machine."]
    return "\n".join(lines)


def rows_alone(
    name: str,
    stages: int,
    mode: str,
    budget: float,
    overhead: Calibration | None,
    starts: dict[tuple[str, str], int] | None = None,
    kept: list[Row] = (),
    parallel: int = 2,
) -> tuple[list[Row], str]:
    """A family's rows of ``stages`` and ``mode`` measured and refined on their own (at K=1
    "no-remat" is both gpipe's schedule and the best plain layout), calibrated unless
    ``overhead`` is given (the tables' calibration: the same predictions to start from);
    each starts from its prediction scaled by the error of ``kept``'s deepest exact row of
    its kind below ``stages``."""
    start = time.perf_counter()
    family = families()[name]
    kind = MODES[mode]
    overhead = overhead or calibrate(family, processes=8)
    rows = search(family, budget, overhead, lambda r, k: r.split(",")[0] == kind and k == stages)
    below = [r for r in kept if r.fit.layout.stages < stages]
    measure(family, rows, (stages,), (stages,), moves=16, starts=starts, kept=below,
            parallel=parallel)  # fmt: skip
    elapsed = time.perf_counter() - start
    return rows, "\n".join([
        f"{name}: {family.describe()}, {budget / MiB:.0f} MiB per process (calibrated: "
        f"{overhead}).",
        "",
        *table(rows),
        "",
        f"Measured by `python benchmarks/capacity.py --rows {name} {stages} {mode}` in "
        f"{elapsed / 60:.1f} min on this machine.",
    ])  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=float, default=512, help="MiB per process, the whole process's peak"
    )
    parser.add_argument("--family", nargs="*", default=None, help="families to run (all)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--plot", type=Path, default=None, help="save the plot here")
    parser.add_argument(
        "--next-size", type=int, nargs="*", default=list(STAGES),
        help="K whose depth + 1 is run, and the depth refined until exact",
    )  # fmt: skip
    parser.add_argument(
        "--measure-sharded", type=int, nargs="*", default=list(SHARDED_STAGES),
        help="K of sharded rows run",
    )  # fmt: skip
    parser.add_argument(
        "--predict-only", nargs="*", default=None, metavar="FAMILY",
        help="no measured runs (of these families; none named: all)",
    )  # fmt: skip
    parser.add_argument(
        "--parallel", type=int, default=2,
        help="measured runs side by side (each K·R processes of up to --budget MiB)",
    )  # fmt: skip
    parser.add_argument("--k1", action="store_true", help="one process against plain PyTorch")
    parser.add_argument("--sharded", action="store_true", help="the sharded rows alone")
    parser.add_argument(
        "--rows", nargs=3, default=None, metavar=("FAMILY", "K", "MODE"),
        help="one family's rows of K stages and MODE (no-remat, remat, sharded) alone, "
        "measured and refined, e.g. --rows ResNet 8 remat",
    )  # fmt: skip
    parser.add_argument(
        "--calibration", type=float, nargs=4, default=None,
        metavar=("BEFORE", "PROCESS", "MODEL_LAYER", "STAGE_LAYER"),
        help="MiB held before the model, per process, per layer of the model and per layer "
        "of its stage (as the doc prints them): skips the calibration's runs",
    )  # fmt: skip
    parser.add_argument(
        "--start-from", type=Path, nargs="+", default=None,
        help="rows kept by --save: a row of the same kind and layout is refined from the "
        "depth measured there, not from its prediction (a rerun: 4 runs where it still holds); "
        "without --calibration, the family's calibration kept there",
    )  # fmt: skip
    parser.add_argument(
        "--save", type=Path, default=None,
        help="keep the measured rows here (JSON), rewritten as each family ends; with "
        "--rows and --load, the loaded rows with the new ones in their place",
    )  # fmt: skip
    parser.add_argument(
        "--load", type=Path, nargs="+", default=None,
        help="write the doc and plot from rows kept by --save, measuring nothing (but "
        "--rows: those rows measured again, with the file's calibration)",
    )  # fmt: skip
    return parser


def starts_of(args: argparse.Namespace, name: str) -> dict[tuple[str, str], int]:
    """``--start-from``'s measured depths of family ``name``, by kind and layout."""
    starts = {}
    for path in args.start_from or []:
        for row in load(path, families()).get(name, (None, [], 0))[1]:
            if row.found is not None and row.found.ran:
                starts[(row.kind, row.fit.layout.label())] = row.final.depth
    return starts


def _calibration(args: argparse.Namespace, name: str) -> Calibration | None:
    """``--calibration``'s, else the family's kept in ``--start-from`` (what its depths were
    predicted with: a rerun needs no calibration's runs), else None (calibrate)."""
    if args.calibration is None:
        return kept_calibration(args.start_from or [], families(), name)
    before, process, model_layer, stage_layer = (v * MiB for v in args.calibration)
    return Calibration(process, model_layer, stage_layer, before)


def main() -> None:
    args = _parser().parse_args()
    torch.set_num_threads(1)
    if args.k1:
        from capacity_k1 import one_process  # a sibling

        return one_process(args.out)
    budget = args.budget * MiB
    if args.sharded:
        text = sharded_check(budget, tuple(args.measure_sharded))
        print(text)
        if args.out:
            write_doc(args.out, text, part="sharded replicas, measured")
        return None
    results: Results = {}
    for kept in args.load or []:
        results.update(load(kept, families()))
    if args.rows:
        if not rows_into(results, args, budget):
            return None
    else:
        for name, family in families().items():
            if not (args.load or (args.family and name not in args.family)):
                results[name] = family_rows(name, family, budget, args, results)
    text = results_doc(results)
    print(text)
    if args.out:
        write_doc(args.out, text)
    if args.plot:
        plot({name: rows for name, (_, rows, _) in results.items()}, args.plot, budget)


def rows_into(results: Results, args: argparse.Namespace, budget: float) -> bool:
    """Measure ``--rows``; with the family ``--load``-ed, with its calibration, in place of
    its rows of that K and mode (then True: the doc is written from the results, and
    ``--save`` keeps them). Else their own section of the doc, and their own file."""
    name, k, mode = args.rows
    stages = SHARDED_STAGES if mode == "sharded" else STAGES
    if name not in families() or mode not in MODES or k not in map(str, stages):
        sys.exit(f"--rows {name} {k} {mode}: give a family ({', '.join(families())}), K "
                 f"({', '.join(map(str, STAGES))}; sharded: {', '.join(map(str, SHARDED_STAGES))})"
                 f" and a mode ({', '.join(MODES)})")  # fmt: skip
    kept = results.get(name)
    overhead = kept[0] if kept else _calibration(args, name)
    rows, text = rows_alone(name, int(k), mode, budget, overhead, starts_of(args, name),
                            kept[1] if kept else [], args.parallel)  # fmt: skip
    print(text)
    if kept is None:
        if args.out:
            write_doc(args.out, text, part=f"{name} rows measured alone")
        if args.save:
            minutes = sum(r.minutes for r in rows)
            save(args.save, {name: (rows[0].fit.calibration, rows, minutes)}, budget)
        return False
    fresh = {(r.kind, r.fit.layout.stages): r for r in rows}
    merged = [fresh.pop((r.kind, r.fit.layout.stages), r) for r in kept[1]]
    results[name] = (kept[0], order(merged + list(fresh.values())), kept[2])
    if args.save:
        save(args.save, results, budget)
    return True


def family_rows(
    name: str, family: Family, budget: float, args: argparse.Namespace, results: Results
) -> tuple[Calibration, list[Row], float]:
    """A family's rows: calibrated, searched and (unless --predict-only) measured; with
    ``--save``, ``results`` with the rows measured so far kept as each row ends (a run
    stopped midway loses only its row)."""
    print(f"{family.describe()}:", flush=True)
    begun, cpu = time.perf_counter(), cpu_seconds()
    overhead = _calibration(args, name) or calibrate(family, processes=8)
    print(f"  calibrated: {overhead}", flush=True)
    rows = search(family, budget, overhead, every)
    print(f"  searched: {(time.perf_counter() - begun) / 60:.1f} min, "
          f"{(cpu_seconds() - cpu) / 60:.1f} CPU-min", flush=True)  # fmt: skip

    def done(end: bool = False) -> None:
        if args.save:
            minutes = (time.perf_counter() - begun) / 60
            kept = rows if end else [r for r in rows if r.found is not None]
            save(args.save, {**results, name: (overhead, kept, minutes)}, budget)

    only = args.predict_only
    if only is None or (only and name not in only):
        measure(family, rows, tuple(args.next_size), tuple(args.measure_sharded),
                starts=starts_of(args, name), done=done, parallel=args.parallel)  # fmt: skip
    done(end=True)
    minutes = (time.perf_counter() - begun) / 60
    print(f"  {name}: {minutes:.1f} min, {(cpu_seconds() - cpu) / 60:.1f} CPU-min", flush=True)
    return overhead, rows, minutes


def results_doc(results: Results) -> str:
    doc = []
    for name, (overhead, rows, _) in results.items():
        doc += [
            f"### {name}: {families()[name].describe()}",
            "",
            f"Beyond the model's terms (calibrated): {overhead}.",
            "",
            *table(rows),
            "",
            "Predicted peak of the fullest process by term (MiB):",
            "",
            *terms_table(rows),
            "",
            "Each row's measured parameters against the K=1 layouts':",
            "",
            *ratios(rows),
            "",
            "Targets:",
            "",
            *targets(rows),
            "",
            "Side by side with GPipe's Table 1:",
            "",
            *paper(rows),
            "",
        ]
    minutes = ", ".join(f"{name} {m:.1f} min" for name, (_, _, m) in results.items())
    doc.append(f"Benchmark wall time: {minutes} on this machine (the family's last whole run, "
               "or the sum of its rows' where they were measured alone; at the load of the "
               "day: the rows' CPU-minutes below do not depend on it).")  # fmt: skip
    for name, (_, rows, _) in results.items():
        each = "; ".join(f"K={r.fit.layout.stages} {r.kind} {r.minutes:.1f}" + (
            f" ({r.cpu / 60:.1f} CPU" + (f", {r.launches} launches" if r.launches else "") + ")"
            if r.cpu else "") for r in rows if r.minutes)  # fmt: skip
        if each:
            doc += ["", f"{name}, minutes per row (measured, refined, repeated; CPU-minutes, "
                    f"every process's, and measured runs, where kept): {each}."]  # fmt: skip
    return "\n".join(doc)


if __name__ == "__main__":
    main()
