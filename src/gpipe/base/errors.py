"""The errors a user of gpipe meets, in one place.

Each layer raises its own ``ValueError`` subclass for bad input (``ScheduleError``,
``SkipError``, ``TiedError``, ``BudgetError``); the three below cross layers: a
configuration that cannot be cut, a failure somewhere else in the pipeline, and a step
refused because its loss or a gradient is not finite.
"""

from __future__ import annotations

__all__ = ["COMMUNICATION_FAILURES", "NonFiniteError", "PartitionError", "PipelineError"]

# The words gloo and torch.distributed use when a collective or a message waited past its
# timeout or its peer went away (e.g. gloo: "Application timeout caused pair closure").
COMMUNICATION_FAILURES = (
    "Timed out",
    "timed out",
    "Connection closed",
    "Connection reset",
    "pair closure",
)


class PartitionError(ValueError):
    """A ``balance``/``devices`` combination that cannot cut the model."""


class PipelineError(RuntimeError):
    """A failure elsewhere in the pipeline (another rank raised, died or stalled)."""

    def __init__(
        self, message: str, *, rank: int | None = None, global_rank: int | None = None
    ) -> None:
        super().__init__(message)
        self.rank = rank  # the pipeline rank that failed first, when known
        self.global_rank = global_rank  # that rank in the whole job, when known


class NonFiniteError(FloatingPointError):
    """A step's loss or a gradient is NaN or infinite: every rank refused the step, and the
    gradients are as they were before it (an optimizer step now would change nothing)."""
