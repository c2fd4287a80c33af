"""Capacity: the largest model of a family that trains within a memory budget per process.

GPipe's Table 1 asks how large a model K devices can train: with re-materialization the
answer grows about linearly with K. :func:`capacity` answers it for a *family* of models
that differ only in depth (``gpipe.planner.families``), a budget of bytes per process, a
number of processes and an optimizer:

1. profile one small member of the family once per micro-batch size, and extrapolate it
   to any depth (``gpipe.planner.families.extrapolate``);
2. for every layout (``gpipe.layout``: K stages, R replicas with K·R ≤ processes, sharded
   or not, M micro-batches, schedule, re-materialization: of a whole stage at once, or a
   few layers at a time, ``checkpoint_layers``) find the largest depth whose
   every stage fits the budget under the memory model (``gpipe.estimate.memory_model``)
   plus what a process needs beyond it (``Calibration``), by galloping from the depth of
   the last layout of the same K and R searched, then bisection (a deeper member never
   needs less memory, so any bracket finds the same depth);
3. cut the largest fitting depth with the memory balance
   (``gpipe.estimate.cuts.lightest_cut``: the partition with the most room in its
   fullest stage).

Layouts are ranked by parameters, then by fewer processes, no sharding, less
recomputation, fewer micro-batches. The mini-batch is global: each of R replicas trains on
``batch / R`` samples, in M micro-batches. Interleaved stages (v > 1) are not searched.
The answer is a :class:`~gpipe.planner.results.Capacity` (rows of
:class:`~gpipe.planner.results.Fit`).

Example::

    family = gpt_family(d_model=256, heads=4, seq=128, vocab=8192, batch=16)
    result = capacity(family, memory_budget=2 * 2**30, processes=8)
    print(result.table())
    result.best.layout, result.best.depth, result.best.parameters

:func:`gpipe.planner.verify_capacity` verifies a row by training it for real.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import cache, lru_cache
from typing import Any

from gpipe.base import remat
from gpipe.estimate.cuts import cut_within, lightest_cut
from gpipe.estimate.memory_model import (
    Calibration,
    MemoryModel,
    StageMemoryTable,
    held_microbatches,
)
from gpipe.layout import Layout, check_choices, layouts
from gpipe.planner.families import Family, FamilyCosts, smallest_depth
from gpipe.planner.results import Capacity, Fit, cheaper_first
from gpipe.schedule import SCHEDULES

__all__ = [
    "CHECKPOINT_LAYERS",
    "OPTIMIZER_STATE",
    "capacity",
    "capacity_layouts",
    "fit_of",
    "optimizer_state_of",
]

# Layers recomputed at a time searched by default (None: a whole stage at once).
CHECKPOINT_LAYERS = (None, 1, 2, 4)

# Optimizer state per parameter, in multiples of its bytes.
OPTIMIZER_STATE = {"adamw": 2.0, "adam": 2.0, "sgd": 0.0, "sgd-momentum": 1.0}


def _choices(values: Iterable[Any] | None, default: list[Any], label: str) -> list:
    # the names are Layout's to check (gpipe.layout.check_choices)
    return list(dict.fromkeys(values)) if values is not None else default


def optimizer_state_of(optimizer: str | float) -> float:
    """Optimizer state per parameter in multiples of its bytes, from a name or a number."""
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZER_STATE:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATE)} "
                "or a number (state bytes per parameter byte)"
            )
        return OPTIMIZER_STATE[optimizer.lower()]
    if not (isinstance(optimizer, int | float) and optimizer >= 0):
        raise ValueError(f"optimizer state must be a non-negative number, got {optimizer!r}")
    return float(optimizer)


def capacity_layouts(
    family: Family,
    processes: int,
    *,
    stages: Iterable[int] | None = None,
    replicas: Iterable[int] | None = None,
    shard: Iterable[str | None] | None = None,
    chunks: Iterable[int] | None = None,
    schedules: Iterable[str] | None = None,
    checkpoints: Iterable[str] | None = None,
    checkpoint_layers: Iterable[int | None] | None = None,
) -> list[Layout]:
    """Every layout to search (``gpipe.layout.layouts``; defaults: K·R ≤ processes, sharded
    and not, M = powers of two up to 32 that split each replica's batch evenly, as the memory
    model assumes, every schedule of one stage per rank, every re-materialization mode,
    recomputed whole or :data:`CHECKPOINT_LAYERS` layers at a time)."""
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive int, got {processes!r}")
    one_per_rank = [n for n, spec in SCHEDULES.items() if 1 in spec.virtual_stages]
    searched = [n for n in one_per_rank if not SCHEDULES[n].takes_costs]
    schedule_list = _choices(schedules, searched, "schedules")
    check_choices(schedules=schedule_list)
    several = [s for s in schedule_list if s not in one_per_rank]
    if several:
        raise ValueError(
            f"the capacity search places one stage per rank: drop {', '.join(several)}"
        )
    found = layouts(
        stages=_choices(stages, list(range(1, processes + 1)), "stages"),
        replicas=_choices(replicas, list(range(1, processes + 1)), "replicas"),
        shard=_choices(shard, [None, "all"], "shard"),
        chunks=_choices(chunks, [1, 2, 4, 8, 16, 32], "chunks"),
        schedules=schedule_list,
        checkpoints=_choices(checkpoints, list(remat.REMAT_MODES), "checkpoints"),
        checkpoint_layers=_choices(checkpoint_layers, list(CHECKPOINT_LAYERS), "layers"),
        virtual_stages=[1],
        processes=processes,
        batch=family.batch_size,
    )
    return [x for x in found if (family.batch_size // x.replicas) % x.chunks == 0]


def capacity(
    family: Family,
    *,
    memory_budget: float,
    processes: int,
    optimizer: str | float = "adamw",
    overhead: float | Calibration = 0.0,
    stages: Iterable[int] | None = None,
    replicas: Iterable[int] | None = None,
    shard: Iterable[str | None] | None = None,
    chunks: Iterable[int] | None = None,
    schedules: Iterable[str] | None = None,
    checkpoints: Iterable[str] | None = None,
    checkpoint_layers: Iterable[int | None] | None = None,
    max_depth: int = 10_000,
) -> Capacity:
    """The largest member of ``family`` each layout trains in ``memory_budget`` bytes per
    process (see the module docstring); rows sorted largest first.

    ``optimizer``: ``"adamw"`` (2 states per parameter), ``"sgd"`` (0), ``"sgd-momentum"``
    (1), or the number. ``overhead``: bytes a training process needs beyond the memory
    model, or the :class:`Calibration` that ``gpipe.planner.calibrate`` measures (a
    constant per process and bytes per layer held). The other arguments restrict the
    layouts (:func:`layouts`). When nothing fits, ``result.best`` raises
    :class:`NothingFits` with the closest layout's shortfall and what would fit.
    """
    if not memory_budget > 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    calibration = _calibration(overhead)
    state = optimizer_state_of(optimizer)
    costs = costs_of(family)
    candidates = capacity_layouts(
        family,
        processes,
        stages=stages,
        replicas=replicas,
        shard=shard,
        chunks=chunks,
        schedules=schedules,
        checkpoints=checkpoints,
        checkpoint_layers=checkpoint_layers,
    )
    rows, found = [], {}  # found: the last depth of each (K, R), where the next starts
    for layout in candidates:
        key = (layout.stages, layout.replicas)
        row = _largest(costs, layout, memory_budget, calibration, state, max_depth,
                       guess=found.get(key))  # fmt: skip
        rows.append(row)
        if row.fits:
            found[key] = row.depth
    rows.sort(key=lambda r: (not r.fits, -r.parameters if r.fits else max(r.missing),
                             cheaper_first(r.layout)))  # fmt: skip
    result = Capacity(family, float(memory_budget), processes, state, calibration, rows)
    if rows and not rows[0].fits:
        result.advice = _advice(costs, rows, memory_budget, calibration, state, max_depth)
    return result


def _memory_model(layout: Layout, state: float, per_stage_layer: float) -> MemoryModel:
    return MemoryModel(
        optimizer_state=state,
        replicas=layout.replicas,
        shard=layout.shard is not None,
        whole_gradients=layout.shard == "params",
        workspace=True,
        layer_overhead=per_stage_layer,
    )


class _LayoutCosts:
    """The memory table of a layout at any depth."""

    def __init__(
        self, costs: FamilyCosts, layout: Layout, state: float, per_stage_layer: float = 0.0
    ) -> None:
        self.costs, self.layout = costs, layout
        schedule = layout.build_schedule()
        self.held = held_microbatches(schedule, layout.checkpoint)
        self.split = schedule.splits_backward(0, 0)
        self.model = _memory_model(layout, state, per_stage_layer)
        self.samples = costs.family.batch_size // layout.replicas // layout.chunks

    def table(self, depth: int) -> StageMemoryTable:
        prof = self.costs.at(depth, self.samples)
        return StageMemoryTable(
            prof.layers, self.held, self.model, splits_backward=self.split,
            checkpoint_layers=self.layout.checkpoint_layers,
        )  # fmt: skip


class _Remembered:
    """A memory table's ``total`` and ``weights``, each stage computed once: the lightest
    cut's bisection asks for the same stages bound after bound (the same floats as the
    table's: the cut found is the same)."""

    def __init__(self, table: StageMemoryTable) -> None:
        self.total, self.weights = cache(table.total), cache(table.weights)


