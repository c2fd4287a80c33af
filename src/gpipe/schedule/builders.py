"""Schedules as pure data: the :class:`Schedule`, and the built-in ways to build one.

A :class:`Schedule` holds one tuple of actions (``gpipe.schedule.ir``) per rank and which
rank holds each stage; it knows nothing about tensors, so the same object is executed by
the runtime, checked by :meth:`Schedule.validate` (``gpipe.schedule.check``), timed by
``gpipe.simulate`` and drawn by ``gpipe.timeline``::

    >>> s = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    >>> print(s)
    1f1b (2 stages, 3 micro-batches, 2 ranks)
    rank 0: F0@0 F1@0 B0@0 F2@0 B1@0 B2@0
    rank 1: F0@1 B0@1 F1@1 B1@1 F2@1 B2@1

Splitting B from W is decided per (stage, micro-batch), though the built-in schedules split
all or nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpipe.schedule.check import RECV_AHEAD, check
from gpipe.schedule.ir import Action, Kind, ScheduleError

__all__ = [
    "SCHEDULES",
    "Schedule",
    "build_schedule",
    "fill_drain",
    "interleaved_1f1b",
    "one_f_one_b",
    "zb_h1",
]


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of a pipeline of ``num_stages`` stages and ``num_microbatches``.

    Build one with :func:`build_schedule`, a builder such as :func:`one_f_one_b`, or
    :meth:`from_actions` for a hand-made order; check a hand-made one with :meth:`validate`.
    """

    name: str
    num_stages: int  # pipeline stages S (= ranks * virtual stages)
    num_microbatches: int  # M
    stage_to_rank: tuple[int, ...]  # the rank (device) holding each stage
    actions: tuple[tuple[Action, ...], ...]  # per rank, in execution order
    _split: frozenset[tuple[int, int]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _valid: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Accept lists from hand-written code; stored as tuples so the schedule is hashable data.
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(acts) for acts in self.actions))

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def splits_backward(self, stage: int, microbatch: int) -> bool:
        """True iff ``W(stage, microbatch)`` exists, so that ``B`` computes only input grads."""
        if self._split is None:
            split = frozenset(
                (a.stage, a.microbatch)
                for acts in self.actions
                for a in acts
                if getattr(a, "kind", None) == Kind.WEIGHT
            )
            object.__setattr__(self, "_split", split)
        return (stage, microbatch) in self._split

    def __str__(self) -> str:
        head = (
            f"{self.name} ({self.num_stages} stages, {self.num_microbatches} micro-batches, "
            f"{self.num_ranks} ranks)"
        )
        rows = [f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions)]
        return "\n".join([head, *rows])

    def validate(self, *, recv_ahead: int = RECV_AHEAD) -> Schedule:
        """Check that the schedule can run; return it, or raise :class:`ScheduleError`.

        What is checked, and the communication model with ``recv_ahead`` receives posted
        per rank, is told in ``gpipe.schedule.check``.
        """
        if recv_ahead != RECV_AHEAD:
            check(self, recv_ahead=recv_ahead)  # a what-if: not remembered
        elif not self._valid:
            check(self)
            object.__setattr__(self, "_valid", True)
        return self

    @classmethod
    def from_actions(
        cls,
        actions: Sequence[Sequence[Action | str]],
        *,
        stage_to_rank: Sequence[int] | None = None,
        num_microbatches: int | None = None,
        name: str = "custom",
    ) -> Schedule:
        """Build and validate a schedule from per-rank lists of actions or strings.

        ``stage_to_rank`` defaults to the rank each stage's actions appear on, and
        ``num_microbatches`` to one more than the largest micro-batch index::

            Schedule.from_actions([["F0@0", "F1@0", "B1@0", "B0@0"],
                                   ["F0@1", "B0@1", "F1@1", "B1@1"]])
        """
        if isinstance(actions, str) or not all(
            isinstance(acts, Sequence) and not isinstance(acts, str) for acts in actions
        ):
            raise ScheduleError(
                "actions must be one list per rank, e.g. [['F0@0', 'B0@0'], ['F0@1', 'B0@1']]"
            )
        parsed: list[tuple[Action, ...]] = []
        for acts in actions:
            row = []
            for a in acts:
                if isinstance(a, str):
                    a = Action.parse(a)
                elif not isinstance(a, Action):
                    raise ScheduleError(f"expected an Action or a string like 'F0@1', got {a!r}")
                row.append(a)
            parsed.append(tuple(row))
        everything = [a for row in parsed for a in row]
        if not everything:
            raise ScheduleError("the schedule has no actions; give at least one rank's list")
        if stage_to_rank is None:
            owner: dict[int, int] = {}
            for rank, row in enumerate(parsed):
                for a in row:
                    if owner.setdefault(a.stage, rank) != rank:
                        raise ScheduleError(
                            f"stage {a.stage} has actions on rank {owner[a.stage]} and rank "
                            f"{rank} (e.g. {a}); a stage lives on one rank: move them or pass "
                            "stage_to_rank",
                            action=a,
                        )
            num_stages = max(owner) + 1
            unowned = [s for s in range(num_stages) if s not in owner]
            if unowned:
                raise ScheduleError(
                    f"stage {unowned[0]} has no actions, so its rank is unknown; add its "
                    "actions or pass stage_to_rank"
                )
            stage_to_rank = [owner[s] for s in range(num_stages)]
        if num_microbatches is None:
            num_microbatches = max(a.microbatch for a in everything) + 1
        return cls(
            name=name,
            num_stages=len(stage_to_rank),
            num_microbatches=num_microbatches,
            stage_to_rank=tuple(stage_to_rank),
            actions=tuple(parsed),
        ).validate()


# Integer codes index flat per-kind arrays in the checker (faster than hashing actions).


# -- built-in schedules ----------------------------------------------------------------------


def _check_sizes(name: str, **sizes: int) -> None:
    for label, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {label} must be a positive integer, got {value!r}")


def _build(
    name: str, num_microbatches: int, stage_to_rank: Sequence[int], rows: Sequence[list[Action]]
) -> Schedule:
    return Schedule(
        name=name,
        num_stages=len(stage_to_rank),
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(stage_to_rank),
        actions=tuple(tuple(row) for row in rows),
    ).validate()


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
    if v > 1 and M % K:
        lower, upper = M // K * K, (M // K + 1) * K
        hint = f"{lower} or {upper}" if lower else str(upper)
        raise ScheduleError(
            f"interleaved-1f1b: num_microbatches={M} is not a multiple of num_ranks={K}; "
            f"it takes micro-batches round the virtual stages in groups of {K}: use {hint}"
        )
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


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": fill_drain,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
}


def build_schedule(
    name: str, *, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """The built-in schedule ``name`` (a key of :data:`SCHEDULES`) for ``num_ranks`` ranks.

    ``virtual_stages`` (stages per rank) applies to ``"interleaved-1f1b"`` only::

        build_schedule("interleaved-1f1b", num_ranks=4, num_microbatches=8, virtual_stages=2)
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if name == "interleaved-1f1b":
        return interleaved_1f1b(num_ranks, num_microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ScheduleError(
            f"schedule {name!r} holds one stage per rank, got virtual_stages={virtual_stages!r}; "
            "use 'interleaved-1f1b' for several stages per rank"
        )
    return SCHEDULES[name](num_ranks, num_microbatches)
