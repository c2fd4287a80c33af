"""The end of a step agreed by every rank (``gpipe.parallel.group.MultiProcess``), on the
rows a fake transport returns: the loss is the last stage's on every rank, a non-finite
gradient anywhere refuses the step on every rank, the first failed rank's own words are
raised, and a row that does not come raises the transport's error, told what the row is.
(Through real ranks: tests/parallel/test_distributed.py and tests/faults.)"""

from __future__ import annotations

import math

import pytest
import torch

from gpipe.base.errors import NonFiniteError, PipelineError
from gpipe.parallel import group
from gpipe.parallel.group import MultiProcess, refuse_step
from gpipe.transport.framing import AGREEMENT


class _Transport:
    def __init__(self, rows: list[list[float]] | Exception) -> None:
        self.rows, self.sent = rows, []

    def row(self, kind: int, row: torch.Tensor, what: str, doing: str) -> torch.Tensor:
        assert kind == AGREEMENT
        self.sent.append(row.tolist())
        self.words = (what, doing)
        if isinstance(self.rows, Exception):
            raise self.rows
        return torch.tensor(self.rows, dtype=torch.float64)

    def peer_gave_up(self) -> bool:
        return False


class _Ops:
    def __init__(self, messages: list[str]) -> None:
        self.messages = messages

    def all_gather_object(self, value, operation, *, doing):
        return self.messages


class _Rank(MultiProcess):
    """Rank ``rank`` of two, stage i on rank i."""

    def __init__(self, rank: int, rows, messages=("", "")) -> None:
        self.rank, self.steps, self.broken, self.group = rank, 4, None, None
        self.transport, self.ops = _Transport(rows), _Ops(list(messages))
        self.schedule = type("Schedule", (), {"stage_to_rank": [0, 1]})()

    def _collective(self, run, *args, failing=False, **kw):
        return run(*args, **kw)


def test_every_rank_returns_the_last_stage_s_loss_from_one_row_each():
    agreement = _Rank(0, [[0.0, 0, 0], [2.5, 0, 0]]).agree(None, None, None)
    assert agreement.loss.item() == 2.5 and agreement.loss.dtype == torch.float64
    assert not agreement.nonfinite_grads


def test_a_non_finite_gradient_on_another_rank_refuses_the_step_here():
    # Rank 0 found it; every rank gathers what each found.
    found = ("rank 0: a non-finite gradient of 'w'", "")
    rank = _Rank(1, [[0.0, 0, 1], [2.5, 0, 0]], messages=found)
    with pytest.raises(NonFiniteError, match=r"loss is 2.5; rank 0: a non-finite gradient of 'w'"):
        rank.agree(torch.tensor(2.5), 2.5, None)
    assert rank.transport.sent == [[2.5, 0.0, 0.0]]
    # With a GradScaler the step is not refused: the scaler skips it.
    kept = _Rank(1, [[0.0, 0, 1], [2.5, 0, 0]]).agree(None, 2.5, None, refuse_nonfinite=False)
    assert kept.nonfinite_grads


def test_the_first_failed_rank_s_own_words_are_raised_on_every_rank(monkeypatch):
    monkeypatch.setattr(group.dist, "get_global_rank", lambda _, rank: rank)
    said = {1: "rank 1 (stage 1) raised ValueError: bad"}  # its statement, in the job's store
    monkeypatch.setattr(group, "said_by", said.get)
    rows = [[0.0, 0, 0], [0.0, 2, 0]]  # rank 1 failed (failed rank + 1 in the row)
    rank = _Rank(0, rows)
    with pytest.raises(PipelineError, match=r"rank 0: the step failed elsewhere: rank 1 .*bad"):
        rank.agree(None, None, None)
    assert "ValueError: bad" in rank.broken


def test_a_row_that_does_not_come_raises_the_transport_s_error_naming_the_agreement():
    rank = _Rank(0, PipelineError("rank 1 did not arrive"))
    with pytest.raises(PipelineError, match=r"rank 1 did not arrive"):
        rank.agree(None, None, None)
    assert rank.transport.words == (
        "the end-of-step agreement (all-gather)",
        "ending step 4 of this Pipe",
    )


def test_refuse_step_passes_a_finite_clean_step_and_names_every_trouble():
    refuse_step(1.0, ["", ""])
    with pytest.raises(NonFiniteError, match=r"loss is nan; rank 1: a non-finite gradient"):
        refuse_step(math.nan, ["", "rank 1: a non-finite gradient of 'w'"])