def _largest(
    costs: FamilyCosts,
    layout: Layout,
    budget: float,
    calibration: Calibration,
    state: float,
    cap: int,
    guess: int | None = None,
) -> Fit:
    """The largest depth of ``layout`` that fits (:func:`deepest`, from ``guess``: a
    neighbouring layout's answer is usually a few blocks off)."""
    at = _LayoutCosts(costs, layout, state, calibration.per_stage_layer)

    def fits(depth: int) -> bool:
        table = at.table(depth)
        n = len(table.layers)
        room = budget - calibration.at(n)
        return room > 0 and cut_within(table, n, layout.stages, room) is not None

    low = smallest_depth(costs.family, layout.stages)
    if not fits(low):
        return _fit(at, low, budget, calibration)
    return _fit(at, deepest(fits, low, cap, guess), budget, calibration)


def deepest(fits: Callable[[int], bool], low: int, cap: int, guess: int | None = None) -> int:
    """The largest depth in ``low..cap`` with ``fits`` (true at ``low``, and false at every
    depth above one where it is false: a deeper member never needs less): galloping from
    ``guess`` (1, 2, 4, ... blocks up while it fits, or down while it does not) to a
    bracket, then bisecting it. A guess k blocks off costs about 2·log2(k) + 2 calls; none
    (or ``low``) gallops from ``low``."""
    start = low if guess is None else min(max(guess, low), cap)
    if start == low or fits(start):
        high, step = start, 1  # the largest depth known to fit
        top = cap + 1  # the smallest depth known not to fit (or past the cap)
        while high + step <= cap:
            if not fits(high + step):
                top = high + step
                break
            high, step = high + step, step * 2
        else:
            if high < cap and not fits(cap):
                top = cap
            elif high < cap:
                high = cap
    else:
        top, step = start, 1
        while top - step > low and not fits(top - step):
            top, step = top - step, step * 2
        high = max(top - step, low)
    while top - high > 1:
        middle = (high + top) // 2
        if fits(middle):
            high = middle
        else:
            top = middle
    return high


