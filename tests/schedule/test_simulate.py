import doctest
import itertools

import pytest

import gpipe.schedule.simulate
from gpipe.schedule import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    TimedAction,
    build_schedule,
    fill_drain,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
)
from gpipe.schedule.simulate import Costs, simulate

GRID = [(k, m) for k in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16, 32)]


@pytest.mark.parametrize("k,m", GRID)
def test_gpipe_and_1f1b_bubble_and_memory(k, m):
    # Default costs: F = 1, full B = 2, so the ideal step is 3M and the fill/drain 3(K-1).
    gpipe, one_f = simulate(fill_drain(k, m)), simulate(one_f_one_b(k, m))
    for result in (gpipe, one_f):
        assert result.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))
        assert result.makespan == pytest.approx(3 * (m + k - 1))
        assert result.busy == (3.0 * m,) * k
    assert gpipe.peak_live_per_stage == (m,) * k
    assert one_f.peak_live_per_stage == tuple(min(k - r, m) for r in range(k))
    assert one_f.peak_live == min(k, m)


@pytest.mark.parametrize("k,m", [(k, m) for k, m in GRID if m >= k])
def test_zb_h1_cuts_1f1b_bubble_to_a_third_at_the_same_peak(k, m):
    zb, one_f = simulate(zb_h1(k, m)), simulate(one_f_one_b(k, m))
    assert zb.bubble_fraction == pytest.approx((k - 1) / (3 * m + k - 1))
    # idle time per rank: (K-1)(F+B-W) = K-1 against 1F1B's (K-1)(F+B+W) = 3(K-1)
    assert zb.idle == pytest.approx([k - 1] * k)
    assert one_f.idle == pytest.approx([3 * (k - 1)] * k)
    assert zb.peak_live == one_f.peak_live == k


@pytest.mark.parametrize("k,m", [(k, m) for k, m in GRID if m < k])
def test_zb_h1_with_few_microbatches_still_beats_1f1b(k, m):
    assert simulate(zb_h1(k, m)).makespan < simulate(one_f_one_b(k, m)).makespan


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("k,m", [(1, 3), (2, 2), (2, 8), (4, 4), (4, 8), (4, 32), (8, 16)])
def test_interleaved_bubble_and_memory(k, m, v):
    schedule = interleaved_1f1b(k, m, v)
    # each virtual stage holds 1/v of a rank's layers, so it costs 1/v
    result = simulate(schedule, Costs(forward=1 / v, backward=1 / v, weight=1 / v))
    assert result.bubble_fraction == pytest.approx((k - 1) / (v * m + k - 1))
    assert result.makespan == pytest.approx(3 * (m + (k - 1) / v))
    warmup = [2 * (k - 1 - r) + (v - 1) * k for r in range(k)]
    assert result.peak_live_per_rank == tuple(min(v * m, w + 1) for w in warmup)
    # scaling all costs alike leaves the fraction unchanged
    assert simulate(schedule).bubble_fraction == pytest.approx(result.bubble_fraction)


def test_transfer_latency_is_added_between_ranks_only():
    # F0@0 [0,1], F0@1 [1.5,2.5], B0@1 [2.5,4.5], B0@0 [5,7]
    result = simulate(one_f_one_b(2, 1), transfer=0.5)
    assert result.makespan == 7.0
    assert [(e.rank, str(e.action), e.start, e.end) for e in result.events] == [
        (0, "F0@0", 0.0, 1.0),
        (1, "F0@1", 1.5, 2.5),
        (1, "B0@1", 2.5, 4.5),
        (0, "B0@0", 5.0, 7.0),
    ]
    # stages 0 and 1 on one rank: the hand-off is free
    single = Schedule.from_actions([["F0@0", "F0@1", "B0@1", "B0@0"]])
    assert simulate(single, transfer=0.5).makespan == 6.0


def test_per_stage_costs():
    # Stage 1 forwards take 2: rank 1 runs F0 [1,3], F1 [3,5], then B1 [5,7], B0 [7,9];
    # rank 0 runs B1 [7,9], B0 [9,11].
    result = simulate(fill_drain(2, 2), Costs(forward=[1, 2], backward=1, weight=1))
    assert result.makespan == 11.0
    assert result.busy == (6.0, 8.0)
    assert result.idle == (5.0, 3.0)
    assert result.bubble_fraction == pytest.approx(1 - 14 / 22)


