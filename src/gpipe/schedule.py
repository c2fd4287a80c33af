"""Schedules as pure data: for each rank, the ordered list of actions it runs.

An action is ``F`` (forward), ``B`` (backward) or ``W`` (weight gradient) of one micro-batch
on one stage, written ``F3@1`` (forward of micro-batch 3 on stage 1). A :class:`Schedule`
holds one tuple of actions per rank and which rank holds each stage; it knows nothing about
tensors, so the same object is executed by the runtime, checked by :meth:`Schedule.validate`,
timed by :func:`gpipe.simulate.simulate` and drawn by the CLI::

    >>> s = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    >>> print(s)
    1f1b (2 stages, 3 micro-batches, 2 ranks)
    rank 0: F0@0 F1@0 B0@0 F2@0 B1@0 B2@0
    rank 1: F0@1 B0@1 F1@1 B1@1 F2@1 B2@1

Dependencies (what the runtime relies on):

* ``F(s, m)`` needs the output of ``F(s-1, m)``; the last stage's ``F`` also computes the loss.
* ``B(s, m)`` needs ``F(s, m)`` and the input gradient from ``B(s+1, m)``; the last stage's
  ``B`` starts from the loss.
* If ``W(s, m)`` exists, ``B(s, m)`` computes only the input gradient and ``W(s, m)`` (after
  it) the weight gradient; otherwise ``B(s, m)`` is the whole backward. Splitting is decided
  per (stage, micro-batch), though the built-in schedules split all or nothing.

Communication model checked by :meth:`Schedule.validate`. Hand-offs between stages on the
same rank never block. Between ranks a send is a rendezvous: it completes only once the
receiving rank has posted the matching receive, and the sender computes nothing until it
has. A rank keeps the receives of its next :data:`RECV_AHEAD` (= 2) actions posted: after
computing action j it posts j's sends together with the receive of action j+2 (the one of
j+1 is already up), as one ``batch_isend_irecv``. One action ahead is what 1F1B needs (it
is Megatron's ``send_forward_recv_backward``: with strictly one transfer at a time, rank 0
sending ``F1`` and rank 1 sending ``B0`` would wait on each other forever); Megatron's
interleaved 1F1B exchanges a forward's and a backward's tensors in one batch and needs two.
On a backend whose operations proceed independently (gloo), a runtime that posts receives
earlier, or whose sends do not block (``isend``), can only make more progress, so a schedule
that passes is safe for it too. A backend that runs a process's operations in issue order
(NCCL) is different: an early receive holds back later sends. For those the transport posts
each receive at the point :func:`gpipe.transport.receive_points` derives from the schedule.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NoReturn

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "RECV_AHEAD",
    "ScheduleError",
    "TimedAction",
    "build_schedule",
    "fill_drain",
    "interleaved_1f1b",
    "one_f_one_b",
    "zb_h1",
]


class Kind(StrEnum):
    """What an action computes."""

    FORWARD = "F"
    BACKWARD = "B"  # input gradient only when a W exists for the same (stage, micro-batch)
    WEIGHT = "W"


_KINDS = frozenset(k.value for k in Kind)
RECV_AHEAD = 2  # receives each rank keeps posted, counted in actions (see module docstring)

_ACTION_RE = re.compile(r"\s*([FBW])\s*(\d+)\s*@\s*(\d+)\s*", re.IGNORECASE)


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One unit of work: ``kind`` of ``microbatch`` on ``stage``; ``str`` gives ``"F3@1"``."""

    kind: Kind
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        # Accept "F" for Kind.FORWARD: the runtime compares kinds by identity.
        if type(self.kind) is not Kind:
            if not (isinstance(self.kind, str) and self.kind in _KINDS):
                raise ScheduleError(f"action kind must be one of F, B, W, got {self.kind!r}")
            object.__setattr__(self, "kind", Kind(self.kind))

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("B3@1") == Action(Kind.BACKWARD, 1, 3)``."""
        match = _ACTION_RE.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected KIND MICROBATCH@STAGE with KIND one "
                "of F, B, W, e.g. 'F3@1' for the forward of micro-batch 3 on stage 1"
            )
        kind, microbatch, stage = match.groups()
        return cls(Kind(kind.upper()), int(stage), int(microbatch))


class ScheduleError(ValueError):
    """A schedule that cannot run; ``action`` is the first offending action, if any."""

    def __init__(self, message: str, *, action: Action | None = None) -> None:
        super().__init__(message)
        self.action = action


@dataclass(frozen=True, slots=True)
class TimedAction:
    """An action with its start and end time (seconds, or cost units when simulated)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


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

    def validate(self) -> Schedule:
        """Check that the schedule can run; return it, or raise :class:`ScheduleError`.

        Checks, in this order: sizes; each action's type, ranges, rank and uniqueness; that
        every stage runs ``F`` and ``B`` of every micro-batch; the order of dependent
        actions on the same rank; and, by running the ranks' program counters under the
        blocking-send model of the module docstring, that no two ranks wait on each other.
        Linear in the number of actions.
        """
        if not self._valid:
            _Checker(self).run()
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
_F, _B, _W = 0, 1, 2
_CODE = {Kind.FORWARD: _F, Kind.BACKWARD: _B, Kind.WEIGHT: _W}
_KIND = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
_WHY = {  # (kind, kind of the input it needs) -> the dependency in words
    (_F, _F): "it needs the previous stage's output",
    (_B, _F): "a stage's backward follows its forward",
    (_B, _B): "it needs the next stage's input gradient",
    (_W, _B): "the weight gradient follows the input gradient",
}
_MAX_LINES = 8  # stuck ranks listed in a deadlock message

