"""The intermediate representation of a pipeline step: a :class:`Schedule`, per-rank lists of
actions (``gpipe.schedule.actions``: ``F``, ``B``, ``W`` of a micro-batch on a stage), and
which rank holds each stage.

A schedule knows nothing about tensors, so the same object is executed by the runtime,
checked by :meth:`Schedule.validate` (``gpipe.schedule.check``), timed by
``gpipe.simulate`` and drawn by ``gpipe.train.timeline``. Build one by name
(``gpipe.schedule.build_schedule``), with a builder (``gpipe.schedule.builders``), or from a
hand-made order (:meth:`Schedule.from_actions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpipe.schedule.actions import Action, Kind, ScheduleError, TimedAction
from gpipe.schedule.check import RECV_AHEAD, check

__all__ = ["Action", "Kind", "Schedule", "ScheduleError", "TimedAction"]


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
        parsed = _parse_rows(actions)
        everything = [a for row in parsed for a in row]
        if not everything:
            raise ScheduleError("the schedule has no actions; give at least one rank's list")
        if stage_to_rank is None:
            stage_to_rank = _owners(parsed)
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


def _parse_rows(actions: Sequence[Sequence[Action | str]]) -> list[tuple[Action, ...]]:
    """Per-rank lists of actions or strings like 'F0@1', as actions."""
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
    return parsed


def _owners(parsed: list[tuple[Action, ...]]) -> list[int]:
    """The rank of each stage: the one its actions appear on."""
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
    return [owner[s] for s in range(num_stages)]
