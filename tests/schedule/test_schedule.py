import dataclasses
import doctest

import pytest

import gpipe.schedule
from gpipe.schedule import (
    RECV_AHEAD,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    build_schedule,
    fill_drain,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
)


def table(schedule: Schedule) -> list[str]:
    """One line per rank, as written in the expected tables below."""
    return [" ".join(map(str, actions)) for actions in schedule.actions]


# --- Literal schedules -------------------------------------------------------------------------


def test_gpipe_2_stages_3_microbatches():
    assert table(fill_drain(2, 3)) == [
        "F0@0 F1@0 F2@0 B2@0 B1@0 B0@0",
        "F0@1 F1@1 F2@1 B2@1 B1@1 B0@1",
    ]


def test_1f1b_3_stages_4_microbatches():
    # warm-up of K-1-r forwards, then F/B pairs, then the remaining backwards
    assert table(one_f_one_b(3, 4)) == [
        "F0@0 F1@0 F2@0 B0@0 F3@0 B1@0 B2@0 B3@0",
        "F0@1 F1@1 B0@1 F2@1 B1@1 F3@1 B2@1 B3@1",
        "F0@2 B0@2 F1@2 B1@2 F2@2 B2@2 F3@2 B3@2",
    ]


def test_interleaved_2_ranks_4_microbatches_2_virtual_stages():
    # rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; groups of K=2 micro-batches
    schedule = interleaved_1f1b(2, 4, 2)
    assert schedule.stage_to_rank == (0, 1, 0, 1)
    assert table(schedule) == [
        "F0@0 F1@0 F0@2 F1@2 F2@0 B0@2 F3@0 B1@2 F2@2 B0@0 F3@2 B1@0 B2@2 B3@2 B2@0 B3@0",
        "F0@1 F1@1 F0@3 B0@3 F1@3 B1@3 F2@1 B0@1 F3@1 B1@1 F2@3 B2@3 F3@3 B3@3 B2@1 B3@1",
    ]


def test_zb_h1_2_stages_3_microbatches():
    # the last stage defers one weight gradient (W) to the end, stage 0 none
    assert table(zb_h1(2, 3)) == [
        "F0@0 F1@0 B0@0 W0@0 F2@0 B1@0 W1@0 B2@0 W2@0",
        "F0@1 B0@1 F1@1 B1@1 W0@1 F2@1 B2@1 W1@1 W2@1",
    ]


def test_zb_h1_4_stages_4_microbatches():
    assert table(zb_h1(4, 4)) == [
        "F0@0 F1@0 F2@0 F3@0 B0@0 W0@0 B1@0 W1@0 B2@0 W2@0 B3@0 W3@0",
        "F0@1 F1@1 F2@1 B0@1 F3@1 B1@1 W0@1 B2@1 W1@1 B3@1 W2@1 W3@1",
        "F0@2 F1@2 B0@2 F2@2 B1@2 F3@2 B2@2 W0@2 B3@2 W1@2 W2@2 W3@2",
        "F0@3 B0@3 F1@3 B1@3 F2@3 B2@3 F3@3 B3@3 W0@3 W1@3 W2@3 W3@3",
    ]


def test_single_stage_schedules():
    assert table(fill_drain(1, 2)) == ["F0@0 F1@0 B1@0 B0@0"]
    assert table(one_f_one_b(1, 2)) == ["F0@0 B0@0 F1@0 B1@0"]
    assert table(zb_h1(1, 2)) == ["F0@0 B0@0 W0@0 F1@0 B1@0 W1@0"]


def test_interleaved_with_one_virtual_stage_is_1f1b():
    assert interleaved_1f1b(3, 5, 1).actions == one_f_one_b(3, 5).actions


def test_str_shows_one_line_per_rank():
    assert str(one_f_one_b(2, 2)) == (
        "1f1b (2 stages, 2 micro-batches, 2 ranks)\n"
        "rank 0: F0@0 F1@0 B0@0 B1@0\n"
        "rank 1: F0@1 B0@1 F1@1 B1@1"
    )


