"""The vocabulary of schedules: actions, their kinds, timed actions and the schedule error
(the words ``gpipe.schedule.ir``'s :class:`~gpipe.schedule.ir.Schedule` is made of).

An action is ``F`` (forward), ``B`` (backward) or ``W`` (weight gradient) of one micro-batch
on one stage, written ``F3@1`` (forward of micro-batch 3 on stage 1).

* ``F(s, m)`` needs the output of ``F(s-1, m)``; the last stage's ``F`` also computes the loss.
* ``B(s, m)`` needs ``F(s, m)`` and the input gradient from ``B(s+1, m)``; the last stage's
  ``B`` starts from the loss.
* ``B(s, m)`` is the **whole** backward of that micro-batch on that stage unless the schedule
  also holds ``W(s, m)``: then ``B`` computes only the input gradient (what the previous
  stage waits for) and ``W``, after it, the weight gradients (zero-bubble schedules). This
  is the one meaning of B everywhere in gpipe; :meth:`gpipe.schedule.ir.Schedule.splits_backward`
  tells which.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Action", "Kind", "ScheduleError", "TimedAction"]


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
