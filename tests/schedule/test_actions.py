"""The vocabulary of schedules: ``Action`` (``F3@1``), ``Kind``, ``TimedAction``."""

import pytest

from gpipe.schedule import Action, Kind, ScheduleError, TimedAction


def test_action_str_and_parse_round_trip():
    a = Action(Kind.BACKWARD, stage=1, microbatch=3)
    assert str(a) == "B3@1"
    assert Action.parse("B3@1") == a
    assert Action.parse(" w 12 @ 0 ") == Action(Kind.WEIGHT, 0, 12)
    assert Action("F", 0, 1).kind is Kind.FORWARD


@pytest.mark.parametrize("text", ["X1@0", "F1", "F@1", "F-1@0", "", "F1@0@2"])
def test_action_parse_rejects_malformed(text):
    with pytest.raises(ScheduleError, match=r"cannot parse action .*'F3@1'"):
        Action.parse(text)


def test_a_kind_is_one_of_f_b_w_and_a_timed_action_has_a_duration():
    with pytest.raises(ScheduleError, match="action kind must be one of F, B, W, got 'X'"):
        Action("X", 0, 0)
    timed = TimedAction(rank=1, action=Action.parse("W2@1"), start=1.5, end=4.0)
    assert timed.duration == 2.5
    error = ScheduleError("late", action=timed.action)
    assert error.action == Action(Kind.WEIGHT, 1, 2) and str(error) == "late"
