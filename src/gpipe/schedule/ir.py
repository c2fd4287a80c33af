"""The vocabulary of schedules: actions, their kinds, the :class:`Schedule` (per-rank action
lists), timed actions and the schedule error.

An action is ``F`` (forward), ``B`` (backward) or ``W`` (weight gradient) of one micro-batch
on one stage, written ``F3@1`` (forward of micro-batch 3 on stage 1).

* ``F(s, m)`` needs the output of ``F(s-1, m)``; the last stage's ``F`` also computes the loss.
* ``B(s, m)`` needs ``F(s, m)`` and the input gradient from ``B(s+1, m)``; the last stage's
  ``B`` starts from the loss.
* ``B(s, m)`` is the **whole** backward of that micro-batch on that stage unless the schedule
  also holds ``W(s, m)``: then ``B`` computes only the input gradient (what the previous
  stage waits for) and ``W``, after it, the weight gradients (zero-bubble schedules). This
  is the one meaning of B everywhere in gpipe; :meth:`Schedule.splits_backward` tells which.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["Action", "Kind", "Schedule", "ScheduleError", "TimedAction"]


class Kind(StrEnum):
    """What an action computes."""

    FORWARD = "F"
    BACKWARD = "B"  # input gradient only when a W exists for the same (stage, micro-batch)
    WEIGHT = "W"


_KINDS = frozenset(k.value for k in Kind)

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
    # Checked with sends that never block (gpipe's transports'), not rendezvous: see check.py.
    buffered_sends: bool = False
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

    def validate(self, *, recv_ahead: int | None = None) -> Schedule:
        """Check that the schedule can run; return it, or raise :class:`ScheduleError`.

        What is checked, and the communication model with ``recv_ahead`` receives posted
        per rank (default ``gpipe.schedule.check.RECV_AHEAD``), is told in
        ``gpipe.schedule.check``.
        """
        # Imported here: the checker imports this module's vocabulary.
        from gpipe.schedule.check import RECV_AHEAD, check

        if recv_ahead is not None and recv_ahead != RECV_AHEAD:
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
        buffered_sends: bool = False,
    ) -> Schedule:
        """Build and validate a schedule from per-rank lists of actions or strings.

        ``stage_to_rank`` defaults to the rank each stage's actions appear on, and
        ``num_microbatches`` to one more than the largest micro-batch index.
        ``buffered_sends`` checks it under sends that never block, as gpipe's transports'
        (``gpipe.schedule.check``), for orders whose sends run far ahead of their receives::

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
            buffered_sends=buffered_sends,
        ).validate()
