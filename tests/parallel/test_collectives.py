"""gpipe.parallel.collectives: a collective outside the schedule (clip_grad_norm_'s all-reduce,
the step-seed broadcast) waits no longer than the pipeline's timeout, then names the operation,
what this rank was doing and the rank that did not arrive or died, within the timeout + 5 s
(the other faults of a pipeline's ranks: faults/test_stalls.py)."""

from __future__ import annotations

import pytest

from gpipe.parallel.launch import LaunchError, launch
from injected_faults import late, stalled

TIMEOUT = 4.0  # the pipeline's; the process group's is far longer, as torchrun's 30 minutes
AT_ONCE = TIMEOUT / 2  # a woken rank learns what happened without waiting a timeout in turn


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("before", "operation", "who"),
    # Rank 0 starts a step without waiting (its seed goes ahead of its messages): the rank
    # that waits at a step's start is one that waits for rank 0.
    [("clip", "the clip_grad_norm_ all-reduce", 1), ("step", "the step-seed broadcast", 0)],
)
@pytest.mark.slow
def test_a_stalled_rank_makes_the_other_raise_within_the_timeout(tmp_path, before, operation, who):
    args = (before, "stall", TIMEOUT, str(tmp_path), None, who)
    outcomes = launch(stalled, 2, args=args, timeout=600)
    woken, waiting = outcomes[who], outcomes[1 - who]
    assert waiting["type"] == "PipelineError", waiting
    assert TIMEOUT - 0.5 <= waiting["seconds"] <= late(waiting, TIMEOUT), waiting
    message = waiting["message"]
    assert message.startswith(
        f"rank {1 - who}, "
        f"{'clip_grad_norm_ after step 1' if before == 'clip' else 'starting step 2'}"
    ), message
    assert operation in message and f"timeout of {TIMEOUT:g} s" in message
    assert f"rank {who} did not arrive" in message and "raise the timeout" in message
    # Awake, the stalled rank learns at once what happened instead of waiting in turn.
    assert woken["type"] == "PipelineError" and woken["seconds"] < AT_ONCE, woken


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_rank_that_dies_before_clip_grad_norm_is_named(tmp_path):
    with pytest.raises(LaunchError) as raised:
        args = ("clip", "die", TIMEOUT, str(tmp_path))
        launch(stalled, 2, args=args, timeout=600, grace=TIMEOUT + 10)
    assert list(raised.value.failures) == [1]  # exited with code 3
    survivor = raised.value.results[0]
    assert survivor["type"] == "PipelineError", survivor
    assert survivor["seconds"] <= late(survivor, TIMEOUT), survivor
    message = survivor["message"]
    assert "the clip_grad_norm_ all-reduce" in message and "rank 1" in message, message
