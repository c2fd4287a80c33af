"""``zb-auto``: a zero-bubble schedule searched for given costs under a memory limit.

In the spirit of the automatic scheduler of the zero-bubble paper (Qi et al., ICLR 2024,
section 3), without its ILP: a greedy list scheduler plays the step forward in time under
the simulator's model (``gpipe.schedule.simulate``) and, each time a rank is free, picks

1. the oldest owed weight gradient ``W``, if the rank owes more than ``defer`` of them
   (``defer + r`` on rank r when ``slope`` is 1, ZB-H1's shape);
2. else a ready forward ``F`` if one more live micro-batch fits the rank's
   ``memory_limit`` and either no backward is ready or fewer than ``warmup - r`` of the
   rank's micro-batches await their ``B`` (1F1B's warm-up shape; on a V also ``warmup``
   on every rank, ``shape`` 0);
3. else a ready backward ``B`` (input gradient): the previous rank waits on it;
4. else the oldest owed ``W``: nothing waits on it, so it fills what would be idle time
   (and frees its micro-batch's activations);
5. else it waits for the first input to arrive.

On a rank holding two stages (the V placement, ``virtual_stages=2``) the action is taken
on the stage whose inputs arrived first.

A micro-batch is live from its ``F`` to its ``W``. Every (warmup, shape, defer, slope)
setting is tried, and ZB-H1's order besides (ZB-V's on a V); the simulator times every
candidate (sends that do not block, as gpipe's transports') and the fastest within the
memory limit is kept, the one holding less on a tie. Every backward is split, so ``W`` exists for
every (stage, micro-batch)::

    >>> s = zb_auto(4, 8, costs=Costs(forward=1.0, backward=1.0, weight=1.0))
    >>> round(simulate(s).bubble_fraction, 4), simulate(s).peak_live_per_rank
    (0.1111, (4, 4, 4, 4))
"""

from __future__ import annotations

from collections import deque

from gpipe.schedule.builders import _build, _check_sizes, v_stage_to_rank, zb_h1, zb_v
from gpipe.schedule.ir import Action, Kind, Schedule, ScheduleError
from gpipe.schedule.simulate import Costs, simulate

__all__ = ["PLACEMENTS", "zb_auto"]

# Stages per rank zb-auto can place: 1 (stage r on rank r), or 2 in ZB-V's V.
PLACEMENTS = (1, 2)


def zb_auto(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs | None = None,
    transfer: float = 0.0,
    memory_limit: int | None = None,
    virtual_stages: int = 1,
) -> Schedule:
    """The fastest greedy zero-bubble schedule found for ``costs`` (see the module docstring).

    ``virtual_stages``: 1 (stage r on rank r) or 2 (the V placement of ZB-V, rank r
    holding stages r and 2K-1-r). ``costs``: per-stage F, B (input gradient) and W
    durations, e.g. measured by ``gpipe.estimate.profile`` (default: all equal).
    ``transfer``: latency of a hand-off between ranks, in the same unit. ``memory_limit``:
    micro-batches of activations a rank may hold at once, from a forward's start to its
    ``W``'s end, a stage's counting 1/v (default K, what 1F1B holds on its first rank).
    """
    _check_sizes("zb-auto", num_ranks=num_ranks, num_microbatches=num_microbatches)
    K, M, v = num_ranks, num_microbatches, virtual_stages
    if v not in PLACEMENTS:
        raise ScheduleError(
            f"zb-auto: virtual_stages must be 1 (a stage per rank) or 2 (ZB-V's placement), "
            f"got {virtual_stages!r}"
        )
    limit = K if memory_limit is None else memory_limit
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ScheduleError(
            f"zb-auto: memory_limit must be a positive number of micro-batches, got "
            f"{memory_limit!r}; 1 holds one micro-batch per rank (slow), {K} is 1F1B's peak"
        )
    if isinstance(transfer, bool) or not (isinstance(transfer, int | float) and transfer >= 0):
        raise ScheduleError(f"zb-auto: transfer must be a non-negative latency, got {transfer!r}")
    placement = tuple(range(K)) if v == 1 else v_stage_to_rank(K)
    costs = costs or Costs()
    forward, backward, weight = costs.per_stage(len(placement))
    units = limit * v  # (stage, micro-batch) pairs a rank may hold

    candidates = [
        _greedy(placement, M, forward, backward, weight, float(transfer), units, *knobs)
        for knobs in _knobs(K, M, units, v)
    ]
    # The hand-made order too: the greedy rules do not always find its steady state.
    candidates.append([list(row) for row in (zb_h1(K, M) if v == 1 else zb_v(K, M)).actions])
    best, best_key = None, None
    for rows in candidates:
        candidate = _build("zb-auto", M, placement, rows, buffered_sends=True)
        result = simulate(candidate, costs, transfer=transfer)
        if result.peak_live > units:
            continue
        key = (round(result.makespan, 9), result.peak_live)
        if best_key is None or key < best_key:
            best, best_key = candidate, key
    assert best is not None  # the greedy candidates hold at most `units`
    return best


def _knobs(K: int, M: int, units: int, v: int) -> list[tuple[int, int, int, int]]:
    """The (warmup, shape, defer, slope) settings tried (see the module docstring)."""
    defers = sorted({0, 1, 3, M})
    return [
        (w, shape, d, slope)
        for w in range(1, min(units, v * M) + K)
        for shape in ((1,) if v == 1 else (0, 1))  # a V's warm-up is alike on every rank
        for d in defers
        for slope in (0, 1)
    ]


