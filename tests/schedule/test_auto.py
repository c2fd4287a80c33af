"""``zb-auto``: a zero-bubble schedule searched for given costs under a memory limit."""

import doctest

import pytest

import gpipe.schedule.auto
from gpipe.schedule import (
    Kind,
    ScheduleError,
    build_schedule,
    v_stage_to_rank,
    zb_auto,
    zb_h1,
    zb_v,
)
from gpipe.schedule.simulate import Costs, simulate

HALF = Costs(forward=0.5, backward=0.5, weight=0.5)  # a V stage holds half a rank's layers


def test_errors_name_the_value_and_the_remedy():
    with pytest.raises(ScheduleError, match=r"memory_limit .* got 0"):
        zb_auto(2, 4, memory_limit=0)
    with pytest.raises(ScheduleError, match="transfer"):
        zb_auto(2, 4, transfer=-1.0)


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
