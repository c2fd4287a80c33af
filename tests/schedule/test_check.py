"""The checker (``Schedule.validate``) rejects broken schedules, naming the first bad action."""

import dataclasses

import pytest

from gpipe.schedule import RECV_AHEAD, Action, Schedule, ScheduleError, interleaved_1f1b

GOOD_2x2 = [["F0@0", "F1@0", "B0@0", "B1@0"], ["F0@1", "B0@1", "F1@1", "B1@1"]]


def rejects(rows, match, *, action=None, **kwargs) -> ScheduleError:
    with pytest.raises(ScheduleError, match=match) as info:
        Schedule.from_actions(rows, **kwargs)
    if action is not None:
        assert info.value.action == Action.parse(action)
    return info.value


def test_rejects_duplicate():
    rows = [["F0@0", "F1@0", "B0@0", "F1@0", "B1@0"], GOOD_2x2[1]]
    rejects(
        rows,
        r"rank 0, position 3: F1@0 appears twice \(first at rank 0, position 1\)",
        action="F1@0",
    )


def test_rejects_missing():
    rows = [GOOD_2x2[0], ["F0@1", "B0@1", "F1@1"]]
    rejects(rows, r"B1@1 is missing.*add it to rank 1's list", action="B1@1")


def test_rejects_wrong_rank():
    rows = [["F0@0", "F0@1", "B0@1", "B0@0"], []]
    rejects(
        rows,
        r"F0@1 is listed on rank 0 but stage 1 is held by rank 1; move it to rank 1's list",
        action="F0@1",
        stage_to_rank=[0, 1],
    )


def test_rejects_out_of_range():
    rejects(
        [["F0@0", "B0@0", "F3@0", "B3@0"]],
        r"F3@0 names micro-batch 3, outside 0..1",
        num_microbatches=2,
    )
    rows = [["F0@0", "F0@1", "B0@1", "B0@0"]]
    rejects(rows, r"rank 0, position 1: F0@1 names stage 1, outside 0..0", stage_to_rank=[0])


def test_rejects_backward_before_forward():
    rows = [["F0@0", "B1@0", "F1@0", "B0@0"], ["F0@1", "B0@1", "F1@1", "B1@1"]]
    rejects(rows, r"rank 0, position 1: B1@0 runs before F1@0 \(position 2\)", action="B1@0")


def test_rejects_backward_before_next_stage_backward():
    # one rank holding both stages: the gradient of stage 1 must come first
    rows = [["F0@0", "F0@1", "B0@0", "B0@1"]]
    rejects(rows, r"B0@0 runs before B0@1 .*next stage's input gradient", action="B0@0")


def test_rejects_forward_before_previous_stage_forward():
    rows = [["F0@1", "F0@0", "B0@1", "B0@0"]]
    rejects(rows, r"F0@1 runs before F0@0 .*previous stage's output", action="F0@1")


def test_rejects_weight_before_backward():
    rows = [["F0@0", "W0@0", "B0@0"]]
    rejects(rows, r"W0@0 runs before B0@0 .*weight gradient follows", action="W0@0")


def test_rejects_two_ranks_each_sending_first():
    # Rank 0 sends F2 while rank 1 sends B0; each receive is posted too late on the other
    # side (B0@0 is 3 actions past F2@0, F2@1 3 past B0@1). Fine with buffered sends.
    rows = [
        ["F0@0", "F1@0", "F2@0", "B2@0", "B1@0", "B0@0"],
        ["F0@1", "B0@1", "F1@1", "B1@1", "F2@1", "B2@1"],
    ]
    error = rejects(rows, r"deadlock at F2@0", action="F2@0")
    message = str(error)
    assert (
        "rank 0 at F2@0 (position 2) waits to send to F2@1 on rank 1, at B0@1 (sending)" in message
    )
    assert (
        "rank 1 at B0@1 (position 1) waits to send to B0@0 on rank 0, at F2@0 (sending)" in message
    )


def test_rejects_receives_in_another_order_than_sends():
    rows = [
        ["F0@0", "F1@0", "F2@0", "B0@0", "B1@0", "B2@0"],
        ["F2@1", "F1@1", "F0@1", "B0@1", "B1@1", "B2@1"],
    ]
    message = str(rejects(rows, r"deadlock at F0@0", action="F0@0"))
    assert "rank 1 at F2@1 (position 0) waits to receive from F2@0 on rank 0" in message


def test_rejects_a_dependency_cycle_across_ranks():
    # F0@2 needs F0@1, which needs F0@0, which rank 0 runs only after F0@2
    rows = [["F0@2", "F0@0", "B0@2", "B0@0"], ["F0@1", "B0@1"]]
    message = str(rejects(rows, r"deadlock at F0@2", stage_to_rank=[0, 1, 0]))
    assert "rank 0 at F0@2 (position 0) waits to receive from F0@1 on rank 1" in message
    assert "rank 1 at F0@1 (position 0) waits to receive from F0@0 on rank 0" in message


def test_interleaved_needs_receives_posted_two_actions_ahead():
    # Megatron's interleaved order exchanges a forward's and a backward's tensors together:
    # with only one receive posted ahead, ranks 0 and 1 both block sending backwards.
    assert RECV_AHEAD == 2
    schedule = interleaved_1f1b(2, 4, 2)
    with pytest.raises(ScheduleError, match="deadlock at B0@2"):
        dataclasses.replace(schedule).validate(recv_ahead=1)
    dataclasses.replace(schedule).validate(recv_ahead=2)


def test_rejects_bad_shapes():
    with pytest.raises(ScheduleError, match=r"stage_to_rank has 1 entries but num_stages is 2"):
        Schedule("x", 2, 1, (0,), ((Action.parse("F0@0"),),)).validate()
    with pytest.raises(ScheduleError, match="rank 1 holds no stage"):
        Schedule.from_actions([["F0@0", "B0@0"], []])
    with pytest.raises(ScheduleError, match=r"stage_to_rank\[1\] = 5 is not a rank"):
        Schedule.from_actions(GOOD_2x2, stage_to_rank=[0, 5])
    with pytest.raises(ScheduleError, match="is not an Action"):
        Schedule("x", 1, 1, (0,), (("F0@0",),)).validate()


def test_buffered_sends_still_catch_a_cycle_of_receives():
    with pytest.raises(ScheduleError, match="deadlock"):
        Schedule.from_actions(
            # rank 0 waits for B0@1's gradient, rank 1 for F1@0's output
            [["F0@0", "B0@0", "F1@0", "B1@0"], ["F0@1", "F1@1", "B0@1", "B1@1"]],
            buffered_sends=True,
        )
