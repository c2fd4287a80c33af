"""The end of a step, agreed by every rank of a pipeline: the loss, who failed first, a
non-finite gradient anywhere, a per-stage clip of the step's gradients.

A failure in one rank is announced to its peers through the transport and then agreed on
by every rank (``fail``, then the agreement's rows), so that all ranks raise the same first
error instead of waiting for messages that will never come. The rows travel on the
transport's own wire (``PeerTransport.row``); their failures are named as every
failed wait's (``gpipe.transport.inquest.failure``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpipe.base.errors import NonFiniteError, PipelineError
from gpipe.engine.stage import Stage
from gpipe.parallel.clipping import Edit, check_edits
from gpipe.transport.framing import AGREEMENT
from gpipe.transport.inquest import said_by, waited_out

__all__ = ["Agreement", "StepAgreement", "refuse_step"]


@dataclass
class Agreement:
    """What every rank agreed on at the end of a step."""

    loss: torch.Tensor | None  # the step's loss (float64), on every rank; None: inference
    nonfinite_grads: bool  # a gradient of some rank holds a NaN or an infinity


class StepAgreement:
    """The agreement's part of ``gpipe.parallel.group.MultiProcess``: the rows of the step's
    end, and what a failed step tells its peers. Uses the group's ``transport``, ``ops``
    (its collectives), ``_collective``, ``rank``, ``steps`` and ``broken``."""

    def _gather(self, value: float, failed: int, troubled: bool = False) -> torch.Tensor:
        """Every rank's (value, failed rank + 1 or 0, non-finite gradient), one row per
        pipeline rank. The rows themselves say who failed (a failed rank sends its row after
        its notice)."""
        row = torch.tensor([value, failed + 1, troubled], dtype=torch.float64)
        operation = "the end-of-step agreement (all-gather)"
        doing = f"ending step {self.steps} of this Pipe"
        send = self.transport.row  # failed: this rank's row after its notice
        return self._collective(send, AGREEMENT, row, operation, doing, failing=failed >= 0)

    def agree(
        self,
        local_loss: torch.Tensor | None,
        loss_value: float | None,
        trouble: str | None,
        *,
        refuse_nonfinite: bool = True,
        why: str = "",
    ) -> Agreement:
        """The loss on every rank (it lives on the last stage's), and a last health check:
        a failure or a non-finite loss or gradient (``trouble``) anywhere (unless
        ``refuse_nonfinite`` is False) refuses the step on every rank."""
        value = loss_value if loss_value is not None else 0.0
        rows = self._gather(value, -1, troubled=trouble is not None)
        table = rows.tolist()  # one read of the agreement
        if failed := [int(row[1]) - 1 for row in table if row[1]]:
            # The failed ranks' words came in their notices, ahead of their rows.
            origin = min(failed)
            said = said_by(dist.get_global_rank(self.group, origin))
            self.broken = said or f"rank {origin} failed"
            raise PipelineError(
                f"rank {self.rank}: the step failed elsewhere: {self.broken}", rank=origin
            )
        loss = table[self.schedule.stage_to_rank[-1]][0]
        nonfinite_grads = any(row[2] for row in table)
        if refuse_nonfinite and (nonfinite_grads or not math.isfinite(loss)):
            found = f"rank {self.rank}: a non-finite gradient of {trouble!r}" if trouble else ""
            if why:
                found = f"rank {self.rank}: {why}" + (f"; {found}" if found else "")
            what = "the gather of what made the step non-finite"
            doing = f"ending step {self.steps}"
            refuse_step(
                loss, self._collective(self.ops.all_gather_object, found, what, doing=doing)
            )
        # The same on every rank; float64 holds a float32 or float64 loss exactly.
        return Agreement(torch.tensor(loss, dtype=torch.float64), nonfinite_grads)

    def check_edit(self, edit: Edit) -> None:
        """Every rank's edit of the step's gradients, gathered when its optimizer steps (one
        row each); a per-stage clip raises on every rank before any weight changes."""
        doing = f"checking the gradients of step {self.steps} before the optimizer step"
        row = torch.tensor(edit.row(), dtype=torch.float64)
        # A collective, not the transport's rows: those are frames of a step's sequences,
        # and this row comes between two steps (and is of another length).
        operation = "the clip check (all-gather)"
        rows = self._collective(self.ops.all_gather, row, operation, doing=doing)
        check_edits(rows, describe=lambda rank: f"rank {rank}")

    def fail(self, error: BaseException, stages: list[Stage]) -> None:
        """Tell the other ranks this step failed here (or upstream), then agree on who."""
        if self.broken is not None:  # a collective of this step failed here: peers told
            return
        me = dist.get_global_rank(self.group, self.rank)
        if isinstance(error, PipelineError):  # from elsewhere: this rank only waited
            origin, message, culprit = error.rank, str(error), error.global_rank
            if culprit is None and origin is not None:
                culprit = dist.get_global_rank(self.group, origin)
            origin = self.rank if origin is None else origin
        else:
            origin, culprit = self.rank, me
            held = ", ".join(str(s.index) for s in stages)
            message = f"rank {me} (stage {held}) raised {type(error).__name__}: {error}"
            error.add_note(f"raised in pipeline rank {self.rank} (stage {held})")
        self.broken = message
        # Its own wait failed: it waited a timeout for a rank that may never answer. It gives
        # up (and says so) instead of waiting for that rank again in the agreement; so it
        # does when a peer gave up (a collective of its failed): nobody would come to agree.
        # Either way the ranks still waiting on it hear its words.
        gave_up = waited_out(me, timeout=self.timeout) or self.transport.peer_gave_up()
        self.transport.announce_failure(
            {"rank": origin, "global_rank": culprit, "message": message, "gave_up": gave_up}
        )
        if gave_up:
            return
        # The peers have the announcement; the original error is what this rank raises.
        with contextlib.suppress(Exception):
            self._gather(0.0, failed=origin)


def refuse_step(loss: float, troubles: list[str]) -> None:
    found = [t for t in troubles if t]
    if found or not math.isfinite(loss):
        raise NonFiniteError(
            f"the step was refused (the loss is {loss:g}"
            + (f"; {'; '.join(found)}" if found else "")
            + "): its gradients were dropped, so the weights stay as they were; lower the "
            "learning rate, clip gradients, or look for the layer or input that overflows "
            "(mixed precision with a torch.amp.GradScaler: pass step(..., scaler=scaler), "
            "which skips such steps and lowers the scale instead)"
        )
