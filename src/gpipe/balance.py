"""Choose the cuts: the contiguous partition whose slowest stage is fastest.

A pipeline runs at the speed of its slowest stage, so the best cut of ``L`` layers into
``K`` stages minimises the largest stage cost. That problem is solved exactly, by dynamic
programming over (stages used, layers covered) — O(K·L²), not a greedy guess:

    best(s, j) = min over i of max(best(s-1, i), cost(stage s-1 = layers i..j-1))

Of the partitions that reach the optimum, the one with the smallest sum of squared stage
costs is chosen (a second pass of the same recursion), so the other stages are as even as
they can be too.

The cost of a stage may depend on its position (the first stage of a 1F1B pipeline holds
K micro-batches, the last one), and a stage may be required to fit a memory budget;
both enter the same recursion. Entry points:

* :func:`balance_by_time` — profile the model (``gpipe.profile``) and balance forward +
  backward (+ recomputation) time: what ``Pipe(balance="auto", sample=...)`` uses;
* :func:`balance_by_size` — balance memory: parameter bytes alone (DeepSpeed's
  ``"parameters"`` method) or, given a sample, the whole memory model below;
* :func:`balance_profile` — either objective on a :class:`~gpipe.profile.Profile` you
  have (measured once, or synthetic), returning the stage times and memory too;
* :func:`balance_costs` — the bare algorithm on a list of numbers.

Memory model of a stage (bytes; :class:`MemoryModel`)::

    parameters × (1 + gradients + optimizer_state)        AdamW: optimizer_state = 2
    + buffers
    + boundary input × micro-batches held                 (kept for backward)
    + inner activations × micro-batches held without re-materialization
                        (with it, those being recomputed: 1, more under zero bubble)
    − freed after B × micro-batches past B waiting for W (zero bubble: what lies above
                        the stage's last weights, e.g. the loss's log-softmax)

"Held" comes from simulating the schedule (``gpipe.simulate``): a micro-batch is held
on a stage from the start of its forward until its backward is complete. Inner
activations are what autograd saves inside the stage (the layers' saved tensors, each
boundary between two layers counted once); a re-materialized micro-batch holds them
only from the start of its backward. The peaks of the two counts are added, which can
overstate a little when they do not coincide. Not modelled: the loss's saved tensors
unless the profile included the loss, allocator fragmentation, temporary buffers of a
single operation, communication buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from gpipe.partition import PartitionError
from gpipe.profile import LayerProfile, Profile, profile
from gpipe.schedule import Kind, Schedule, build_schedule
from gpipe.simulate import Costs, SimulationResult, simulate

__all__ = [
    "BudgetError",
    "Held",
    "MemoryModel",
    "Partition",
    "StageMemory",
    "balance_by_size",
    "balance_by_time",
    "balance_costs",
    "balance_profile",
    "held_in",
    "held_microbatches",
    "layer_times",
    "recompute_fraction",
    "stage_memory",
]

Checkpoint = Literal["always", "except_last", "never"]
_CHECKPOINTS = ("always", "except_last", "never")
_MIB = 2**20


class BudgetError(PartitionError):
    """No partition fits the memory budget.

    ``balance`` is the closest partition (smallest largest excess over the budget),
    ``needed`` the bytes each of its stages needs and ``missing`` what each lacks (0 where
    it fits).
    """

    def __init__(
        self, message: str, *, balance: list[int], needed: list[float], missing: list[float]
    ) -> None:
        super().__init__(message)
        self.balance = balance
        self.needed = needed
        self.missing = missing


@dataclass(frozen=True)
class MemoryModel:
    """How training memory grows with the parameters (multiples of parameter bytes)."""

    gradients: float = 1.0  # one gradient per parameter
    optimizer_state: float = 2.0  # AdamW: two moments per parameter; SGD+momentum: 1

    def __post_init__(self) -> None:
        for label in ("gradients", "optimizer_state"):
            value = getattr(self, label)
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"{label} must be a non-negative number, got {value!r}")


@dataclass(frozen=True)
class Held:
    """Micro-batches a stage holds at its peak: boundary inputs, and inner activations."""

    boundary: int
    inner: int
    # of ``inner``, those past B and waiting for W (zero-bubble), which hold less
    after_input_grad: int = 0


@dataclass(frozen=True)
class StageMemory:
    """A stage's memory by kind, in bytes."""

    parameters: float
    gradients: float
    optimizer: float
    buffers: float
    boundary: float  # boundary inputs × held micro-batches
    inner: float  # inner activations × micro-batches holding them
    held: Held

    @property
    def total(self) -> float:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.buffers
            + self.boundary
            + self.inner
        )

    def describe(self) -> str:
        return (
            f"{self.total / _MIB:.1f} MiB (parameters {self.parameters / _MIB:.1f} + gradients "
            f"{self.gradients / _MIB:.1f} + optimizer {self.optimizer / _MIB:.1f} + buffers "
            f"{self.buffers / _MIB:.1f} + inputs {self.boundary / _MIB:.1f} for "
            f"{self.held.boundary} micro-batches + inner activations {self.inner / _MIB:.1f} "
            f"for {self.held.inner})"
        )


