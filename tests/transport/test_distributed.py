"""The group carrier (gloo's point-to-point, as between machines) keeps the fault guarantees
where its receives are posted ahead: after steady steps (messages packed, a GPipe burst's
receives all posted where it begins), a stage that raises reaches every rank with the same
first error, naming it, within the timeout. (The sockets and NCCL's order: tests/faults.)"""

from __future__ import annotations

import multiprocessing

import pytest

from gpipe.parallel.launch import launch
from transport.group_cases import faulty_over_group

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def test_a_stage_that_raises_after_steady_steps_reaches_every_rank_over_the_group():
    timeout, fault_stage = 20.0, 1
    outcomes = launch(faulty_over_group, 3, args=(fault_stage, timeout), timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert outcome["transport"] == "group"
        assert "injected fault at micro-batch 2" in outcome["message"], outcome
        assert outcome["seconds"] < timeout
        if rank == fault_stage:
            assert outcome["type"] == "KeyError"
        else:
            assert outcome["pipeline_error"] and outcome["rank"] == fault_stage, outcome
    assert not multiprocessing.active_children()
