"""``Schedule``: per-rank action lists, built from actions or their strings."""

import pytest

from gpipe.schedule import Action, Kind, Schedule, ScheduleError, fill_drain, one_f_one_b, zb_h1


def test_str_shows_one_line_per_rank():
    assert str(one_f_one_b(2, 2)) == (
        "1f1b (2 stages, 2 micro-batches, 2 ranks)\n"
        "rank 0: F0@0 F1@0 B0@0 B1@0\n"
        "rank 1: F0@1 B0@1 F1@1 B1@1"
    )


def test_splits_backward_only_where_w_exists():
    assert zb_h1(3, 4).splits_backward(1, 2)
    assert not one_f_one_b(3, 4).splits_backward(1, 2)
    partial = Schedule.from_actions([["F0@0", "F1@0", "B0@0", "W0@0", "B1@0"]])
    assert partial.splits_backward(0, 0)
    assert not partial.splits_backward(0, 1)


def test_from_actions_with_strings_infers_stages_and_microbatches():
    schedule = Schedule.from_actions(
        [
            ["F0@0", "F1@0", "F2@0", "B2@0", "B1@0", "B0@0"],
            ["F0@1", "F1@1", "F2@1", "B2@1", "B1@1", "B0@1"],
        ],
        name="gpipe",
    )
    assert schedule == fill_drain(2, 3)


def test_from_actions_mixes_actions_and_strings_and_takes_stage_to_rank():
    f = Action(Kind.FORWARD, 0, 0)
    schedule = Schedule.from_actions(
        [[f, "F0@2", "B0@2", "B0@0"], ["F0@1", "B0@1"]], stage_to_rank=[0, 1, 0]
    )
    assert schedule.num_stages == 3
    assert schedule.stages_of(0) == (0, 2)


def test_from_actions_stage_on_two_ranks():
    with pytest.raises(ScheduleError, match="stage 0 has actions on rank 0 and rank 1"):
        Schedule.from_actions([["F0@0", "B0@0"], ["F1@0", "B1@0"]])


def test_from_actions_rejects_a_flat_list():
    with pytest.raises(ScheduleError, match="one list per rank"):
        Schedule.from_actions(["F0@0", "B0@0"])
