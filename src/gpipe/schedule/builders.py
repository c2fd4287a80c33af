"""The built-in schedules: one function per schedule, from (ranks, micro-batches) to a
validated :class:`~gpipe.schedule.ir.Schedule`. Which of them a name stands for, and where
each applies, is the table in :mod:`gpipe.schedule.registry`.

Splitting B from W is decided per (stage, micro-batch), though the built-in schedules split
all or nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from gpipe.schedule.ir import Action, Kind, Schedule, ScheduleError

__all__ = [
    "dualpipe_v",
    "dualpipe_v_problem",
    "fill_drain",
    "interleaved_1f1b",
    "interleaved_problem",
    "one_f_one_b",
    "v_stage_to_rank",
    "zb_h1",
    "zb_v",
]


# -- built-in schedules ----------------------------------------------------------------------


def _check_sizes(name: str, **sizes: int) -> None:
    for label, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {label} must be a positive integer, got {value!r}")


def _build(
    name: str,
    num_microbatches: int,
    stage_to_rank: Sequence[int],
    rows: Sequence[list[Action]],
    *,
    buffered_sends: bool = False,
) -> Schedule:
    return Schedule.from_actions(
        rows,
        stage_to_rank=stage_to_rank,
        num_microbatches=num_microbatches,
        name=name,
        buffered_sends=buffered_sends,
    )


def fill_drain(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards, last micro-batch first.

    Backwards go in reverse micro-batch order, as autograd would over the concatenated
    batch (and as torchgpipe does); with equal costs the makespan is the same either way.
    Every stage holds all M micro-batches at the peak. Bubble: (K-1)/(M+K-1).
    """
    _check_sizes("gpipe", num_stages=num_stages, num_microbatches=num_microbatches)
    M = num_microbatches
    rows = [
        [Action(Kind.FORWARD, s, m) for m in range(M)]
        + [Action(Kind.BACKWARD, s, m) for m in reversed(range(M))]
        for s in range(num_stages)
    ]
    return _build("gpipe", M, range(num_stages), rows)