def test_module_docstring_examples():
    assert doctest.testmod(gpipe.schedule).failed == 0


# --- Properties of the built-in schedules ------------------------------------------------------


def builtin_cases():
    for k in range(1, 9):
        for m in range(1, 33):
            yield "gpipe", k, m, 1
            yield "1f1b", k, m, 1
            yield "zb-h1", k, m, 1
            if m % k == 0:
                yield "interleaved-1f1b", k, m, 2
                yield "interleaved-1f1b", k, m, 3


@pytest.mark.parametrize("k", range(1, 9))
def test_validator_accepts_every_builtin_schedule(k):
    for name, kk, m, v in builtin_cases():
        if kk != k:
            continue
        built = build_schedule(name, num_ranks=k, num_microbatches=m, virtual_stages=v)
        fresh = dataclasses.replace(built)  # not yet validated: run the checker itself
        assert fresh.validate() is fresh
        assert (fresh.num_ranks, fresh.num_stages, fresh.num_microbatches) == (k, k * v, m)
        kinds = {a.kind for actions in fresh.actions for a in actions}
        assert (Kind.WEIGHT in kinds) == (name == "zb-h1")


def max_in_flight(actions, release: Kind) -> int:
    """Most micro-batches a rank has started (F) and not yet released, counting in list order."""
    live = peak = 0
    for a in actions:
        live += a.kind == Kind.FORWARD
        live -= a.kind == release
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("k,m", [(1, 5), (3, 2), (4, 4), (4, 16), (8, 3), (8, 32)])
def test_in_flight_per_rank(k, m):
    for actions in fill_drain(k, m).actions:
        assert max_in_flight(actions, Kind.BACKWARD) == m
    for r, actions in enumerate(one_f_one_b(k, m).actions):
        assert max_in_flight(actions, Kind.BACKWARD) == min(k - r, m)
    # zb-h1 holds a micro-batch until its W, and keeps 1F1B's peak of K on every rank
    for actions in zb_h1(k, m).actions:
        assert max_in_flight(actions, Kind.WEIGHT) == min(k, m)


def test_splits_backward_only_where_w_exists():
    assert zb_h1(3, 4).splits_backward(1, 2)
    assert not one_f_one_b(3, 4).splits_backward(1, 2)
    partial = Schedule.from_actions([["F0@0", "F1@0", "B0@0", "W0@0", "B1@0"]])
    assert partial.splits_backward(0, 0)
    assert not partial.splits_backward(0, 1)


def test_stages_of_rank():
    schedule = interleaved_1f1b(4, 4, 3)
    assert schedule.stages_of(1) == (1, 5, 9)
    assert schedule.stage_to_rank == tuple(s % 4 for s in range(12))


# --- Building by name, and argument errors -----------------------------------------------------


def test_build_schedule_by_name():
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
        schedule = build_schedule(name, num_ranks=2, num_microbatches=4)
        assert schedule.name == name
    assert build_schedule("1f1b", num_ranks=3, num_microbatches=5) == one_f_one_b(3, 5)


def test_unknown_schedule_lists_known_names():
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zb-h3'.*gpipe, 1f1b"):
        build_schedule("zb-h3", num_ranks=2, num_microbatches=4)


def test_virtual_stages_need_interleaved():
    with pytest.raises(ScheduleError, match=r"virtual_stages=2: .*one stage per rank.*interleaved"):
        build_schedule("1f1b", num_ranks=2, num_microbatches=4, virtual_stages=2)


def test_interleaved_needs_microbatches_multiple_of_ranks():
    with pytest.raises(ScheduleError, match=r"6 micro-batches .* its 4 ranks.*use 4 or 8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ScheduleError, match="use 4"):
        interleaved_1f1b(4, 3, 2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ScheduleError, match="num_microbatches must be a positive integer"):
        one_f_one_b(2, bad)
    with pytest.raises(ScheduleError, match="num_stages must be a positive integer"):
        fill_drain(bad, 2)


# --- Actions and from_actions ------------------------------------------------------------------


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


# --- The validator rejects broken schedules, naming the first bad action -----------------------

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
