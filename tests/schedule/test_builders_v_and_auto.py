"""ZB-V and DualPipe-V (two stages per rank in a V) and zb-auto (searched): as data."""

import dataclasses
import doctest

import pytest

import gpipe.schedule.auto
from gpipe.schedule import (
    SCHEDULES,
    Kind,
    Schedule,
    ScheduleError,
    build_schedule,
    dualpipe_v,
    v_stage_to_rank,
    zb_auto,
    zb_h1,
    zb_v,
)
from gpipe.schedule.simulate import Costs, simulate

HALF = Costs(forward=0.5, backward=0.5, weight=0.5)  # a V stage holds half a rank's layers


def table(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, actions)) for actions in schedule.actions]


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


def test_buffered_sends_still_catch_a_cycle_of_receives():
    with pytest.raises(ScheduleError, match="deadlock"):
        Schedule.from_actions(
            # rank 0 waits for B0@1's gradient, rank 1 for F1@0's output
            [["F0@0", "B0@0", "F1@0", "B1@0"], ["F0@1", "F1@1", "B0@1", "B1@1"]],
            buffered_sends=True,
        )


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


def test_by_name_and_default_virtual_stages():
    assert set(SCHEDULES) == {
        "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v", "zb-auto"
    }  # fmt: skip
    defaults = [SCHEDULES[n].default_virtual_stages for n in ("1f1b", "zb-v", "dualpipe-v")]
    assert defaults == [1, 2, 2] and SCHEDULES["zb-auto"].default_virtual_stages == 1
    assert SCHEDULES["interleaved-1f1b"].default_virtual_stages == 2
    assert build_schedule("zb-v", num_ranks=3, num_microbatches=6) == zb_v(3, 6)
    assert build_schedule("dualpipe-v", num_ranks=2, num_microbatches=4, virtual_stages=2) == (
        dualpipe_v(2, 4)
    )
    assert build_schedule("zb-auto", num_ranks=3, num_microbatches=6).name == "zb-auto"


def test_errors_name_the_value_and_the_remedy():
    with pytest.raises(ScheduleError, match=r"virtual_stages=1: it places 2 stages per rank in"):
        build_schedule("zb-v", num_ranks=3, num_microbatches=6, virtual_stages=1)
    with pytest.raises(ScheduleError, match=r"5 micro-batches .* 6 stages.*>= 6 micro.*zb-v"):
        dualpipe_v(3, 5)
    with pytest.raises(ScheduleError, match=r"takes no options, got costs.*'zb-auto'"):
        build_schedule("zb-h1", num_ranks=2, num_microbatches=4, costs=Costs())
    with pytest.raises(ScheduleError, match=r"memory_limit .* got 0"):
        zb_auto(2, 4, memory_limit=0)
    with pytest.raises(ScheduleError, match="transfer"):
        zb_auto(2, 4, transfer=-1.0)


# --- zb-auto -----------------------------------------------------------------------------


def test_zb_auto_docstring():
    assert doctest.testmod(gpipe.schedule.auto).failed == 0


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_zb_auto_respects_the_memory_limit_and_splits_every_backward(k):
    for m in (1, 2, 5, 8):
        for limit in range(1, k + 2):
            schedule = zb_auto(k, m, memory_limit=limit)
            result = simulate(schedule)
            assert result.peak_live <= limit
            weights = {(a.stage, a.microbatch) for row in schedule.actions for a in row}
            assert all(schedule.splits_backward(s, mb) for s, mb in weights)
            assert sum(a.kind is Kind.WEIGHT for row in schedule.actions for a in row) == k * m


@pytest.mark.parametrize(
    "costs", [Costs(), Costs(1.0, 1.2, 0.8), Costs([1.0, 2.0, 1.0, 1.0], 1.0, 0.5)]
)
def test_zb_auto_is_at_least_as_fast_as_zb_h1_at_its_memory(costs):
    for m in (4, 8, 12):
        auto = simulate(zb_auto(4, m, costs=costs, transfer=0.1), costs, transfer=0.1)
        h1 = simulate(zb_h1(4, m), costs, transfer=0.1)
        assert auto.makespan <= h1.makespan + 1e-9
        assert auto.peak_live <= 4


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_zb_auto_on_a_v(k):
    for m in (1, 3, 8):
        for limit in sorted({1, k}):
            schedule = zb_auto(k, m, memory_limit=limit, virtual_stages=2)
            assert schedule.stage_to_rank == v_stage_to_rank(k)
            assert simulate(schedule).peak_live <= 2 * limit  # a V stage holds half
        auto = simulate(zb_auto(k, m, virtual_stages=2, costs=HALF), HALF)
        assert auto.makespan <= simulate(zb_v(k, m), HALF).makespan + 1e-9
    # with fewer micro-batches than ZB-V's warm-up is sized for, the search does better
    assert simulate(zb_auto(4, 3, virtual_stages=2, costs=HALF), HALF).makespan == 11.5
    assert simulate(zb_v(4, 3), HALF).makespan == 13.0
    with pytest.raises(ScheduleError, match=r"virtual_stages=3: it places 1 stage .* or 2 .*not 3"):
        build_schedule("zb-auto", num_ranks=2, num_microbatches=4, virtual_stages=3)


def test_zb_auto_trades_memory_for_time():
    tight, loose = simulate(zb_auto(4, 8, memory_limit=2)), simulate(zb_auto(4, 8))
    assert tight.peak_live <= 2 < loose.peak_live
    assert loose.makespan < tight.makespan
