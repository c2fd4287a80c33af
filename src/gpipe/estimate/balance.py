"""Choose the cuts of a model: the contiguous partition whose slowest stage is fastest.

The exact cut, position-dependent costs and memory budgets included, is
``gpipe.estimate.cuts``'s (the first stage of a 1F1B pipeline holds K micro-batches, the
last one). By time, that cut is then the start of a hill climb on the schedule's simulated
step (``_by_makespan`` says why). Entry points:

* :func:`balance_by_time` — profile the model (``gpipe.estimate.profile``) and balance forward +
  backward (+ recomputation) time: what ``Pipe(balance="auto", sample=...)`` uses;
* :func:`balance_by_size` — balance memory: parameter bytes alone (DeepSpeed's
  ``"parameters"`` method) or, given a sample, the whole memory model below;
* :func:`balance_profile` — either objective on a :class:`~gpipe.estimate.profile.Profile` you
  have (measured once, or synthetic), returning the stage times and memory too;
* :func:`gpipe.estimate.cuts.balance_costs` — the bare algorithm on a list of numbers.

The memory of a stage is :mod:`gpipe.estimate.memory_model`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from gpipe.base import remat
from gpipe.base._utils import MiB
from gpipe.base.errors import PartitionError
from gpipe.estimate.costs import layer_times, stage_costs
from gpipe.estimate.cuts import check_stages, min_max_cut
from gpipe.estimate.memory_model import (
    Held,
    MemoryModel,
    StageMemory,
    StageMemoryTable,
    held_microbatches,
)
from gpipe.estimate.profile import Profile, check_sequential, profile
from gpipe.estimate.ranges import prefix_sums, spans
from gpipe.layout import Layout
from gpipe.schedule import Schedule
from gpipe.schedule.simulate import per_stage, simulate

__all__ = ["BudgetError", "Partition", "balance_by_size", "balance_by_time", "balance_profile"]


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


def _budgets(memory_budget: float | Sequence[float] | None, stages: int) -> list[float] | None:
    if memory_budget is None:
        return None
    values = per_stage(memory_budget, stages, "memory_budget")
    if any(not b > 0 for b in values):
        raise ValueError(f"memory budgets must be positive byte counts, got {memory_budget!r}")
    return values


def _schedule_of(
    schedule: str | Schedule, stages: int, chunks: int, virtual_stages: int
) -> Schedule:
    given = None if isinstance(schedule, Schedule) else virtual_stages  # a Schedule's own
    layout = Layout.of_stages(stages, chunks=chunks, schedule=schedule, virtual_stages=given)
    return layout.build_schedule()


def balance_profile(
    prof: Profile,
    *,
    stages: int,
    by: Literal["time", "step", "size"] = "time",
    chunks: int = 1,
    checkpoint: remat.Remat = "except_last",
    schedule: str | Schedule = "gpipe",
    virtual_stages: int = 1,
    memory_budget: float | Sequence[float] | None = None,
    memory: MemoryModel | None = None,
    held: Sequence[Held] | None = None,
) -> Partition:
    """The best partition of a profiled model into ``stages`` stages.

    ``by="time"`` minimises the slowest stage's forward + backward (+ recomputation)
    time; ``by="step"`` starts there and shortens the schedule's simulated step (see the
    module docstring); ``by="size"`` minimises the largest stage's memory.
    ``memory_budget`` (bytes per stage, one number or one per stage) is a hard constraint
    on the memory model of the module docstring, for ``chunks`` micro-batches under
    ``schedule`` and ``checkpoint``. ``held`` overrides the simulated micro-batches held per stage.

    Raises :class:`BudgetError`, naming what each stage of the closest partition
    lacks, when no partition fits.
    """
    n = len(prof.layers)
    check_stages(n, stages)
    if by not in ("time", "step", "size"):
        raise ValueError(f"by must be 'time', 'step' or 'size', got {by!r}")
    model = memory or MemoryModel()
    built = _schedule_of(schedule, stages, chunks, virtual_stages)
    if held is None:
        held = held_microbatches(built, checkpoint)
    split = built.splits_backward(0, 0)
    table = StageMemoryTable(prof.layers, held, model, splits_backward=split)
    times = prefix_sums(layer_times(prof, checkpoint=checkpoint, chunks=chunks, split=split))
    budgets = _budgets(memory_budget, stages)

    if by in ("time", "step"):
        cost: Callable[[int, int, int], float] = lambda s, i, j: times[j] - times[i]  # noqa: E731
    else:
        cost = table.total
    fits = None
    if budgets is not None:
        fits = lambda s, i, j: table.total(s, i, j) <= budgets[s]  # noqa: E731
    solved = min_max_cut(n, stages, cost, fits)
    if solved is None:
        assert budgets is not None
        _raise_budget(prof, stages, table, budgets, chunks, checkpoint, schedule)
    balance = solved[1]
    if by == "step" and stages > 1:
        balance = _by_makespan(prof, balance, built, checkpoint, fits)
    bounds = spans(balance)
    return Partition(
        balance=balance,
        times=[times[j] - times[i] for i, j in bounds],
        memory=[table(s, i, j) for s, (i, j) in enumerate(bounds)],
    )


def _by_makespan(prof: Profile, balance: list[int], schedule: Schedule, checkpoint: str, fits):
    """Move single layers across stage boundaries while the simulated step gets shorter.

    The slowest stage is not the whole story: under a schedule the stages' actions differ
    (a split backward, the first stage's empty B and whole W, the loss on the last stage,
    the warm-up each rank waits through), and the step is the schedule's makespan with
    those costs (``gpipe.estimate.costs``). Starting from the best cut by the slowest
    stage, a hill climb on the makespan keeps every stage within its budget.
    """

    def makespan(cut: list[int]) -> float:
        return simulate(schedule, stage_costs(prof, cut, schedule, checkpoint)).makespan

    best, best_time = list(balance), makespan(balance)
    improved = True
    while improved:
        improved = False
        for s in range(len(best) - 1):
            for move in (-1, 1):
                cut = list(best)
                cut[s] += move
                cut[s + 1] -= move
                if min(cut) < 1:
                    continue
                if fits is not None and not all(
                    fits(t, i, j) for t, (i, j) in enumerate(spans(cut))
                ):
                    continue
                time = makespan(cut)
                if time < best_time * (1 - 1e-9):  # strictly shorter: no cycling on ties
                    best, best_time, improved = cut, time, True
    return best


def _raise_budget(prof, stages, table, budgets, chunks, checkpoint, schedule) -> None:
    n = len(prof.layers)
    # The partition that misses the budget by the least, in the worst stage.
    closest = min_max_cut(n, stages, lambda s, i, j: table.total(s, i, j) - budgets[s])
    assert closest is not None
    balance = closest[1]
    lines, needed, missing = [], [], []
    for s, (start, stop) in enumerate(spans(balance)):
        need = table(s, start, stop)
        lack = max(0.0, need.total - budgets[s])
        needed.append(need.total)
        missing.append(lack)
        layers = f"layer {start}" if stop - start == 1 else f"layers {start}-{stop - 1}"
        verdict = f"{lack / MiB:.1f} MiB missing" if lack > 0 else "fits"
        lines.append(f"- stage {s} ({layers}): needs {need.describe()}: {verdict}")
    name = schedule if isinstance(schedule, str) else schedule.name
    budget = (
        f"{budgets[0] / MiB:.1f} MiB per stage"
        if len(set(budgets)) == 1
        else "budgets " + ", ".join(f"{b / MiB:.1f}" for b in budgets) + " MiB"
    )
    raise BudgetError(
        f"no cut of {n} layers into {stages} stages fits {budget} (schedule {name!r}, "
        f"{chunks} micro-batches, checkpoint={checkpoint!r}); the closest, balance={balance}:\n"
        + "\n".join(lines)
        + f"\nto fit: raise the budget by {max(missing) / MiB:.1f} MiB where it is missing, "
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
    checkpoint: remat.Remat = "except_last",
    schedule: str | Schedule = "gpipe",
    virtual_stages: int = 1,
    memory_budget: float | Sequence[float] | None = None,
    optimizer_state: float = 2.0,
    target: Any = None,
    loss_fn: Callable | None = None,
    by: Literal["time", "step"] = "step",
) -> list[int]:
    """Layers per stage that make the step fastest, measured on ``sample``: the shortest
    simulated step of ``schedule`` (``by="step"``, from the cut whose slowest stage is
    fastest, ``by="time"``).

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
    plan = (stages, chunks, checkpoint, schedule, virtual_stages, memory_budget, optimizer_state)
    return _balanced(prof, by, *plan)


def balance_by_size(
    model: nn.Sequential,
    sample: Any = None,
    *,
    stages: int,
    device: Any = None,
    chunks: int = 1,
    checkpoint: remat.Remat = "except_last",
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
        check_sequential(model, "balance_by_size")
        prof = Profile.sizes_of(model)
    else:
        prof = profile(model, sample, device, target=target, loss_fn=loss_fn, repeats=1, warmup=0)
    plan = (stages, chunks, checkpoint, schedule, virtual_stages, memory_budget, optimizer_state)
    return _balanced(prof, "size", *plan)


def _balanced(prof, by, stages, chunks, checkpoint, schedule, v, budget, state) -> list[int]:
    """:func:`balance_profile`'s balance of ``prof``, for an optimizer of ``state`` copies."""
    memory = MemoryModel(optimizer_state=state)
    return balance_profile(prof, stages=stages, by=by, chunks=chunks, checkpoint=checkpoint,
                           schedule=schedule, virtual_stages=v, memory_budget=budget,
                           memory=memory).balance  # fmt: skip
