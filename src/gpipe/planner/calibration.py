"""What a training process needs beyond the memory model's terms, measured on this machine
(:func:`calibrate`): the baseline it holds before its model, a constant, and a cost per
layer of its stage and per layer of the whole model (``Calibration``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from gpipe.base._utils import MiB
from gpipe.estimate.memory_model import Calibration
from gpipe.layout import Layout
from gpipe.planner.capacity import fit_of
from gpipe.planner.families import Family
from gpipe.planner.measured import Measured, measure_fit

__all__ = ["calibrate"]


def calibrate(
    family: Family,
    *,
    processes: int = 1,
    layers: int = 64,
    optimizer: str | float = "adamw",
    steps: int = 2,
    timeout: float = 300.0,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """What a training process needs beyond the memory model's terms, measured in
    micro-batches of one sample with re-materialization (where the terms are smallest, so
    the excess shows most): what it holds before its model, a constant, a cost per layer
    of its stage and one per layer of the whole model.

    On one process (every layer local) at the shallowest member and the first with
    ``layers`` layers, the slope is the sum of the two per-layer costs. On a pipeline of
    ``processes`` stages (as many processes as the rows will use: each peer costs
    connection buffers) at the shallowest member and the first with 4 × ``layers``
    layers, whose last stage holds the last layer alone, that stage's slope is the cost
    per layer of the whole model: its own layers do not change. The baseline is the most
    any process held before its model was built; the constant is the largest excess of a
    stage's whole-process peak over its terms and the baseline, less its layers' share.
    With one process the whole slope is charged to the stage's layers. ``progress``, if
    given, is called with a line before and after each of the (2 or 4) runs.
    """
    runs = _runs(family, processes, layers)
    rows = []
    say = progress or (lambda line: None)
    for i, (layout, depth, balance) in enumerate(runs, 1):
        row = fit_of(family, layout, depth, optimizer=optimizer, budget=float("inf"),
                     balance=balance)  # fmt: skip
        say(f"calibrating {i}/{len(runs)}: {layout.label()} at depth {depth} ...")
        start = time.perf_counter()
        rows.append(measure_fit(family, row, optimizer=optimizer, steps=steps, timeout=timeout))
        say(f"calibrating {i}/{len(runs)}: peak {max(rows[-1].per_stage) / MiB:.1f} MiB "
            f"in {time.perf_counter() - start:.0f} s")  # fmt: skip
    return _fitted(family, rows, processes)


def _first_depth(family: Family, n: int) -> int:
    """The shallowest member with at least ``n`` layers."""
    depth = 1
    while len(family.kinds(depth)) < n:
        depth += 1
    return depth


def _runs(family: Family, processes: int, layers: int) -> list[tuple[Layout, int, list | None]]:
    """The calibration's runs: (layout, depth, balance or None for the even one)."""
    one = Layout(stages=1, chunks=family.batch_size, checkpoint="always")
    runs = [(one, _first_depth(family, 1), None), (one, _first_depth(family, layers), None)]
    if processes > 1:
        pipeline = Layout(stages=processes, chunks=family.batch_size, checkpoint="always")
        # a long lever: the cost per layer of the whole model is small against the scatter
        for depth in (_first_depth(family, processes), _first_depth(family, 4 * layers)):
            n, k = len(family.kinds(depth)), processes
            rest = [(n - 1) // (k - 1) + (s < (n - 1) % (k - 1)) for s in range(k - 1)]
            runs.append((pipeline, depth, [*rest, 1]))  # the last layer alone
    return runs


def _fitted(family: Family, rows: list[Measured], processes: int) -> Calibration:
    """The four terms from the runs' peaks (see :func:`calibrate`)."""
    baseline = max(b for measured in rows for b in measured.before)
    stages = []  # per run: (model layers, [(excess, stage layers) per stage])
    for measured in rows:
        row = measured.fit
        excess = [
            m - p.total - baseline for m, p in zip(measured.per_stage, row.memory, strict=True)
        ]
        stages.append((len(family.kinds(row.depth)), list(zip(excess, row.balance, strict=True))))
    (n0, ((e0, _),)), (n1, ((e1, _),)) = stages[0], stages[1]
    both = max(0.0, (e1 - e0) / (n1 - n0))  # per layer that is both local and the model's
    whole = 0.0
    if processes > 1 and stages[3][0] > stages[2][0]:
        (n2, last2), (n3, last3) = stages[2], stages[3]
        whole = min(max(0.0, (last3[-1][0] - last2[-1][0]) / (n3 - n2)), both)
    local = both - whole
    process = max(e - local * l - whole * n for n, per_stage in stages for e, l in per_stage)
    return Calibration(max(0.0, process), whole, local, baseline)