def test_split_backward_costs_backward_and_weight_separately():
    costs = Costs(forward=1.0, backward=2.0, weight=3.0)
    durations = {(e.action.kind): e.end - e.start for e in simulate(zb_h1(2, 2), costs).events}
    assert durations == {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0, Kind.WEIGHT: 3.0}
    unsplit = {e.action.kind: e.end - e.start for e in simulate(one_f_one_b(2, 2), costs).events}
    assert unsplit == {Kind.FORWARD: 1.0, Kind.BACKWARD: 5.0}


def test_activation_bytes_give_peak_bytes():
    result = simulate(one_f_one_b(3, 6), activation_bytes=[10.0, 20.0, 40.0])
    assert result.peak_bytes_per_stage == (30.0, 40.0, 40.0)
    assert result.peak_bytes_per_rank == (30.0, 40.0, 40.0)
    assert simulate(one_f_one_b(3, 6)).peak_bytes_per_stage is None
    # interleaved: a rank's bytes add up over its stages
    il = simulate(interleaved_1f1b(2, 2, 2), activation_bytes=1.0)
    assert il.peak_bytes_per_rank == tuple(float(p) for p in il.peak_live_per_rank)


def test_live_until_weight_gradient_when_split():
    # a single stage: F0 [0,1] B0 [1,2] W0 [2,3] F1 [3,4] ...; one micro-batch live at a time
    result = simulate(zb_h1(1, 3))
    assert result.peak_live_per_stage == (1,)
    # memory freed at t can be reused at t: back-to-back micro-batches never overlap
    assert simulate(one_f_one_b(1, 3)).peak_live_per_stage == (1,)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
def test_events_respect_order_and_dependencies(name):
    schedule = build_schedule(
        name, num_ranks=3, num_microbatches=6, virtual_stages=2 if "interleaved" in name else 1
    )
    events = simulate(
        schedule,
        Costs(forward=1.0, backward=[1.5, 0.5, 1.0, 2.0, 1.0, 1.0][: schedule.num_stages]),
        transfer=0.25,
    ).events
    assert len(events) == sum(len(actions) for actions in schedule.actions)
    assert all(isinstance(e, TimedAction) for e in events)
    assert [e.start for e in events] == sorted(e.start for e in events)
    ends = {e.action: e.end for e in events}
    for rank, actions in enumerate(schedule.actions):
        mine = [e for e in events if e.rank == rank]
        assert [e.action for e in mine] == list(actions)
        for before, after in itertools.pairwise(mine):
            assert after.start >= before.end
    for e in events:
        for dep in inputs(e.action, schedule.num_stages):
            latency = 0.25 if schedule.stage_to_rank[dep.stage] != e.rank else 0.0
            assert e.start >= ends[dep] + latency


def inputs(a: Action, num_stages: int) -> list[Action]:
    s, m = a.stage, a.microbatch
    if a.kind == Kind.FORWARD:
        return [Action(Kind.FORWARD, s - 1, m)] if s > 0 else []
    if a.kind == Kind.BACKWARD:
        later = [Action(Kind.BACKWARD, s + 1, m)] if s < num_stages - 1 else []
        return [Action(Kind.FORWARD, s, m), *later]
    return [Action(Kind.BACKWARD, s, m)]


def test_cost_errors_name_the_value_and_the_remedy():
    with pytest.raises(ValueError, match="forward has 3 values but the schedule has 2 stages"):
        simulate(one_f_one_b(2, 2), Costs(forward=[1, 2, 3]))
    with pytest.raises(ValueError, match="weight of stage 1 must be a non-negative number"):
        simulate(one_f_one_b(2, 2), Costs(weight=[1, -1]))
    with pytest.raises(ValueError, match="transfer must be a non-negative latency"):
        simulate(one_f_one_b(2, 2), transfer=-1)


def test_simulate_validates_first():
    broken = Schedule("broken", 1, 1, (0,), ((Action.parse("F0@0"),),))
    with pytest.raises(ScheduleError, match="B0@0 is missing"):
        simulate(broken)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
def test_large_pipeline_64_ranks_512_microbatches(name):
    # A sanity run at the largest supported size (well under a second each on a laptop).
    k, m, v = 64, 512, 2 if "interleaved" in name else 1
    schedule = build_schedule(name, num_ranks=k, num_microbatches=m, virtual_stages=v)
    result = simulate(schedule, Costs(forward=1 / v, backward=1 / v, weight=1 / v))
    expected = {
        "gpipe": (k - 1) / (m + k - 1),
        "1f1b": (k - 1) / (m + k - 1),
        "interleaved-1f1b": (k - 1) / (v * m + k - 1),
        "zb-h1": (k - 1) / (3 * m + k - 1),
    }[name]
    assert result.bubble_fraction == pytest.approx(expected)


def test_module_docstring_examples():
    assert doctest.testmod(gpipe.schedule.simulate).failed == 0