Slot = tuple[int, int]  # (rank, position in that rank's list)


class _Checker:
    """One validation pass; see :meth:`Schedule.validate`."""

    def __init__(self, schedule: Schedule) -> None:
        self.s = schedule
        self.S, self.M = schedule.num_stages, schedule.num_microbatches
        self.where: list[list[Slot | None]] = []  # [code][stage * M + mb] -> slot
        self.inbound: list[list[Slot | None]] = []  # [rank][pos] -> cross-rank producer
        self.outbound: list[list[Slot | None]] = []  # [rank][pos] -> cross-rank consumer

    def run(self) -> None:
        self._check_shape()
        self._check_actions()
        self._check_complete()
        self._check_order()
        self._check_deadlock()

    def fail(self, message: str, action: Action | None = None) -> NoReturn:
        raise ScheduleError(f"schedule {self.s.name!r}: {message}", action=action)

    def _check_shape(self) -> None:
        s = self.s
        for label, value in (
            ("num_stages", s.num_stages),
            ("num_microbatches", s.num_microbatches),
        ):
            if not isinstance(value, int) or value < 1:
                self.fail(f"{label} must be a positive integer, got {value!r}")
        if s.num_ranks < 1:
            self.fail("actions has no rank lists; give one list of actions per rank")
        if len(s.stage_to_rank) != s.num_stages:
            self.fail(
                f"stage_to_rank has {len(s.stage_to_rank)} entries but num_stages is "
                f"{s.num_stages}; give the rank of every stage"
            )
        for stage, rank in enumerate(s.stage_to_rank):
            if not isinstance(rank, int) or not 0 <= rank < s.num_ranks:
                self.fail(
                    f"stage_to_rank[{stage}] = {rank!r} is not a rank of this schedule "
                    f"(0..{s.num_ranks - 1}, one per action list)"
                )
        idle = sorted(set(range(s.num_ranks)) - set(s.stage_to_rank))
        if idle:
            self.fail(f"rank {idle[0]} holds no stage; drop its action list or give it a stage")

    def _check_actions(self) -> None:
        s, S, M = self.s, self.S, self.M
        where: list[list[Slot | None]] = [[None] * (S * M) for _ in _KIND]
        for rank, acts in enumerate(s.actions):
            for pos, a in enumerate(acts):
                at = f"rank {rank}, position {pos}"
                if not isinstance(a, Action) or a.kind not in _CODE:
                    self.fail(f"{at}: {a!r} is not an Action (use Action.parse('F0@1'))")
                if not isinstance(a.stage, int) or not 0 <= a.stage < S:
                    self.fail(f"{at}: {a} names stage {a.stage!r}, outside 0..{S - 1}", a)
                if not isinstance(a.microbatch, int) or not 0 <= a.microbatch < M:
                    self.fail(
                        f"{at}: {a} names micro-batch {a.microbatch!r}, outside 0..{M - 1} "
                        f"(num_microbatches={M})",
                        a,
                    )
                owner = s.stage_to_rank[a.stage]
                if owner != rank:
                    self.fail(
                        f"{at}: {a} is listed on rank {rank} but stage {a.stage} is held by "
                        f"rank {owner}; move it to rank {owner}'s list",
                        a,
                    )
                slots = where[_CODE[a.kind]]
                key = a.stage * M + a.microbatch
                if (first := slots[key]) is not None:
                    self.fail(
                        f"{at}: {a} appears twice (first at rank {first[0]}, position "
                        f"{first[1]}); each action runs exactly once",
                        a,
                    )
                slots[key] = (rank, pos)
        self.where = where

    def _check_complete(self) -> None:
        M = self.M
        for code in (_F, _B):
            missing = [k for k, slot in enumerate(self.where[code]) if slot is None]
            if missing:
                a = Action(_KIND[code], *divmod(missing[0], M))
                more = f" ({len(missing) - 1} more {a.kind} missing)" if len(missing) > 1 else ""
                self.fail(
                    f"{a} is missing{more}: every stage runs F and B once for each micro-batch "
                    f"0..{M - 1}; add it to rank {self.s.stage_to_rank[a.stage]}'s list",
                    a,
                )

    def _check_order(self) -> None:
        """Inputs produced on the same rank must come earlier in its list; link the others."""
        S, M, where = self.S, self.M, self.where
        for rank, acts in enumerate(self.s.actions):
            ins: list[Slot | None] = [None] * len(acts)
            outs: list[Slot | None] = [None] * len(acts)
            for pos, a in enumerate(acts):
                code, s, m = _CODE[a.kind], a.stage, a.microbatch
                # Inputs (kind, stage); the first one may come from another rank.
                if code == _F:
                    inputs = [(_F, s - 1)] if s > 0 else []
                    consumer = (_F, s + 1) if s < S - 1 else None
                elif code == _B:
                    inputs = [(_B, s + 1)] if s < S - 1 else []
                    inputs.append((_F, s))
                    consumer = (_B, s - 1) if s > 0 else None
                else:
                    inputs, consumer = [(_B, s)], None
                for dep_code, dep_stage in inputs:
                    dep_rank, dep_pos = where[dep_code][dep_stage * M + m]  # type: ignore[misc]
                    if dep_rank != rank:
                        ins[pos] = (dep_rank, dep_pos)
                    elif dep_pos > pos:
                        dep = Action(_KIND[dep_code], dep_stage, m)
                        self.fail(
                            f"rank {rank}, position {pos}: {a} runs before {dep} (position "
                            f"{dep_pos}), but {_WHY[code, dep_code]}; move {a} after {dep}",
                            a,
                        )
                if consumer is not None:
                    slot = where[consumer[0]][consumer[1] * M + m]
                    if slot is not None and slot[0] != rank:
                        outs[pos] = slot
            self.inbound.append(ins)
            self.outbound.append(outs)

    def _check_deadlock(self) -> None:
        """Run the ranks' program counters with rendezvous sends (see the module docstring)."""
        acts, inbound, outbound = self.s.actions, self.inbound, self.outbound
        R = self.s.num_ranks
        lengths = [len(a) for a in acts]
        pc = [0] * R
        computed = [False] * R  # has rank r computed acts[r][pc[r]] (and now waits to send)?

        def produced(rank: int, pos: int) -> bool:
            return pc[rank] > pos or (pc[rank] == pos and computed[rank])

        def receiving(rank: int, pos: int) -> bool:
            # Posted: positions up to pc + RECV_AHEAD - 1, one more once pc is computed.
            return pc[rank] + computed[rank] + RECV_AHEAD - 1 >= pos

        pending, queued = list(range(R)), [True] * R
        while pending:
            r = pending.pop()
            queued[r] = False
            woken = []
            while pc[r] < lengths[r]:
                pos = pc[r]
                if not computed[r]:
                    src = inbound[r][pos]
                    if src is not None and not produced(*src):
                        break
                    computed[r] = True
                    if (dst := outbound[r][pos]) is not None:
                        woken.append(dst[0])  # its receive may now complete
                    ahead = pos + RECV_AHEAD  # the receive posted just now
                    if ahead < lengths[r] and (src := inbound[r][ahead]) is not None:
                        woken.append(src[0])  # its send may now complete
                dst = outbound[r][pos]
                if dst is not None and not receiving(*dst):
                    break
                pc[r] += 1
                computed[r] = False
            for other in woken:
                if not queued[other]:
                    queued[other] = True
                    pending.append(other)

        stuck = [r for r in range(R) if pc[r] < lengths[r]]
        if not stuck:
            return

        def state(rank: int) -> str:
            if pc[rank] == lengths[rank]:
                return "done"
            doing = "sending" if computed[rank] else "receiving"
            return f"at {acts[rank][pc[rank]]} ({doing})"

        lines = []
        for r in stuck[:_MAX_LINES]:
            pos = pc[r]
            if computed[r]:
                b, q = outbound[r][pos]  # type: ignore[misc]
                wait = f"waits to send to {acts[b][q]} on rank {b}"
            else:
                b, q = inbound[r][pos]  # type: ignore[misc]
                wait = f"waits to receive from {acts[b][q]} on rank {b}"
            lines.append(f"rank {r} at {acts[r][pos]} (position {pos}) {wait}, {state(b)}")
        if len(stuck) > _MAX_LINES:
            lines.append(f"... and {len(stuck) - _MAX_LINES} more ranks")
        first = acts[stuck[0]][pc[stuck[0]]]
        self.fail(
            f"deadlock at {first}: with blocking sends the ranks wait on each other:\n  - "
            + "\n  - ".join(lines)
            + f"\nReorder so that each send meets a receive posted within {RECV_AHEAD} actions "
            "of where the receiving rank waits.",
            first,
        )


# --- Built-in schedules ---------------------------------------------------------------------


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
