"""The hand-written schedules (``gpipe.schedule.builders``), written out as tables."""

import dataclasses

import pytest

from gpipe.schedule import (
    Kind,
    Schedule,
    ScheduleError,
    build_schedule,
    dualpipe_v,
    fill_drain,
    interleaved_1f1b,
    one_f_one_b,
    v_stage_to_rank,
    zb_h1,
    zb_v,
)
from gpipe.schedule.simulate import Costs, simulate

HALF = Costs(forward=0.5, backward=0.5, weight=0.5)  # a V stage holds half a rank's layers


def table(schedule: Schedule) -> list[str]:
    """One line per rank, as written in the expected tables below."""
    return [" ".join(map(str, actions)) for actions in schedule.actions]


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


def test_stages_of_rank():
    schedule = interleaved_1f1b(4, 4, 3)
    assert schedule.stages_of(1) == (1, 5, 9)
    assert schedule.stage_to_rank == tuple(s % 4 for s in range(12))


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


# --- Two stages per rank in a V ----------------------------------------------------------------


def test_v_placement():
    assert v_stage_to_rank(3) == (0, 1, 2, 2, 1, 0)
    schedule = zb_v(3, 6)
    assert schedule.stages_of(0) == (0, 5)  # the first and the last stage: the loss is here
    assert schedule.stages_of(2) == (2, 3)  # the turn of the V stays on one rank


def test_zb_v_2_ranks_4_microbatches():
    # rank 0: 3 forwards down the V, then F/B/W of its last stage and of its first in turn
    assert table(zb_v(2, 4)) == [
        "F0@0 F1@0 F2@0 F0@3 B0@3 W0@3 F1@3 B1@3 W1@3 F3@0 B0@0 W0@0 F2@3 B2@3 W2@3 "
        "B1@0 W1@0 F3@3 B3@3 W3@3 B2@0 W2@0 B3@0 W3@0",
        "F0@1 F0@2 F1@1 F1@2 B0@2 W0@2 F2@1 B0@1 W0@1 F2@2 B1@2 W1@2 F3@1 B1@1 W1@1 "
        "F3@2 B2@2 W2@2 B2@1 B3@2 B3@1 W2@1 W3@2 W3@1",
    ]


def test_dualpipe_v_2_ranks_4_microbatches():
    # the steady state pairs a forward with another micro-batch's whole backward (no W);
    # the warm-up's and the drain's later backwards are split
    assert table(dualpipe_v(2, 4)) == [
        "F0@0 F1@0 F2@0 F0@3 B0@3 W0@3 F1@3 F3@0 B1@3 F2@3 B0@0 B2@3 F3@3 B1@0 B3@3 "
        "B2@0 W2@0 B3@0 W3@0",
        "F0@1 F0@2 F1@1 F1@2 F2@1 B0@2 F2@2 B0@1 F3@1 B1@2 F3@2 B1@1 B2@2 B2@1 B3@2 B3@1 W3@2 W3@1",
    ]
    schedule = dualpipe_v(2, 4)
    assert not schedule.splits_backward(3, 1) and schedule.splits_backward(3, 0)


@pytest.mark.parametrize("k", range(1, 7))
def test_v_schedules_validate_for_every_size(k):
    for m in range(1, 25):
        for schedule in [zb_v(k, m)] + ([dualpipe_v(k, m)] if m >= 2 * k else []):
            fresh = dataclasses.replace(schedule)  # not yet validated: run the checker
            assert fresh.validate() is fresh
            assert (fresh.num_ranks, fresh.num_stages) == (k, 2 * k)
            assert fresh.stage_to_rank == v_stage_to_rank(k)


@pytest.mark.parametrize("k,m", [(2, 4), (3, 6), (4, 8)])
def test_v_schedules_need_buffered_sends(k, m):
    # Rank 0's warm-up forwards reach rank 1 only after its turn of the V: with rendezvous
    # sends (receives posted 2 actions ahead) the ranks would wait on each other.
    rendezvous = dataclasses.replace(zb_v(k, m), buffered_sends=False)
    with pytest.raises(ScheduleError, match="deadlock"):
        rendezvous.validate()


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 15, 16, 32])
def test_v_schedules_bubble_and_memory(k, m):
    zb = simulate(zb_v(k, m), HALF)
    if m >= 2 * k - 1:
        # Only the V's fill and drain idle, (K-1) half-stage forwards per rank: half of
        # ZB-H1's idle time (K-1) at the same peak, 2K half micro-batches = 1F1B's K.
        assert zb.bubble_fraction == pytest.approx((k - 1) / (6 * m + k - 1))
        assert zb.idle == pytest.approx([(k - 1) / 2] * k)
        assert zb.peak_live_per_rank == (2 * k,) * k
    else:
        assert zb.makespan <= simulate(zb_h1(k, m)).makespan
        assert zb.peak_live <= 2 * k
    if m >= 2 * k:
        dual = simulate(dualpipe_v(k, m), HALF)
        assert dual.bubble_fraction == pytest.approx((k - 1) / (6 * m + k - 1))
        assert dual.peak_live_per_rank == (2 * k + 1,) * k  # one half micro-batch more


def test_dualpipe_v_needs_two_micro_batches_per_stage():
    with pytest.raises(ScheduleError, match=r"5 micro-batches .* 6 stages.*>= 6 micro.*zb-v"):
        dualpipe_v(3, 5)