def _one_f_one_b_order(warmup: int, total: int) -> list[tuple[bool, int]]:
    """(is_forward, k) of the k-th forward or backward: warm-up, 1F1B pairs, cool-down."""
    order = [(True, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [(True, k + warmup), (False, k)]
    return order + [(False, k) for k in range(total - warmup, total)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm up, alternate one forward and one backward, cool down.

    Stage r first runs ``K-1-r`` forwards, then alternates ``F(k+K-1-r)`` and ``B(k)``, then
    runs the remaining backwards. Same bubble as GPipe, ``(K-1)/(M+K-1)`` with equal costs,
    but stage r holds at most ``K-r`` micro-batches instead of M.
    """
    _check_sizes("1f1b", num_stages=num_stages, num_microbatches=num_microbatches)
    K, M = num_stages, num_microbatches
    rows = [
        [
            Action(Kind.FORWARD if forward else Kind.BACKWARD, r, k)
            for forward, k in _one_f_one_b_order(min(K - 1 - r, M), M)
        ]
        for r in range(K)
    ]
    return _build("1f1b", M, range(K), rows)


def interleaved_problem(num_ranks: int, num_microbatches: int, virtual_stages: int) -> str:
    """Why interleaved 1F1B cannot take these sizes ("" when it can): it takes micro-batches
    round the virtual stages in groups of K."""
    K, M = num_ranks, num_microbatches
    if virtual_stages == 1 or M % K == 0:
        return ""
    lower, upper = M // K * K, (M // K + 1) * K
    hint = f"{lower} or {upper}" if lower else str(upper)
    return (
        f"{M} micro-batches are not a multiple of its {K} ranks; it takes micro-batches round "
        f"the virtual stages in groups of {K}: use {hint} micro-batches"
    )


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): rank r holds stages ``r, r+K, ..., r+(v-1)K``.

    Each rank runs 1F1B over its ``v*M`` (stage, micro-batch) units. Forwards go round
    the rank's stages in groups of K micro-batches (``F0..F(K-1)`` on its first stage, then
    the same on its second, ...), backwards likewise from its last stage. Rank r warms up
    with ``2(K-1-r) + (v-1)K`` forwards. The pipeline fills v times faster, so with each
    stage costing 1/v of a rank's work the bubble is ``(K-1)/(vM+K-1)``; the price is more
    live units on rank r: ``min(vM, 2(K-1-r) + (v-1)K + 1)``, each 1/v of a micro-batch.

    The grouping needs ``M % K == 0`` (checked). With ``virtual_stages=1`` this is 1F1B.
    """
    _check_sizes(
        "interleaved-1f1b",
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        virtual_stages=virtual_stages,
    )
    K, M, v = num_ranks, num_microbatches, virtual_stages
    problem = interleaved_problem(K, M, v)
    if problem:
        raise ScheduleError(f"interleaved-1f1b: {problem}")
    total = v * M

    def unit(r: int, k: int, forward: bool) -> Action:
        # k-th forward (backward) of rank r: group of K micro-batches, then virtual stage.
        chunk = k % (K * v) // K
        if not forward:
            chunk = v - 1 - chunk
        microbatch = k // (K * v) * K + k % K
        kind = Kind.FORWARD if forward else Kind.BACKWARD
        return Action(kind, chunk * K + r, microbatch)

    rows = []
    for r in range(K):
        warmup = 2 * (K - 1 - r) + (v - 1) * K if v > 1 else K - 1 - r
        order = _one_f_one_b_order(min(warmup, total), total)
        rows.append([unit(r, k, forward) for forward, k in order])
    return _build("interleaved-1f1b", M, [s % K for s in range(K * v)], rows)


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism"): B split from W.

    ``B`` computes only the input gradient, so it reaches the previous stage sooner; the
    weight gradients ``W``, which nothing waits for, fill the bubbles. Stage r runs ``K-r``
    forwards (1F1B's warm-up and first steady forward), then for each micro-batch k: ``B(k)``,
    ``W(k-r)`` once ``k >= r``, and the next forward; then its last r ``W``. Deferring r
    weight gradients keeps ``K`` micro-batches live on every stage, the peak 1F1B has on
    stage 0. With M >= K and equal F, B, W costs the bubble is ``(K-1)/(3M+K-1)``: one third
    of 1F1B's ``(K-1)(F+B+W)`` idle time per rank, ``(K-1)(F+B-W)`` in general.
    """
    _check_sizes("zb-h1", num_stages=num_stages, num_microbatches=num_microbatches)
    K, M = num_stages, num_microbatches
    rows = []
    for r in range(K):
        warmup = min(K - r, M)
        row = [Action(Kind.FORWARD, r, m) for m in range(warmup)]
        for k in range(M):
            row.append(Action(Kind.BACKWARD, r, k))
            if k >= r:
                row.append(Action(Kind.WEIGHT, r, k - r))
            if k + warmup < M:
                row.append(Action(Kind.FORWARD, r, k + warmup))
        row += [Action(Kind.WEIGHT, r, m) for m in range(max(M - r, 0), M)]
        rows.append(row)
    return _build("zb-h1", M, range(K), rows)


# -- V-shape schedules: two stages per rank, the first and the last on rank 0 ---------------


def v_stage_to_rank(num_ranks: int) -> tuple[int, ...]:
    """V placement: rank r holds stages ``r`` and ``2K-1-r`` (K = ``num_ranks``).

    The first and the last stage share rank 0, so the loss is computed where the input
    entered, and the hand-off between stages K-1 and K stays on rank K-1.
    """
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


class _VRank:
    """One rank's action list of a V schedule, written as patterns of tokens.

    A token is a kind and a chunk: chunk 0 is the rank's stage on the way down (``r``),
    chunk 1 its stage on the way up (``2K-1-r``). ``F0`` is the next forward of chunk 0;
    ``B0`` the next whole backward; ``I0`` the next input-gradient backward, whose ``W``
    is then owed; ``W0`` pays the oldest ``W`` owed by chunk 0, ``W`` the oldest of any
    chunk (nothing if none is owed). Micro-batches are counted per kind and chunk, so a
    pattern is written once for any M; those past the last micro-batch are left out
    (the warm-up of ZB-V is sized for at least 2K-1 of them).
    """

    def __init__(self, rank: int, num_ranks: int, num_microbatches: int) -> None:
        self.stages = (rank, 2 * num_ranks - 1 - rank)
        self.num_microbatches = num_microbatches
        self.counts: dict[tuple[str, int], int] = {}  # (F or B, chunk) -> next micro-batch
        self.owed: deque[Action] = deque()  # weight gradients not yet scheduled, oldest first
        self.actions: list[Action] = []

    def add(self, pattern: str, times: int = 1) -> None:
        for _ in range(times):
            for token in pattern.split():
                self._add(token[0], int(token[1:]) if token[1:] else None)

    def _add(self, kind: str, chunk: int | None) -> None:
        if kind == "W":
            for owed in self.owed:
                if chunk is None or owed.stage == self.stages[chunk]:
                    self.owed.remove(owed)
                    self.actions.append(owed)
                    return
            return
        assert chunk is not None, "F, B and I tokens name their chunk"
        stage, counter = self.stages[chunk], ("F" if kind == "F" else "B", chunk)
        microbatch = self.counts.get(counter, 0)
        self.counts[counter] = microbatch + 1
        if microbatch >= self.num_microbatches:
            return
        self.actions.append(
            Action(Kind.FORWARD if kind == "F" else Kind.BACKWARD, stage, microbatch)
        )
        if kind == "I":
            self.owed.append(Action(Kind.WEIGHT, stage, microbatch))


def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al., ICLR 2024, section 6): zero bubble at 1F1B's activation memory.

    Stages are placed in a V (:func:`v_stage_to_rank`), 2K of them on K ranks, and every
    backward is split into ``B`` (input gradient) and ``W`` (weight gradients). Rank r
    warms up with ``2(K-r)-1`` forwards of its first stage, ``r`` pairs of forwards of its
    two stages, then ``K-r`` rounds of F, B, W on its second stage; in the steady state it
    runs F, B, W on each stage in turn; it cools down with ``r`` pairs of backwards, ``K-r``
    of B and W on its first stage, then the weight gradients still owed. With equal F, B,
    W costs and M >= 2K-1 a rank idles only for the V's fill, K-1 stage forwards: a bubble
    of ``(K-1)/(6M+K-1)`` (a stage being half a rank's layers), half of ZB-H1's idle time;
    and a rank holds at most 2K stage-activations of half a micro-batch each: the K
    micro-batches 1F1B holds on its first rank.
    """
    _check_sizes("zb-v", num_ranks=num_ranks, num_microbatches=num_microbatches)
    K, M = num_ranks, num_microbatches
    n = max(M, 2 * K - 1)  # the pattern's micro-batches; those >= M are left out
    rows = []
    for r in range(K):
        rank = _VRank(r, K, M)
        rank.add("F0", 2 * (K - r) - 1)
        rank.add("F1 F0", r)
        rank.add("F1 I1 W1", K - r)
        rank.add("F0 I0 W0 F1 I1 W1", n - 2 * K + r + 1)
        rank.add("I0 W0 F1 I1 W1", K - r - 1)
        rank.add("I0 I1", r)
        rank.add("I0 W0", K - r)
        rank.add("W1", r)
        rank.add("W0", r)
        rows.append(rank.actions)
    return _build("zb-v", M, v_stage_to_rank(K), rows, buffered_sends=True)


def dualpipe_v_problem(num_ranks: int, num_microbatches: int) -> str:
    """Why DualPipe-V cannot take these sizes ("" when it can): its steady state pairs
    micro-batches across the V, so it needs at least as many as its 2K stages."""
    K, M = num_ranks, num_microbatches
    if M >= 2 * K:
        return ""
    return (
        f"{M} micro-batches are fewer than its {2 * K} stages (2 per rank on {K} ranks); its "
        f"steady state pairs micro-batches across the V: use >= {2 * K} micro-batches, or 'zb-v'"
    )


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe-V (DeepSeek-V3's DualPipe folded into a V): forward and backward in pairs.

    Same placement as ZB-V. In the steady state rank r runs pairs of the forward of one
    micro-batch and the backward of another on its other stage (``F0 B1`` then ``F1 B0``),
    which DualPipe overlaps so that one's communication hides behind the other's compute;
    here a pair is two consecutive actions, the order the overlap would follow. Backwards
    are whole there; the warm-up's and the drain's backwards are split, their ``W`` filling
    the gaps. Rank r: ``2(K-r-1)`` forwards of its first stage, ``r+1`` pairs of forwards,
    ``K-r-1`` rounds of B, W, F on its second stage, ``M-2K+r+1`` double pairs, ``K-r-1``
    rounds of B1 F1 B0, then ``r+1`` pairs of backwards (the later half split), then the
    first stage's remaining backwards, split, and the owed ``W``. Needs M >= 2K.
    """
    _check_sizes("dualpipe-v", num_ranks=num_ranks, num_microbatches=num_microbatches)
    K, M = num_ranks, num_microbatches
    problem = dualpipe_v_problem(K, M)
    if problem:
        raise ScheduleError(f"dualpipe-v: {problem}")
    rows = []
    for r in range(K):
        rank = _VRank(r, K, M)
        rank.add("F0", 2 * (K - r - 1))
        rank.add("F0 F1", r + 1)
        rank.add("I1 W F1", K - r - 1)
        rank.add("F0 B1 F1 B0", M - 2 * K + r + 1)
        rank.add("B1 F1 B0", K - r - 1)
        # The drain splits its later backwards so that their W fill the bubbles; on odd
        # ranks the split starts one action earlier, so ranks alternate.
        middle = (r + 1) // 2
        for i in range(r + 1):
            split_from_first = i > middle or (i == middle and r % 2 == 1)
            rank.add(("I1" if split_from_first else "B1") + (" I0" if i >= middle else " B0"))
        rank.add("W I0", K - r - 1)
        rank.add("W", r + 1)
        rows.append(rank.actions)
    return _build("dualpipe-v", M, v_stage_to_rank(K), rows, buffered_sends=True)