def _greedy(
    placement: tuple[int, ...],
    M: int,
    forward: list[float],
    backward: list[float],
    weight: list[float],
    transfer: float,
    units: int,
    warmup: int,
    shape: int,
    defer: int,
    slope: int,
) -> list[list[Action]]:
    """One action list per rank, by the rules of the module docstring."""
    play = _Play(placement, M, (forward, backward, weight), transfer, units)
    K = play.K
    remaining = 3 * play.S * M
    blocked = [False] * K
    while remaining:
        rows, stages_of = play.rows, play.stages_of
        waiting = [
            r for r in range(K) if not blocked[r] and len(rows[r]) < 3 * M * len(stages_of[r])
        ]
        r = min(waiting, key=lambda rank: (play.clock[rank], rank))
        acted = play.act(r, warmup - shape * r, defer + slope * r)
        if acted is None:
            blocked[r] = True  # until another rank produces its input
        elif acted:
            remaining -= 1
            blocked = [False] * K
    return play.rows


class _Play:
    """The step played forward by the greedy rules: what each stage has scheduled, when
    each action ends, what each rank holds and owes."""

    def __init__(
        self,
        placement: tuple[int, ...],
        M: int,
        costs: tuple[list[float], list[float], list[float]],
        transfer: float,
        units: int,
    ) -> None:
        S, K = len(placement), max(placement) + 1
        self.placement, self.M, self.S, self.K = placement, M, S, K
        self.forward, self.backward, self.weight = costs
        self.transfer, self.units = transfer, units
        self.stages_of = [[s for s in range(S) if placement[s] == r] for r in range(K)]
        self.f_end = [[-1.0] * M for _ in range(S)]  # -1: not scheduled yet
        self.b_end = [[-1.0] * M for _ in range(S)]
        self.next_f, self.next_b = [0] * S, [0] * S  # both in micro-batch order on every stage
        self.clock = [0.0] * K
        self.live = [0] * K  # (stage, micro-batch) pairs whose W has not been scheduled
        self.owed: list[deque[tuple[int, int]]] = [deque() for _ in range(K)]
        self.rows: list[list[Action]] = [[] for _ in range(K)]

    def act(self, r: int, warmup: int, defer: int) -> bool | None:
        """Rank r takes its next action (True), or waits until its first input arrives
        (False), or until another rank produces one (None)."""
        now, owed, stages = self.clock[r], self.owed[r], self.stages_of[r]
        f_ready = [(self.ready_f(s), s) for s in stages]
        b_ready = [(self.ready_b(s), s) for s in stages]
        f_now, b_now = _earliest(f_ready, now), _earliest(b_ready, now)
        awaiting_b = sum(self.next_f[s] - self.next_b[s] for s in stages)
        if owed and (len(owed) > defer or (f_now is None and b_now is None)):  # rules 1, 4
            s, m = owed.popleft()
            self.live[r] -= 1
            self.clock[r] = now + self.weight[s]
            self.rows[r].append(Action(Kind.WEIGHT, s, m))
        elif f_now is not None and (b_now is None or awaiting_b < warmup):
            s, m = f_now, self.next_f[f_now]
            self.next_f[s] += 1
            self.live[r] += 1
            self.clock[r] = self.f_end[s][m] = now + self.forward[s]
            self.rows[r].append(Action(Kind.FORWARD, s, m))
        elif b_now is not None:
            s, m = b_now, self.next_b[b_now]
            self.next_b[s] += 1
            owed.append((s, m))
            self.clock[r] = self.b_end[s][m] = now + self.backward[s]
            self.rows[r].append(Action(Kind.BACKWARD, s, m))
        else:
            later = [t for t, _ in f_ready + b_ready if t is not None]
            if not later:
                return None
            self.clock[r] = min(later)
            return False
        return True

    def arrival(self, done: float, producer: int, consumer: int) -> float | None:
        if done < 0:
            return None
        placement = self.placement
        return done + (self.transfer if placement[producer] != placement[consumer] else 0.0)

    def fits(self, s: int) -> bool:
        """Whether a forward on s fits the memory limit. A micro-batch entering the rank
        (on its first stage) reserves its later stages' share too: otherwise a V rank full
        of first-stage activations could never run the second stage that frees them."""
        r = self.placement[s]
        first, later = self.stages_of[r][0], self.stages_of[r][1:]
        if s != first:
            return True
        reserved = sum(self.next_f[first] - self.next_f[t] for t in later)
        return self.live[r] + reserved + len(self.stages_of[r]) <= self.units

    def ready_f(self, s: int) -> float | None:
        """When stage s's next forward may start (None: not known yet, or none left)."""
        m = self.next_f[s]
        if m == self.M or not self.fits(s):
            return None
        return 0.0 if s == 0 else self.arrival(self.f_end[s - 1][m], s - 1, s)

    def ready_b(self, s: int) -> float | None:
        m = self.next_b[s]
        if m == self.next_f[s]:  # its forward has not been scheduled
            return None
        if s == self.S - 1:
            return self.f_end[s][m]
        grad = self.arrival(self.b_end[s + 1][m], s + 1, s)
        return None if grad is None else max(grad, self.f_end[s][m])


def _earliest(ready: list[tuple[float | None, int]], now: float) -> int | None:
    """The stage whose action can start now and became ready first (the later stage on a
    tie: it is nearer the loss)."""
    due = [(t, -s) for t, s in ready if t is not None and t <= now]
    return -min(due)[1] if due else None
