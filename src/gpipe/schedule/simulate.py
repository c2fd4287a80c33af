"""Simulate a schedule: makespan, bubble and peak live activations without running a model.

Each rank runs its action list in order. An action starts when its rank is free and the
actions whose results it needs have ended, plus ``transfer`` when such a result crosses
ranks. Sends never block here: this is the timing the schedule allows, not a model of the
runtime's communication (:meth:`Schedule.validate` checks that part)::

    >>> from gpipe.schedule import build_schedule
    >>> result = simulate(build_schedule("1f1b", num_ranks=4, num_microbatches=8))
    >>> round(result.bubble_fraction, 4), result.peak_live_per_rank
    (0.2727, (4, 3, 2, 1))

Costs are per *stage*. A ``B`` that is not split (no ``W`` for its stage and micro-batch)
costs ``backward + weight``; a split one costs ``backward`` and its ``W`` costs ``weight``.
With the defaults (1, 1, 1) a whole backward takes twice a forward.

Interleaved schedules: a stage is then a *virtual* stage, a 1/v slice of a rank's layers.
To compare with one stage per rank on the same model, give each virtual stage 1/v of the
costs (and of ``activation_bytes``), e.g. ``Costs(forward=1/v, backward=1/v, weight=1/v)``;
``peak_live_per_rank`` still counts (stage, micro-batch) pairs, each 1/v of a micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from gpipe.schedule.ir import Kind, Schedule, TimedAction

__all__ = ["Costs", "SimulationResult", "per_stage", "simulate"]

PerStage = float | Sequence[float]  # one number for every stage, or one per stage


@dataclass(frozen=True)
class Costs:
    """Duration of each kind of action, per stage (e.g. in milliseconds, or unit costs)."""

    forward: PerStage = 1.0
    backward: PerStage = 1.0  # input-gradient part of the backward
    weight: PerStage = 1.0  # weight-gradient part; a B without W costs backward + weight

    def per_stage(self, num_stages: int) -> tuple[list[float], list[float], list[float]]:
        """The three costs as lists of ``num_stages`` non-negative numbers."""
        return (
            _per_stage("forward", self.forward, num_stages),
            _per_stage("backward", self.backward, num_stages),
            _per_stage("weight", self.weight, num_stages),
        )


def per_stage(value: PerStage, stages: int, what: str) -> list[float]:
    """``value`` for each of ``stages`` stages: one number for all, or one number each."""
    if isinstance(value, int | float):
        return [float(value)] * stages
    values = [float(v) for v in value]
    if len(values) != stages:
        raise ValueError(
            f"{what} has {len(values)} values but the schedule has {stages} stages; give one "
            "per stage or a single number"
        )
    return values


def _per_stage(label: str, value: PerStage, num_stages: int) -> list[float]:
    values = per_stage(value, num_stages, label)
    for stage, v in enumerate(values):
        if not v >= 0:  # also catches NaN
            raise ValueError(f"{label} of stage {stage} must be a non-negative number, got {v}")
    return values


@dataclass(frozen=True)
class SimulationResult:
    """Timing and memory of one simulated step, in the units of the costs."""

    schedule: Schedule
    makespan: float
    busy: tuple[float, ...]  # per rank: time spent computing
    idle: tuple[float, ...]  # per rank: makespan - busy
    bubble_fraction: float  # 1 - sum(busy) / (ranks * makespan)
    peak_live_per_stage: tuple[int, ...]  # most micro-batches live at once on each stage
    peak_live_per_rank: tuple[int, ...]  # most (stage, micro-batch) pairs live on each rank
    peak_bytes_per_stage: tuple[float, ...] | None  # given activation_bytes
    peak_bytes_per_rank: tuple[float, ...] | None
    # Start and end of each action, per rank in list order; `events` is built from them.
    _starts: tuple[list[float], ...] = field(repr=False, compare=False)
    _ends: tuple[list[float], ...] = field(repr=False, compare=False)

    @property
    def peak_live(self) -> int:
        """The largest per-rank peak: what the fullest device must hold."""
        return max(self.peak_live_per_rank)

    @cached_property
    def events(self) -> list[TimedAction]:
        """Every action with its start and end, sorted by start time, then rank."""
        events = [
            TimedAction(r, a, start, end)
            for r, acts in enumerate(self.schedule.actions)
            for a, start, end in zip(acts, self._starts[r], self._ends[r], strict=True)
        ]
        events.sort(key=lambda e: (e.start, e.rank))
        return events


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    *,
    transfer: float = 0.0,
    activation_bytes: PerStage | None = None,
) -> SimulationResult:
    """Time ``schedule`` (validated first) under ``costs``; see the module docstring.

    A micro-batch is live on a stage from the start of its forward until its backward is
    complete: the end of ``W`` if split, else of ``B``. ``activation_bytes`` (what one live
    micro-batch holds on each stage) turns the live counts into peak bytes::

        simulate(build_schedule("zb-h1", num_ranks=4, num_microbatches=16),
                 Costs(forward=1.0, backward=1.1, weight=0.9), transfer=0.05)
    """
    schedule.validate()
    S, M, R = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    fwd, bwd, wgt = (costs or Costs()).per_stage(S)
    if isinstance(transfer, bool) or not (isinstance(transfer, int | float) and transfer >= 0):
        raise ValueError(f"transfer must be a non-negative latency, got {transfer!r}")
    sizes = (
        None if activation_bytes is None else _per_stage("activation_bytes", activation_bytes, S)
    )
    rank_of = schedule.stage_to_rank
    split = {(s, m) for s in range(S) for m in range(M) if schedule.splits_backward(s, m)}
    programs, wakes = _programs(schedule, (fwd, bwd, wgt), split, transfer)
    SM = S * M
    begin, end, clock = _run(programs, wakes, 3 * SM)
    starts = tuple([begin[k] for k in p[0]] for p in programs)
    ends = tuple([end[k] for k in p[0]] for p in programs)
    makespan = max(clock, default=0.0)
    busy = tuple(float(sum(p[1])) for p in programs)
    bubble = 1.0 - sum(busy) / (R * makespan) if makespan > 0 else 0.0

    # Live interval of each (stage, micro-batch): forward start .. backward complete.
    intervals = []
    for s in range(S):
        for m in range(M):
            k = s * M + m
            last = end[2 * SM + k] if (s, m) in split else end[SM + k]
            intervals.append((s, begin[k], last))
    live_stage, live_rank, bytes_stage, bytes_rank = _peaks(intervals, rank_of, R, sizes)
    return SimulationResult(
        schedule=schedule,
        makespan=makespan,
        busy=busy,
        idle=tuple(makespan - b for b in busy),
        bubble_fraction=bubble,
        peak_live_per_stage=live_stage,
        peak_live_per_rank=live_rank,
        peak_bytes_per_stage=bytes_stage,
        peak_bytes_per_rank=bytes_rank,
        _starts=starts,
        _ends=ends,  # type: ignore[arg-type]
    )


# Each rank's program, flat for speed: key, cost, and up to two inputs (key or -1): the
# first with the latency to add when it comes from another rank, the second (a backward's
# own forward) always from this rank.
Program = tuple[list[int], list[float], list[int], list[float], list[int]]


def _programs(
    schedule: Schedule,
    costs: tuple[list[float], list[float], list[float]],
    split: set[tuple[int, int]],
    transfer: float,
) -> tuple[list[Program], dict[int, int]]:
    """Each rank's program, and for each result another rank consumes, that rank.

    Actions are numbered key = kind * S * M + stage * M + micro-batch, indexing `end`."""
    fwd, bwd, wgt = costs
    S, M, rank_of = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    SM = S * M
    FORWARD, BACKWARD = Kind.FORWARD, Kind.BACKWARD
    programs = []
    wakes: dict[int, int] = {}  # key -> the other rank that consumes its result
    for r, acts in enumerate(schedule.actions):
        keys, durations, in1, lat1, in2 = [], [], [], [], []
        for a in acts:
            s, m = a.stage, a.microbatch
            kind = a.kind
            if kind is FORWARD:
                keys.append(s * M + m)
                durations.append(fwd[s])
                prev = s - 1 if s > 0 else -1  # stage whose forward this one needs
                in1.append((prev * M + m) if prev >= 0 else -1)
                in2.append(-1)
                cross = prev >= 0 and rank_of[prev] != r
            elif kind is BACKWARD:
                keys.append(SM + s * M + m)
                durations.append(bwd[s] if (s, m) in split else bwd[s] + wgt[s])
                in2.append(s * M + m)  # own forward, same rank
                nxt = s + 1 if s < S - 1 else -1  # stage whose input gradient this needs
                in1.append((SM + nxt * M + m) if nxt >= 0 else -1)
                cross = nxt >= 0 and rank_of[nxt] != r
            else:
                keys.append(2 * SM + s * M + m)
                durations.append(wgt[s])
                in1.append(SM + s * M + m)
                in2.append(-1)
                cross = False
            lat1.append(transfer if cross else 0.0)
            if cross:
                wakes[in1[-1]] = r
        programs.append((keys, durations, in1, lat1, in2))
    return programs, wakes


def _run(
    programs: list[Program], wakes: dict[int, int], num_keys: int
) -> tuple[list[float], list[float | None], list[float]]:
    """Start and end of every action by key, and each rank's clock at its last action.

    A rank runs until an input is missing; the rank producing it wakes it when it gets there."""
    end: list[float | None] = [None] * num_keys
    begin = [0.0] * num_keys  # start times, kept exact for the live intervals
    R = len(programs)
    pc, clock = [0] * R, [0.0] * R
    pending = list(range(R))
    while pending:
        r = pending.pop()
        keys, durations, in1, lat1, in2 = programs[r]
        i, now, n = pc[r], clock[r], len(keys)
        while i < n:
            start = now
            if (k := in1[i]) >= 0:
                done = end[k]
                if done is None:
                    break
                if done + lat1[i] > start:
                    start = done + lat1[i]
            if (k := in2[i]) >= 0:
                done = end[k]
                if done is None:
                    break
                if done > start:
                    start = done
            now = start + durations[i]
            key = keys[i]
            end[key], begin[key] = now, start
            i += 1
            if (other := wakes.get(key)) is not None:
                pending.append(other)
        pc[r], clock[r] = i, now
    return begin, end, clock


def _peaks(
    intervals: list[tuple[int, float, float]],
    stage_to_rank: Sequence[int],
    num_ranks: int,
    sizes: Sequence[float] | None,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...] | None, tuple[float, ...] | None]:
    """Most intervals open at once per stage and per rank, and the same weighted by sizes."""
    points = []
    for stage, start, end in intervals:
        points.append((start, 1, stage))
        points.append((end, -1, stage))  # -1 sorts first: memory freed at t is reusable at t
    points.sort()
    S = len(stage_to_rank)
    live_s, peak_s = [0] * S, [0] * S
    live_r, peak_r = [0] * num_ranks, [0] * num_ranks
    bytes_s, top_s = [0.0] * S, [0.0] * S
    bytes_r, top_r = [0.0] * num_ranks, [0.0] * num_ranks
    for _, delta, s in points:
        r = stage_to_rank[s]
        live_s[s] += delta
        live_r[r] += delta
        peak_s[s] = max(peak_s[s], live_s[s])
        peak_r[r] = max(peak_r[r], live_r[r])
        if sizes is not None:
            bytes_s[s] += delta * sizes[s]
            bytes_r[r] += delta * sizes[s]
            top_s[s] = max(top_s[s], bytes_s[s])
            top_r[r] = max(top_r[r], bytes_r[r])
    if sizes is None:
        return tuple(peak_s), tuple(peak_r), None, None
    return tuple(peak_s), tuple(peak_r), tuple(top_s), tuple(top_r)
