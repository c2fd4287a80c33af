"""``zb-auto``: a zero-bubble schedule searched for given costs under a memory limit.

In the spirit of the automatic scheduler of the zero-bubble paper (Qi et al., ICLR 2024,
section 3), without its ILP: a greedy list scheduler plays the step forward in time under
the simulator's model (``gpipe.schedule.simulate``) and, each time a rank is free, picks

1. the oldest owed weight gradient ``W``, if the rank owes more than ``defer`` of them
   (``defer + r`` on rank r when ``slope`` is 1, ZB-H1's shape);
2. else a ready forward ``F`` if one more live micro-batch fits the rank's
   ``memory_limit`` and either no backward is ready or fewer than ``warmup - r`` of the
   rank's micro-batches await their ``B`` (1F1B's warm-up shape);
3. else a ready backward ``B`` (input gradient): the previous rank waits on it;
4. else the oldest owed ``W``: nothing waits on it, so it fills what would be idle time
   (and frees its micro-batch's activations);
5. else it waits for the first input to arrive.

A micro-batch is live from its ``F`` to its ``W``. Every (warmup, defer, slope) setting
is tried, and ZB-H1's order besides; the simulator times every candidate (sends that do
not block, as gpipe's transports') and the fastest within the memory limit is kept, the
one holding less on a tie. Every backward is split, so ``W`` exists for
every (stage, micro-batch)::

    >>> s = zb_auto(4, 8, costs=Costs(forward=1.0, backward=1.0, weight=1.0))
    >>> round(simulate(s).bubble_fraction, 4), simulate(s).peak_live_per_rank
    (0.1111, (4, 4, 4, 4))
"""

from __future__ import annotations

from collections import deque

from gpipe.schedule.builders import ALL_SCHEDULES, Schedule, _build, _check_sizes, zb_h1
from gpipe.schedule.ir import Action, Kind, ScheduleError
from gpipe.schedule.simulate import Costs, simulate

__all__ = ["zb_auto"]


def zb_auto(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs | None = None,
    transfer: float = 0.0,
    memory_limit: int | None = None,
) -> Schedule:
    """The fastest greedy zero-bubble schedule found for ``costs`` (see the module docstring).

    One stage per rank. ``costs``: per-stage F, B (input gradient) and W durations, e.g.
    measured by ``gpipe.planning.profile`` (default: all equal). ``transfer``: latency of a
    hand-off between ranks, in the same unit. ``memory_limit``: micro-batches of
    activations a rank may hold at once, from a forward's start to its ``W``'s end
    (default K, what 1F1B holds on its first rank; at least 1).
    """
    _check_sizes("zb-auto", num_ranks=num_ranks, num_microbatches=num_microbatches)
    K, M = num_ranks, num_microbatches
    limit = K if memory_limit is None else memory_limit
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ScheduleError(
            f"zb-auto: memory_limit must be a positive number of micro-batches, got "
            f"{memory_limit!r}; 1 holds one micro-batch per rank (slow), {K} is 1F1B's peak"
        )
    costs = costs or Costs()
    forward, backward, weight = costs.per_stage(K)
    if isinstance(transfer, bool) or not (isinstance(transfer, int | float) and transfer >= 0):
        raise ScheduleError(f"zb-auto: transfer must be a non-negative latency, got {transfer!r}")

    candidates = [
        _greedy(K, M, forward, backward, weight, float(transfer), limit, *knobs)
        for knobs in _knobs(K, M, limit)
    ]
    # ZB-H1's order too: the greedy rules do not always find its steady state.
    candidates.append([list(row) for row in zb_h1(K, M).actions])
    best, best_key = None, None
    for rows in candidates:
        candidate = _build("zb-auto", M, range(K), rows, buffered_sends=True)
        result = simulate(candidate, costs, transfer=transfer)
        if result.peak_live > limit:
            continue
        key = (round(result.makespan, 9), result.peak_live)
        if best_key is None or key < best_key:
            best, best_key = candidate, key
    assert best is not None  # the greedy candidates hold at most `limit`
    return best


def _knobs(K: int, M: int, limit: int) -> list[tuple[int, int, int]]:
    """The (warmup, defer, slope) settings tried (see the module docstring)."""
    defers = sorted({0, 1, 3, M})
    return [(w, d, slope) for w in range(1, min(limit, M) + K) for d in defers for slope in (0, 1)]


def _greedy(
    K: int,
    M: int,
    forward: list[float],
    backward: list[float],
    weight: list[float],
    transfer: float,
    limit: int,
    warmup: int,
    defer: int,
    slope: int,
) -> list[list[Action]]:
    """One rank list per stage (stage r on rank r), by the rules of the module docstring."""
    f_end = [[-1.0] * M for _ in range(K)]  # -1: not scheduled yet
    b_end = [[-1.0] * M for _ in range(K)]
    next_f, next_b = [0] * K, [0] * K  # both in micro-batch order on every stage
    clock = [0.0] * K
    live = [0] * K  # micro-batches whose W has not been scheduled
    owed: list[deque[int]] = [deque() for _ in range(K)]
    rows: list[list[Action]] = [[] for _ in range(K)]

    def ready_f(r: int) -> float | None:
        """When rank r's next forward may start (None: not known yet, or none left)."""
        m = next_f[r]
        if m == M or live[r] >= limit:
            return None
        if r == 0:
            return 0.0
        done = f_end[r - 1][m]
        return None if done < 0 else done + transfer

    def ready_b(r: int) -> float | None:
        m = next_b[r]
        if m == next_f[r]:  # its forward has not been scheduled
            return None
        if r == K - 1:
            return f_end[r][m]
        done = b_end[r + 1][m]
        return None if done < 0 else max(done + transfer, f_end[r][m])

    remaining = 3 * K * M
    blocked = [False] * K
    while remaining:
        waiting = [r for r in range(K) if not blocked[r] and len(rows[r]) < 3 * M]
        if not waiting:  # cannot happen: the last rank can always go on
            raise RuntimeError("zb-auto: the greedy search stalled; please report this")
        r = min(waiting, key=lambda rank: (clock[rank], rank))
        now = clock[r]
        f_at, b_at = ready_f(r), ready_b(r)
        f_now = f_at is not None and f_at <= now
        b_now = b_at is not None and b_at <= now
        pay = bool(owed[r]) and (
            len(owed[r]) > defer + slope * r or not (f_now or b_now)  # rules 1 and 4
        )
        if pay:
            m = owed[r].popleft()
            live[r] -= 1
            clock[r] = now + weight[r]
            rows[r].append(Action(Kind.WEIGHT, r, m))
        elif f_now and (not b_now or next_f[r] - next_b[r] < warmup - r):
            m = next_f[r]
            next_f[r] += 1
            live[r] += 1
            clock[r] = f_end[r][m] = now + forward[r]
            rows[r].append(Action(Kind.FORWARD, r, m))
        elif b_now:
            m = next_b[r]
            next_b[r] += 1
            owed[r].append(m)
            clock[r] = b_end[r][m] = now + backward[r]
            rows[r].append(Action(Kind.BACKWARD, r, m))
        else:
            later = [t for t in (f_at, b_at) if t is not None]
            if later:
                clock[r] = min(later)
            else:
                blocked[r] = True  # until another rank produces its input
            continue
        remaining -= 1
        blocked = [False] * K
    return rows


ALL_SCHEDULES["zb-auto"] = zb_auto