@lru_cache(maxsize=8)
def costs_of(family: Family) -> FamilyCosts:
    """The family's profiles, measured once per family and micro-batch size: a search, its
    verification and a results file's rows ask for members of one family over and over
    (each new :class:`FamilyCosts` profiled its small member again, seconds a call)."""
    return FamilyCosts(family)


def fit_of(
    family: Family,
    layout: Layout,
    depth: int,
    *,
    optimizer: str | float = "adamw",
    budget: float,
    overhead: float | Calibration = 0.0,
    balance: Sequence[int] | None = None,
) -> Fit:
    """``layout`` at ``depth``: its memory balance (or the given ``balance``) and predicted
    memory, whether it fits or not (then ``missing`` says by how much each stage does not)."""
    calibration = _calibration(overhead)
    at = _LayoutCosts(costs_of(family), layout, optimizer_state_of(optimizer),
                      calibration.per_stage_layer)  # fmt: skip
    return _fit(at, depth, budget, calibration, balance)


def _calibration(overhead: float | Calibration) -> Calibration:
    if isinstance(overhead, Calibration):
        return overhead
    if not (isinstance(overhead, int | float) and overhead >= 0):
        raise ValueError(f"overhead must be a non-negative number of bytes, got {overhead!r}")
    return Calibration(float(overhead))


def _fit(
    at: _LayoutCosts,
    depth: int,
    budget: float,
    calibration: Calibration,
    balance: Sequence[int] | None = None,
) -> Fit:
    """The lightest cut of ``depth``: the most room in its fullest stage, or, when it does
    not fit, the least missing there."""
    table = at.table(depth)
    overhead = calibration.at(len(table.layers))
    if balance is None:
        balance = lightest_cut(_Remembered(table), len(table.layers), at.layout.stages)
    elif sum(balance) != len(table.layers) or len(balance) != at.layout.stages:
        raise ValueError(
            f"balance {list(balance)} does not cut depth {depth} ({len(table.layers)} layers) "
            f"into {at.layout.stages} stages"
        )
    memory, start = [], 0
    for s, size in enumerate(balance):
        memory.append(table(s, start, start + size))
        start += size
    missing = tuple(max(0.0, m.total + overhead - budget) for m in memory)
    return Fit(
        at.layout,
        depth,
        at.costs.parameters(depth),
        tuple(balance),
        tuple(memory),
        overhead,
        budget,
        fits=not any(missing),
        missing=missing,
        calibration=calibration,
    )


def _advice(costs, rows, budget, calibration, state, cap) -> str:
    """What would fit when nothing does: more stages (up to 8× the most searched)."""
    searched = max(r.layout.stages for r in rows)
    closest = min(rows, key=lambda r: max(r.missing)).layout
    for k in range(searched + 1, 8 * searched + 1):
        layout = replace(
            closest, stages=k, replicas=1, shard=None, checkpoint="always", checkpoint_layers=1
        )
        row = _largest(costs, layout, budget, calibration, state, cap)
        if row.fits:
            return (
                f"or K >= {k} stages ({layout.label()} trains depth {row.depth}, "
                f"{row.parameters:,} parameters)"
            )
    return f"no layout of up to {8 * searched} stages fits: a single layer is too large"
