"""Ranks given different Pipe arguments or batches refuse to train, naming the difference."""

from __future__ import annotations

import pytest

from gpipe.parallel.launch import launch
from injected_faults import DISAGREEMENT_TIMEOUT, disagreeing

pytestmark = pytest.mark.timeout(120)  # multi-process: a hang fails


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("schedule", "schedule: rank 1 has"),
        ("balance", "balance: rank 1 has [1, 3], rank 0 has [2, 2]"),
        ("chunks", "chunks: rank 1 has 2, rank 0 has 4"),
        ("batch", "the targets hold 6 samples but the inputs on the first stage's rank 8"),
    ],
)
@pytest.mark.slow
def test_ranks_that_disagree_refuse_to_train(setting, expected):
    outcomes = launch(disagreeing, 2, args=(setting,), timeout=30)
    for outcome in outcomes:
        assert outcome["type"] is not None and expected in outcome["message"], outcome
        assert outcome["seconds"] < DISAGREEMENT_TIMEOUT / 2, outcome  # not waiting it out
