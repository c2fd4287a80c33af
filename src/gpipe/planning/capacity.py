"""Capacity: the largest model of a family that trains within a memory budget per process.

GPipe's Table 1 asks how large a model K devices can train: with re-materialization the
answer grows about linearly with K. :func:`capacity` answers it for a *family* of models
that differ only in depth (the GPT of ``gpipe.models`` by ``n_layers``, the ResNet by
``blocks``), a budget of bytes per process, a number of processes and an optimizer:

1. profile one small member of the family (``gpipe.planning.profile``) once per
   micro-batch size, and extrapolate it to any depth: the blocks are identical, so a
   deeper model's profile is the small one's with its blocks repeated (embedding, head,
   stem, classifier stay as they are);
2. for every layout — K stages, R replicas (K·R ≤ processes, sharded or not), M
   micro-batches, schedule, re-materialization — find the largest depth whose every
   stage fits the budget under the memory model (``gpipe.planning.memory_model``) plus a
   fixed cost per process, by bisection (a deeper member never needs less memory);
3. cut the largest fitting depth with the memory balance (``balance_profile(by="size")``:
   the partition with the most room in its fullest stage).

Layouts are ranked by parameters, then by fewer processes, no sharding, less
recomputation, fewer micro-batches. The mini-batch is global: each of R replicas trains on
``batch / R`` samples, in M micro-batches. Interleaved stages (v > 1) are not searched.

Example::

    family = gpt_family(d_model=256, heads=4, seq=128, vocab=8192, batch=16)
    result = capacity(family, memory_budget=2 * 2**30, processes=8)
    print(result.table())
    result.best.layout, result.best.depth, result.best.parameters

:mod:`gpipe.planner` verifies a row by training it for real (``verify_capacity``).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from gpipe import remat
from gpipe._utils import MiB
from gpipe.layout import Layout, layouts
from gpipe.planning.memory_model import (
    MemoryModel,
    StageMemory,
    StageMemoryTable,
    held_microbatches,
)
from gpipe.planning.profile import Profile, profile
from gpipe.schedule import SCHEDULES

__all__ = [
    "OPTIMIZER_STATE",
    "Calibration",
    "Capacity",
    "Family",
    "Fit",
    "NothingFits",
    "capacity",
    "capacity_layouts",
    "cheaper_first",
    "cut_within",
    "extrapolate",
    "fit_of",
    "gpt_family",
    "lightest_cut",
    "optimizer_state_of",
    "resnet_family",
]

# Optimizer state per parameter, in multiples of its bytes.
OPTIMIZER_STATE = {"adamw": 2.0, "adam": 2.0, "sgd": 0.0, "sgd-momentum": 1.0}
RECOMPUTATION = {"never": 0, "except_last": 1, "always": 2}  # ranks ties: less is better
# A process's predicted peak by term: the memory model's, and the process's own overhead.
TERMS = ("parameters", "gradients", "optimizer", "buffers", "inputs", "activations",
         "workspace", "gathered", "reduction", "layers", "model layers", "process")  # fmt: skip


@dataclass(frozen=True)
class Calibration:
    """What a training process needs beyond the memory model's terms, measured
    (``gpipe.planner.calibrate``): a constant per process, bytes per layer of the *whole*
    model (every process records the whole model on ``meta`` to build its own layers, and
    what that leaves in Python's allocator stays resident), and bytes per layer of its
    own stage (``MemoryModel(layer_overhead=...)``)."""

    process: float = 0.0
    per_layer: float = 0.0  # per layer of the whole model
    per_stage_layer: float = 0.0  # per layer of the process's stage

    def at(self, layers: int) -> float:
        """Bytes per process for a model of ``layers`` layers."""
        return self.process + self.per_layer * layers

    def __post_init__(self) -> None:
        if not (self.process >= 0 and self.per_layer >= 0 and self.per_stage_layer >= 0):
            raise ValueError(f"calibration must be non-negative bytes, got {self}")

    def __str__(self) -> str:
        return (
            f"{self.process / MiB:.1f} MiB per process + {self.per_layer / MiB:.2f} MiB per "
            f"layer of the model + {self.per_stage_layer / MiB:.2f} MiB per layer of its stage"
        )


# -- families --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """Models that differ only in depth: identical blocks between fixed layers.

    ``build(depth)`` makes the model; ``kinds(depth)`` names each of its layers' kind
    (layers of one kind are identical, e.g. ``["embedding", "block", "block", "head"]``);
    ``batch(n)`` gives ``n`` samples of (inputs, targets); ``loss_fn(output, target)``
    the loss. Everything is picklable (module-level functions and partials), so that
    :func:`gpipe.planner.verify_capacity` can send it to new processes.
    """

    name: str
    build: Callable[[int], nn.Sequential]
    kinds: Callable[[int], list[str]]
    batch: Callable[[int], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batch_size: int  # samples per mini-batch, over all replicas
    profile_depth: int = 2  # the member profiled

    def describe(self, depth: int | None = None) -> str:
        at = "" if depth is None else f", depth {depth}"
        return f"{self.name}{at}, batch {self.batch_size}"


def _gpt_model(depth: int, *, d_model: int, heads: int, seq: int, vocab: int) -> nn.Sequential:
    from gpipe.models import GPTConfig, gpt

    # no dropout: its masks are memory the budget should not depend on a rate for
    config = GPTConfig(vocab, seq, d_model, heads, depth, dropout=0.0)
    return gpt(config)


def _gpt_kinds(depth: int) -> list[str]:
    return ["embedding", *["block"] * depth, "head"]


def _tokens(n: int, *, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, seq + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def gpt_family(*, d_model: int, heads: int, seq: int, vocab: int, batch: int) -> Family:
    """The GPT of ``gpipe.models`` by ``n_layers``, at a fixed width, context and vocabulary."""
    from gpipe.models import lm_loss

    return Family(
        name=f"GPT d_model {d_model}, {heads} heads, seq {seq}, vocab {vocab}",
        build=functools.partial(_gpt_model, d_model=d_model, heads=heads, seq=seq, vocab=vocab),
        kinds=_gpt_kinds,
        batch=functools.partial(_tokens, seq=seq, vocab=vocab),
        loss_fn=lm_loss,
        batch_size=batch,
    )


def _resnet_model(depth: int, *, channels: int, classes: int) -> nn.Sequential:
    from gpipe.models import resnet

    return resnet(widths=(channels, 2 * channels, 4 * channels), blocks=depth, classes=classes)


def _resnet_kinds(depth: int) -> list[str]:
    kinds = ["stem"]
    for level in range(3):
        if level:
            kinds.append(f"down{level}")
        kinds += [f"residual{level}"] * depth
    return [*kinds, "pool", "flatten", "classifier"]


def _images(n: int, *, image: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, image, image, generator=generator)
    return x, torch.randint(0, classes, (n,), generator=generator)


def resnet_family(*, channels: int, image: int, batch: int, classes: int = 10) -> Family:
    """The ResNet of ``gpipe.models`` by ``blocks`` (per resolution: depth d has 3·d blocks)."""
    from torch.nn import functional as F

    return Family(
        name=f"ResNet widths {channels}/{2 * channels}/{4 * channels}, {image}px",
        build=functools.partial(_resnet_model, channels=channels, classes=classes),
        kinds=_resnet_kinds,
        batch=functools.partial(_images, image=image, classes=classes),
        loss_fn=F.cross_entropy,
        batch_size=batch,
    )


# -- extrapolated profiles -------------------------------------------------------------------


def extrapolate(prof: Profile, kinds: Sequence[str], target: Sequence[str]) -> Profile:
    """The profile of a member whose layers have kinds ``target``, from the profile of one
    whose layers have kinds ``kinds``: each layer takes the measured costs of a layer of
    its kind (layers of a kind are identical, so any will do)."""
    if len(kinds) != len(prof.layers):
        raise ValueError(f"{len(kinds)} kinds for a profile of {len(prof.layers)} layers")
    of_kind = {kind: layer for kind, layer in zip(kinds, prof.layers, strict=True)}
    missing = sorted(set(target) - set(of_kind))
    if missing:
        raise ValueError(f"the profiled model has no layer of kind {missing}: profile a deeper one")
    layers = []
    for index, kind in enumerate(target):
        layer = of_kind[kind]
        layers.append(replace(layer, name=f"{index} {layer.name.partition(' ')[2]}"))
    return Profile(tuple(layers), prof.batch_size, prof.device)


@dataclass
class _FamilyCosts:
    """A family's profiles by micro-batch size (measured once each) and parameter counts."""

    family: Family
    profiles: dict[int, Profile] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # parameters per layer, by kind

    def profile(self, samples: int) -> Profile:
        if samples not in self.profiles:
            torch.manual_seed(0)
            model = self.family.build(self.family.profile_depth)
            kinds = self.family.kinds(self.family.profile_depth)
            for kind, layer in zip(kinds, model, strict=True):
                self.counts[kind] = sum(p.numel() for p in layer.parameters())
            x, y = self.family.batch(samples)
            self.profiles[samples] = profile(
                model, x, "cpu", target=y, loss_fn=self.family.loss_fn, repeats=1, warmup=0
            )
        return self.profiles[samples]

    def at(self, depth: int, samples: int) -> Profile:
        small = self.profile(samples)
        family = self.family
        return extrapolate(small, family.kinds(family.profile_depth), family.kinds(depth))

    def parameters(self, depth: int) -> int:
        return sum(self.counts[kind] for kind in self.family.kinds(depth))


# -- layouts and their rows -------------------------------------------------------------------


def cheaper_first(layout: Layout) -> tuple:
    """Ties of capacity go to the cheaper layout: fewer processes, no sharding, less
    recomputation, fewer micro-batches."""
    return (
        layout.processes,
        layout.shard,
        RECOMPUTATION[layout.checkpoint],
        layout.chunks,
        layout.schedule_name,
        layout.replicas,
    )


@dataclass(frozen=True)
class Fit:
    """A member of the family in a layout: the largest that fits, in a capacity row.

    ``memory`` is the predicted peak of each stage's processes without ``overhead`` (what
    a training process needs beyond the model's terms: ``calibration.at(layers)``);
    ``peak`` adds it. When it does not fit (``fits``
    false; in a capacity row: not even the smallest member), ``balance`` and ``memory``
    are those of the partition that misses the budget by the least, ``missing`` what each
    of its stages lacks.
    """

    layout: Layout
    depth: int
    parameters: int
    balance: tuple[int, ...]
    memory: tuple[StageMemory, ...] = field(repr=False)
    overhead: float
    budget: float
    fits: bool = True
    missing: tuple[float, ...] = ()
    calibration: Calibration = Calibration()

    @property
    def peaks(self) -> tuple[float, ...]:
        return tuple(m.total + self.overhead for m in self.memory)

    @property
    def peak(self) -> float:
        return max(self.peaks)

    @property
    def fullest(self) -> int:
        """The stage whose processes need the most."""
        return max(range(len(self.memory)), key=lambda s: self.memory[s].total)

    def terms(self, stage: int | None = None) -> dict[str, float]:
        """The predicted peak of a stage's process by term (default: the fullest stage)."""
        memory = self.memory[self.fullest if stage is None else stage]
        layers = self.overhead - self.calibration.process
        return {**memory.terms(), "model layers": layers, "process": self.calibration.process}


class NothingFits(ValueError):
    """No layout trains even the smallest member; the message says why and what would."""


@dataclass
class Capacity:
    """The capacity search's answer: one :class:`Fit` per layout, the largest first."""

    family: Family
    budget: float  # bytes per process
    processes: int
    optimizer_state: float
    calibration: Calibration  # what a process needs beyond the memory model's terms
    rows: list[Fit]
    advice: str = ""  # what would fit, when nothing does

    @property
    def best(self) -> Fit:
        if not self.rows or not self.rows[0].fits:
            raise NothingFits(self.explain())
        return self.rows[0]

    def best_of(self, **layout: Any) -> Fit:
        """The largest row whose layout has the given fields, e.g. ``best_of(stages=4)``."""
        for row in self.rows:
            if all(getattr(row.layout, k) == v for k, v in layout.items()):
                return row
        raise KeyError(f"no row with {layout}")

    def table(self, top: int | None = 12) -> str:
        """Rows as text: layout, depth, parameters, balance and the fullest process's terms."""
        lines = [
            f"capacity of {self.family.describe()}: budget {self.budget / MiB:,.1f} MiB per "
            f"process, {self.processes} processes, optimizer state {self.optimizer_state:g}x "
            f"parameters; beyond the model {self.calibration}",
            "",
            f"{'layout':<36}{'depth':>6} {'parameters':>12} {'peak MiB':>9}  {'balance':<22}"
            "fullest process (MiB): " + " + ".join(TERMS),
        ]
        shown = self.rows if top is None else self.rows[:top]
        for row in shown:
            lines.append(_row(row))
        if len(self.rows) > len(shown):
            lines.append(f"... {len(self.rows) - len(shown)} more layouts")
        if not self.rows or not self.rows[0].fits:
            lines += ["", self.explain()]
        return "\n".join(lines)

    def explain(self) -> str:
        """Why nothing fits: the closest layout's stage, its largest term, the shortfall,
        and what would fit."""
        if self.rows and self.rows[0].fits:
            return f"the largest fit is {_row(self.rows[0]).strip()}"
        if not self.rows:
            return "no layout was searched: widen stages, replicas, chunks or schedules"
        closest = min(self.rows, key=lambda r: (max(r.missing), cheaper_first(r.layout)))
        stage = max(range(len(closest.missing)), key=closest.missing.__getitem__)
        terms = closest.terms(stage)
        # the process's own overhead is fixed: name the largest term the layout can change
        fixed = ("process", "model layers")
        term = max((k for k in terms if k not in fixed), key=terms.__getitem__)
        over = closest.missing[stage]
        return (
            f"nothing fits {self.budget / MiB:.1f} MiB per process: even depth {closest.depth} of "
            f"{self.family.name} does not. Closest: {closest.layout.label()}, balance "
            f"{list(closest.balance)}; stage {stage} needs "
            f"{(closest.memory[stage].total + closest.overhead) / MiB:.1f} MiB, "
            f"{over / MiB:.1f} MiB over, its largest term {term} "
            f"({terms[term] / MiB:.1f} MiB; "
            + ", ".join(f"{k} {v / MiB:.1f}" for k, v in terms.items() if v)
            + f").\nTo fit: a budget of {(self.budget + over) / MiB:.1f} MiB"
            + (f"; {self.advice}" if self.advice else "")
        )


def _row(row: Fit) -> str:
    balance = str(list(row.balance))
    if len(balance) > 21:
        balance = balance[:18] + "..."
    terms = " + ".join(f"{v / MiB:.1f}" for v in row.terms().values())
    depth = str(row.depth) if row.fits else "-"
    params = f"{row.parameters:,}" if row.fits else "-"
    return (
        f"{row.layout.label():<36}{depth:>6} {params:>12} {row.peak / MiB:>9.1f}  "
        f"{balance:<22}{terms}"
    )


# -- the search --------------------------------------------------------------------------------


def _smallest_depth(family: Family, stages: int) -> int:
    """The shallowest member with a layer for each of ``stages`` stages."""
    depth = 1
    while len(family.kinds(depth)) < stages:
        depth += 1
    return depth


def cut_within(table: StageMemoryTable, n: int, stages: int, bound: float) -> list[int] | None:
    """A cut of ``n`` layers into ``stages`` stages whose every stage needs at most ``bound``
    bytes (``table.total``), or None if there is none. Exact, in about O(stages · n):

    stage s may end at layer j if it can start at a layer i where stage s - 1 ended with
    ``table.weights(i, j) <= bound`` — the weights never shrink as a stage grows, so the
    smallest such i only moves right as j does — and ``table.total(s, i, j) <= bound``,
    tried from the latest such end down.
    """
    ends = [0]  # where the stages so far can end, ascending
    came_from: list[dict[int, int]] = []  # per stage: end -> start
    for s in range(stages):
        last = s == stages - 1
        reach, starts, lo = [], {}, 0
        for j in [n] if last else range(s + 1, n - (stages - s - 1) + 1):
            while lo < j and table.weights(lo, j) > bound:
                lo += 1
            if lo > ends[-1]:  # too heavy to start after any end: so is every later j
                break
            k = bisect.bisect_right(ends, j - 1) - 1
            while k >= 0 and ends[k] >= lo:
                if table.total(s, ends[k], j) <= bound:
                    reach.append(j)
                    starts[j] = ends[k]
                    break
                k -= 1
        if not reach:
            return None
        ends = reach
        came_from.append(starts)
    balance, j = [], n
    for s in range(stages - 1, -1, -1):
        i = came_from[s][j]
        balance.append(j - i)
        j = i
    return balance[::-1]


def lightest_cut(table: StageMemoryTable, n: int, stages: int) -> list[int]:
    """The cut whose fullest stage needs the least (to a relative 1e-6), by bisection on
    :func:`cut_within`'s bound."""
    even = [n // stages + (s < n % stages) for s in range(stages)]
    high, start = 0.0, 0
    for s, size in enumerate(even):
        high = max(high, table.total(s, start, start + size))
        start += size
    best, low = even, 0.0
    while high - low > 1e-6 * high:
        middle = (low + high) / 2
        balance = cut_within(table, n, stages, middle)
        if balance is None:
            low = middle
        else:
            best, high = balance, middle
    return best


def _choices(values: Iterable[Any] | None, default: list[Any], label: str, allowed=None) -> list:
    chosen = list(dict.fromkeys(values)) if values is not None else default
    if allowed is not None:
        bad = [v for v in chosen if v not in allowed]
        if bad:
            raise ValueError(f"unknown {label} {bad}; choose from {', '.join(map(str, allowed))}")
    return chosen


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
    shard: Iterable[bool] | None = None,
    chunks: Iterable[int] | None = None,
    schedules: Iterable[str] | None = None,
    checkpoints: Iterable[str] | None = None,
) -> list[Layout]:
    """Every layout to search (``gpipe.layout.layouts``; defaults: K·R ≤ processes, sharded
    and not, M = powers of two up to 32 that split each replica's batch evenly, as the memory
    model assumes, every schedule of one stage per rank, every re-materialization mode)."""
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive int, got {processes!r}")
    one_per_rank = [n for n, spec in SCHEDULES.items() if 1 in spec.virtual_stages]
    searched = [n for n in one_per_rank if not SCHEDULES[n].takes_costs]
    schedule_list = _choices(schedules, searched, "schedules", SCHEDULES)
    several = [s for s in schedule_list if s not in one_per_rank]
    if several:
        raise ValueError(
            f"the capacity search places one stage per rank: drop {', '.join(several)}"
        )
    found = layouts(
        stages=_choices(stages, list(range(1, processes + 1)), "stages"),
        replicas=_choices(replicas, list(range(1, processes + 1)), "replicas"),
        shard=_choices(shard, [False, True], "shard", (False, True)),
        chunks=_choices(chunks, [1, 2, 4, 8, 16, 32], "chunks"),
        schedules=schedule_list,
        checkpoints=_choices(
            checkpoints, list(remat.REMAT_MODES), "checkpoints", remat.REMAT_MODES
        ),
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
    shard: Iterable[bool] | None = None,
    chunks: Iterable[int] | None = None,
    schedules: Iterable[str] | None = None,
    checkpoints: Iterable[str] | None = None,
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
    costs = _FamilyCosts(family)
    candidates = capacity_layouts(
        family,
        processes,
        stages=stages,
        replicas=replicas,
        shard=shard,
        chunks=chunks,
        schedules=schedules,
        checkpoints=checkpoints,
    )
    rows = [
        _largest(costs, layout, memory_budget, calibration, state, max_depth)
        for layout in candidates
    ]
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
        shard=layout.shard,
        workspace=True,
        layer_overhead=per_stage_layer,
    )


class _LayoutCosts:
    """The memory table of a layout at any depth."""

    def __init__(
        self, costs: _FamilyCosts, layout: Layout, state: float, per_stage_layer: float = 0.0
    ) -> None:
        self.costs, self.layout = costs, layout
        schedule = layout.build_schedule()
        self.held = held_microbatches(schedule, layout.checkpoint)
        self.split = schedule.splits_backward(0, 0)
        self.model = _memory_model(layout, state, per_stage_layer)
        self.samples = costs.family.batch_size // layout.replicas // layout.chunks

    def table(self, depth: int) -> StageMemoryTable:
        prof = self.costs.at(depth, self.samples)
        return StageMemoryTable(prof.layers, self.held, self.model, splits_backward=self.split)


def _largest(
    costs: _FamilyCosts,
    layout: Layout,
    budget: float,
    calibration: Calibration,
    state: float,
    cap: int,
) -> Fit:
    """The largest depth of ``layout`` that fits: grow by doubling steps, then bisect."""
    at = _LayoutCosts(costs, layout, state, calibration.per_stage_layer)

    def fits(depth: int) -> bool:
        table = at.table(depth)
        n = len(table.layers)
        room = budget - calibration.at(n)
        return room > 0 and cut_within(table, n, layout.stages, room) is not None

    low = _smallest_depth(costs.family, layout.stages)
    if not fits(low):
        return _fit(at, low, budget, calibration)
    high = low  # the largest depth known to fit
    step = 1
    while True:
        probe = min(high + step, cap)
        if probe == high or not fits(probe):
            break
        high, step = probe, step * 2
    top = min(high + step, cap + 1)  # the smallest depth known not to fit (or past the cap)
    while top - high > 1:
        middle = (high + top) // 2
        if fits(middle):
            high = middle
        else:
            top = middle
    return _fit(at, high, budget, calibration)


def fit_of(
    family: Family,
    layout: Layout,
    depth: int,
    *,
    optimizer: str | float = "adamw",
    budget: float,
    overhead: float | Calibration = 0.0,
) -> Fit:
    """``layout`` at ``depth``: its memory balance and predicted memory, whether it fits or
    not (then ``missing`` says by how much each stage does not)."""
    calibration = _calibration(overhead)
    at = _LayoutCosts(_FamilyCosts(family), layout, optimizer_state_of(optimizer),
                      calibration.per_stage_layer)  # fmt: skip
    return _fit(at, depth, budget, calibration)


def _calibration(overhead: float | Calibration) -> Calibration:
    if isinstance(overhead, Calibration):
        return overhead
    if not (isinstance(overhead, int | float) and overhead >= 0):
        raise ValueError(f"overhead must be a non-negative number of bytes, got {overhead!r}")
    return Calibration(float(overhead))


def _fit(at: _LayoutCosts, depth: int, budget: float, calibration: Calibration) -> Fit:
    """The lightest cut of ``depth``: the most room in its fullest stage, or, when it does
    not fit, the least missing there."""
    table = at.table(depth)
    overhead = calibration.at(len(table.layers))
    balance = lightest_cut(table, len(table.layers), at.layout.stages)
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
        layout = replace(closest, stages=k, replicas=1, shard=False, checkpoint="always")
        row = _largest(costs, layout, budget, calibration, state, cap)
        if row.fits:
            return (
                f"or K >= {k} stages ({layout.label()} trains depth {row.depth}, "
                f"{row.parameters:,} parameters)"
            )
    return f"no layout of up to {8 * searched} stages fits: a single layer is too large"