@dataclass(frozen=True)
class Partition:
    """A balance with what it costs: per stage, seconds per micro-batch and memory."""

    balance: list[int]
    times: list[float]  # forward + backward (+ recomputation) of one micro-batch
    memory: list[StageMemory]

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage: 1.0 is perfect balance."""
        mean = sum(self.times) / len(self.times)
        return max(self.times) / mean if mean > 0 else 1.0


# -- the exact algorithm ------------------------------------------------------------------


def _solve(
    n: int,
    stages: int,
    cost: Callable[[int, int, int], float],
    fits: Callable[[int, int, int], bool] | None = None,
) -> tuple[float, list[int]] | None:
    """Min over contiguous partitions of max over stages of ``cost(stage, start, stop)``.

    Stages are non-empty; only stages with ``fits(stage, start, stop)`` are allowed.
    Returns (optimum, balance), or None if no partition is allowed. Many partitions
    usually share the optimal slowest stage; among them the one with the smallest sum of
    squared stage costs is returned (the others as even as they can be), so that the
    answer does not hang on which layer a noisy measurement made the slowest.
    """
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = -inf  # max over no stages
    for s in range(1, stages + 1):
        # stage s-1 covers layers i..j-1; the stages after it need a layer each
        for j in range(s, n - (stages - s) + 1):
            row = inf
            for i in range(s - 1, j):
                before = best[s - 1][i]
                if before >= row or (fits is not None and not fits(s - 1, i, j)):
                    continue
                row = min(row, max(before, cost(s - 1, i, j)))
            best[s][j] = row
    optimum = best[stages][n]
    if optimum == inf:
        return None

    # Second pass: the least sum of squares among partitions within the optimum (a
    # rounding's worth of slack, so that the optimal partition itself qualifies).
    bound = optimum + 1e-9 * abs(optimum) + 1e-300
    squares = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(stages + 1)]
    squares[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            row, row_choice = inf, -1
            for i in range(s - 1, j):
                if squares[s - 1][i] == inf:
                    continue
                c = cost(s - 1, i, j)
                if c > bound or (fits is not None and not fits(s - 1, i, j)):
                    continue
                value = squares[s - 1][i] + c * c
                if value < row:
                    row, row_choice = value, i
            squares[s][j], choice[s][j] = row, row_choice
    balance, j = [], n
    for s in range(stages, 0, -1):
        i = choice[s][j]
        balance.append(j - i)
        j = i
    return optimum, balance[::-1]


def _check_stages(n: int, stages: Any) -> None:
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise PartitionError(f"stages must be a positive int, got {stages!r}")
    if stages > n:
        raise PartitionError(
            f"cannot cut {n} layers into {stages} stages: every stage needs a layer; "
            f"use stages <= {n}"
        )


def balance_costs(costs: Sequence[float], stages: int) -> list[int]:
    """The balance (layers per stage) that minimises the largest sum of ``costs``.

    Exact for any non-negative costs::

        >>> balance_costs([1, 1, 1, 9, 1, 1], stages=3)
        [3, 1, 2]
    """
    values = [float(c) for c in costs]
    _check_stages(len(values), stages)
    if any(not v >= 0 for v in values):
        raise ValueError(f"costs must be non-negative numbers, got {list(costs)}")
    prefix = _prefix(values)
    solved = _solve(len(values), stages, lambda s, i, j: prefix[j] - prefix[i])
    assert solved is not None  # without a memory constraint every partition is allowed
    return solved[1]


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


# -- what a schedule makes a stage hold -----------------------------------------------------


def recompute_fraction(checkpoint: str, chunks: int) -> float:
    """Share of micro-batches whose forward runs twice (re-materialization)."""
    if checkpoint not in _CHECKPOINTS:
        raise ValueError(f"checkpoint must be one of {', '.join(_CHECKPOINTS)}, got {checkpoint!r}")
    if checkpoint == "always":
        return 1.0
    if checkpoint == "except_last":
        return (chunks - 1) / chunks
    return 0.0


def held_microbatches(
    schedule: Schedule, checkpoint: str, costs: Costs | None = None
) -> list[Held]:
    """Per stage, the most micro-batches holding boundary inputs and inner activations.

    From the simulated timeline (``gpipe.simulate``; unit costs by default): boundary
    inputs are held from a micro-batch's forward until its backward is complete (the
    simulator's ``peak_live_per_stage``); inner activations from the forward too without
    re-materialization, from the start of the backward with it::

        >>> s = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
        >>> [(h.boundary, h.inner) for h in held_microbatches(s, "always")]
        [(4, 1), (3, 1), (2, 1), (1, 1)]
    """
    return held_in(simulate(schedule, costs), checkpoint)


def held_in(result: SimulationResult, checkpoint: str) -> list[Held]:
    """:func:`held_microbatches` of a simulation already run."""
    schedule = result.schedule
    M = schedule.num_microbatches
    recompute_fraction(checkpoint, M)  # checks the name
    start: dict[tuple[Kind, int, int], float] = {}
    end: dict[tuple[Kind, int, int], float] = {}
    for event in result.events:
        key = (event.action.kind, event.action.stage, event.action.microbatch)
        start[key], end[key] = event.start, event.end
    held = []
    for s in range(schedule.num_stages):
        points = []  # (time, change of held micro-batches, change of those past B)
        for m in range(M):
            remat = checkpoint == "always" or (checkpoint == "except_last" and m < M - 1)
            begin = start[(Kind.BACKWARD, s, m)] if remat else start[(Kind.FORWARD, s, m)]
            points.append((begin, 1, 0))
            if schedule.splits_backward(s, m):
                points += [(end[(Kind.BACKWARD, s, m)], 0, 1), (end[(Kind.WEIGHT, s, m)], -1, -1)]
            else:
                points.append((end[(Kind.BACKWARD, s, m)], -1, 0))
        points.sort()  # at a tie releases come first
        live = pending = peak = 0
        fewest_pending = 0  # at the peak: the heaviest moment holds the fewest past B
        for _, delta, past_b in points:
            live, pending = live + delta, pending + past_b
            if live > peak:
                peak, fewest_pending = live, pending
            elif live == peak:
                fewest_pending = min(fewest_pending, pending)
        held.append(Held(result.peak_live_per_stage[s], peak, fewest_pending))
    return held


# -- the memory of a stage ------------------------------------------------------------------


class _StageMemoryTable:
    """O(1) memory of any stage (layers i..j-1 at position s), from prefix sums."""

    def __init__(self, layers: Sequence[LayerProfile], held: Sequence[Held], model: MemoryModel):
        n = len(layers)
        self.layers, self.held, self.model = layers, held, model
        self.factor = 1.0 + model.gradients + model.optimizer_state
        self.params = _prefix([lay.param_bytes for lay in layers])
        self.buffers = _prefix([lay.buffer_bytes for lay in layers])
        self.inner = _prefix([lay.inner_bytes for lay in layers])
        self.has_params = [lay.param_bytes > 0 for lay in layers]
        # the boundary between layers l and l+1 is saved once, by either of them
        self.joint = _prefix(
            [
                max(layers[l].saved_output_bytes, layers[l + 1].saved_input_bytes)
                for l in range(n - 1)
            ]
        )

    def _inner(self, i: int, j: int) -> float:
        return (
            self.inner[j]
            - self.inner[i]
            + self.joint[j - 1]
            - self.joint[i]
            + self.layers[j - 1].saved_output_bytes
        )

    def _freed_after_input_grad(self, i: int, j: int) -> float:
        """What a split B frees at once: the stage's top layers down to its last weights
        (W starts at their nodes and keeps everything below alive). The first stage has
        no input gradient to compute: its B does nothing and W the whole backward."""
        if i == 0:
            return 0.0
        freed = 0.0
        for layer in range(j - 1, i - 1, -1):
            freed += self.layers[layer].freed_after_input_grad_bytes
            if self.has_params[layer]:
                break
        return freed

    def _held_inner(self, s: int, i: int, j: int) -> float:
        held = self.held[s]
        inner = self._inner(i, j) * held.inner
        if held.after_input_grad:
            inner -= self._freed_after_input_grad(i, j) * held.after_input_grad
        return inner

    def __call__(self, s: int, i: int, j: int) -> StageMemory:
        params = self.params[j] - self.params[i]
        held = self.held[s]
        return StageMemory(
            parameters=params,
            gradients=params * self.model.gradients,
            optimizer=params * self.model.optimizer_state,
            buffers=self.buffers[j] - self.buffers[i],
            boundary=self.layers[i].input_bytes * held.boundary,
            inner=self._held_inner(s, i, j),
            held=held,
        )

    def total(self, s: int, i: int, j: int) -> float:
        """``self(s, i, j).total``, without building the breakdown (the hot path)."""
        held = self.held[s]
        return (
            (self.params[j] - self.params[i]) * self.factor
            + self.buffers[j]
            - self.buffers[i]
            + self.layers[i].input_bytes * held.boundary
            + self._held_inner(s, i, j)
        )


def stage_memory(
    prof: Profile, balance: Sequence[int], held: Sequence[Held], model: MemoryModel | None = None
) -> list[StageMemory]:
    """The memory of each stage of ``balance`` (see the module docstring)."""
    table = _StageMemoryTable(prof.layers, held, model or MemoryModel())
    out, start = [], 0
    for s, size in enumerate(balance):
        out.append(table(s, start, start + size))
        start += size
    return out


def layer_times(
    prof: Profile, *, checkpoint: str = "never", chunks: int = 1, split: bool = False
) -> list[float]:
    """Seconds per micro-batch of each layer: forward (+ its share of recomputation) +
    backward (``split``: input-gradient and weight-gradient parts timed apart)."""
    again = recompute_fraction(checkpoint, chunks)
    return [
        lay.forward * (1.0 + again)
        + (lay.backward_input + lay.backward_weight if split else lay.backward)
        for lay in prof.layers
    ]


# -- entry points ---------------------------------------------------------------------------


def _budgets(memory_budget: float | Sequence[float] | None, stages: int) -> list[float] | None:
    if memory_budget is None:
        return None
    if isinstance(memory_budget, int | float):
        values = [float(memory_budget)] * stages
    else:
        values = [float(b) for b in memory_budget]
        if len(values) != stages:
            raise ValueError(
                f"memory_budget has {len(values)} entries for {stages} stages; give one per "
                "stage or a single number"
            )
    if any(not b > 0 for b in values):
        raise ValueError(f"memory budgets must be positive byte counts, got {memory_budget!r}")
    return values


def _schedule_of(
    schedule: str | Schedule, stages: int, chunks: int, virtual_stages: int
) -> Schedule:
    if isinstance(schedule, Schedule):
        if schedule.num_stages != stages or schedule.num_microbatches != chunks:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_stages} stages and "
                f"{schedule.num_microbatches} micro-batches, not {stages} and {chunks}"
            )
        return schedule
    if stages % virtual_stages:
        raise PartitionError(
            f"stages={stages} is not a multiple of virtual_stages={virtual_stages} "
            "(stages = devices × virtual stages)"
        )
    return build_schedule(
        schedule,
        num_ranks=stages // virtual_stages,
        num_microbatches=chunks,
        virtual_stages=virtual_stages,
    )


def balance_profile(
    prof: Profile,
    *,
    stages: int,
    by: Literal["time", "size"] = "time",
    chunks: int = 1,
    checkpoint: Checkpoint = "except_last",
    schedule: str | Schedule = "gpipe",
    virtual_stages: int = 1,
    memory_budget: float | Sequence[float] | None = None,
    memory: MemoryModel | None = None,
    held: Sequence[Held] | None = None,
) -> Partition:
    """The best partition of a profiled model into ``stages`` stages.

    ``by="time"`` minimises the slowest stage's forward + backward (+ recomputation)
    time, ``by="size"`` the largest stage's memory. ``memory_budget`` (bytes per stage,
    one number or one per stage) is a hard constraint on the memory model of the module
    docstring, for ``chunks`` micro-batches under ``schedule`` and ``checkpoint``.
    ``held`` overrides the simulated micro-batches held per stage.

    Raises :class:`BudgetError`, naming what each stage of the closest partition
    lacks, when no partition fits.
    """
    n = len(prof.layers)
    _check_stages(n, stages)
    if by not in ("time", "size"):
        raise ValueError(f"by must be 'time' or 'size', got {by!r}")
    model = memory or MemoryModel()
    built = _schedule_of(schedule, stages, chunks, virtual_stages)
    if held is None:
        held = held_microbatches(built, checkpoint)
    table = _StageMemoryTable(prof.layers, held, model)
    split = built.splits_backward(0, 0)
    times = _prefix(layer_times(prof, checkpoint=checkpoint, chunks=chunks, split=split))
    budgets = _budgets(memory_budget, stages)

    if by == "time":
        cost: Callable[[int, int, int], float] = lambda s, i, j: times[j] - times[i]  # noqa: E731
    else:
        cost = table.total
    fits = None
    if budgets is not None:
        fits = lambda s, i, j: table.total(s, i, j) <= budgets[s]  # noqa: E731
    solved = _solve(n, stages, cost, fits)
    if solved is None:
        assert budgets is not None
        _raise_budget(prof, stages, table, budgets, chunks, checkpoint, schedule)
    balance = solved[1]
    starts = _prefix(balance)
    bounds = [(int(starts[s]), int(starts[s + 1])) for s in range(stages)]
    return Partition(
        balance=balance,
        times=[times[j] - times[i] for i, j in bounds],
        memory=[table(s, i, j) for s, (i, j) in enumerate(bounds)],
    )


def _raise_budget(prof, stages, table, budgets, chunks, checkpoint, schedule) -> None:
    n = len(prof.layers)
    # The partition that misses the budget by the least, in the worst stage.
    closest = _solve(n, stages, lambda s, i, j: table.total(s, i, j) - budgets[s])
    assert closest is not None
    balance = closest[1]
    lines, needed, missing, start = [], [], [], 0
    for s, size in enumerate(balance):
        need = table(s, start, start + size)
        lack = max(0.0, need.total - budgets[s])
        needed.append(need.total)
        missing.append(lack)
        layers = f"layer {start}" if size == 1 else f"layers {start}-{start + size - 1}"
        verdict = f"{lack / _MIB:.1f} MiB missing" if lack > 0 else "fits"
        lines.append(f"- stage {s} ({layers}): needs {need.describe()}: {verdict}")
        start += size
    name = schedule if isinstance(schedule, str) else schedule.name
    budget = (
        f"{budgets[0] / _MIB:.1f} MiB per stage"
        if len(set(budgets)) == 1
        else "budgets " + ", ".join(f"{b / _MIB:.1f}" for b in budgets) + " MiB"
    )
    raise BudgetError(
        f"no cut of {n} layers into {stages} stages fits {budget} (schedule {name!r}, "
        f"{chunks} micro-batches, checkpoint={checkpoint!r}); the closest, balance={balance}:\n"
        + "\n".join(lines)
        + f"\nto fit: raise the budget by {max(missing) / _MIB:.1f} MiB where it is missing, "
        "use more stages, checkpoint='always', a schedule holding fewer micro-batches "
        "('1f1b'), smaller micro-batches, or an optimizer with less state",
        balance=balance,
        needed=needed,
        missing=missing,
    )


def balance_by_time(
    model: nn.Sequential,
    sample: Any,
    *,
    stages: int,
    device: Any = None,
    repeats: int = 5,
    warmup: int = 2,
    chunks: int = 1,
    checkpoint: Checkpoint = "except_last",
    schedule: str | Schedule = "gpipe",
    virtual_stages: int = 1,
    memory_budget: float | Sequence[float] | None = None,
    optimizer_state: float = 2.0,
    target: Any = None,
    loss_fn: Callable | None = None,
) -> list[int]:
    """Layers per stage that minimise the slowest stage, measured on ``sample``.

    ``sample`` is one micro-batch of inputs; each layer's forward and backward are timed
    on ``device`` (default: the model's) by :func:`gpipe.profile`. With
    ``memory_budget`` (bytes per stage) only partitions whose every stage fits are
    considered; ``chunks``, ``schedule``, ``checkpoint`` and ``optimizer_state`` say what
    a stage must hold (see the module docstring)::

        balance = gpipe.balance_by_time(model, x[:8], stages=4)
        pipe = gpipe.Pipe(model, balance=balance, chunks=8)
    """
    prof = profile(
        model, sample, device, target=target, loss_fn=loss_fn, repeats=repeats, warmup=warmup
    )
    return balance_profile(
        prof,
        stages=stages,
        by="time",
        chunks=chunks,
        checkpoint=checkpoint,
        schedule=schedule,
        virtual_stages=virtual_stages,
        memory_budget=memory_budget,
        memory=MemoryModel(optimizer_state=optimizer_state),
    ).balance


def balance_by_size(
    model: nn.Sequential,
    sample: Any = None,
    *,
    stages: int,
    device: Any = None,
    chunks: int = 1,
    checkpoint: Checkpoint = "except_last",
    schedule: str | Schedule = "gpipe",
    virtual_stages: int = 1,
    memory_budget: float | Sequence[float] | None = None,
    optimizer_state: float = 2.0,
    target: Any = None,
    loss_fn: Callable | None = None,
) -> list[int]:
    """Layers per stage that minimise the largest stage's memory.

    Without ``sample``: parameter bytes alone (with gradients and optimizer state, which
    are proportional), like DeepSpeed's ``partition_method="parameters"``; the model
    is not run and may be on ``meta``. With ``sample`` (one micro-batch): parameters and
    the activations each stage holds for ``chunks`` micro-batches under ``schedule`` and
    ``checkpoint``, measured by one profiling pass::

        balance = gpipe.balance_by_size(model, stages=4)                   # parameters
        balance = gpipe.balance_by_size(model, x[:8], stages=4, chunks=8)  # + activations
    """
    if sample is None:
        if not isinstance(model, nn.Sequential) or len(model) == 0:
            raise TypeError(f"balance_by_size takes a non-empty nn.Sequential, got {model!r}")
        prof = _parameters_only(model)
    else:
        prof = profile(model, sample, device, target=target, loss_fn=loss_fn, repeats=1, warmup=0)
    return balance_profile(
        prof,
        stages=stages,
        by="size",
        chunks=chunks,
        checkpoint=checkpoint,
        schedule=schedule,
        virtual_stages=virtual_stages,
        memory_budget=memory_budget,
        memory=MemoryModel(optimizer_state=optimizer_state),
    ).balance


def _parameters_only(model: nn.Sequential) -> Profile:
    layers = []
    for name, layer in model._modules.items():
        assert layer is not None
        params = {id(p): p.numel() * p.element_size() for p in layer.parameters()}
        buffers = {id(b): b.numel() * b.element_size() for b in layer.buffers()}
        layers.append(
            LayerProfile(
                name=f"{name} ({type(layer).__name__})",
                forward=0.0,
                backward=0.0,
                backward_input=0.0,
                backward_weight=0.0,
                param_bytes=sum(params.values()),
                buffer_bytes=sum(buffers.values()),
                input_bytes=0,
                output_bytes=0,
                saved_bytes=0,
            )
        )
    return Profile(tuple(layers), None, "none")
