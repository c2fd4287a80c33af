"""Capacity: the search against brute force, its galloping depth search against the
doubling one it replaced, sharded memory by hand, its options, and the one-process layouts
it searches (gpipe's and gradient accumulation's)."""

from __future__ import annotations

import itertools

import pytest

from gpipe.base._utils import MiB
from gpipe.estimate.cuts import cut_within, lightest_cut
from gpipe.estimate.memory_model import Held, MemoryModel, StageMemoryTable
from gpipe.estimate.profile import Profile
from gpipe.layout import Layout
from gpipe.planner import capacity
from gpipe.planner.capacity import _LayoutCosts, _Remembered, capacity_layouts, deepest, fit_of
from gpipe.planner.families import FamilyCosts, gpt_family, smallest_depth
from gpipe.planner.results import cheaper_first


def tiny_gpt(batch: int = 4):
    return gpt_family(d_model=16, heads=2, seq=8, vocab=64, batch=batch)


def compositions(n: int, k: int):
    """Every balance of n layers into k non-empty stages."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [bounds[s + 1] - bounds[s] for s in range(k)]


def fits_by_brute_force(table: StageMemoryTable, n: int, k: int, room: float) -> bool:
    for balance in compositions(n, k):
        start, ok = 0, True
        for s, size in enumerate(balance):
            ok = ok and table(s, start, start + size).total <= room
            start += size
        if ok:
            return True
    return False


def test_search_matches_brute_force_over_depths_and_layouts():
    family = tiny_gpt()
    costs = FamilyCosts(family)
    budget = 0.6 * MiB
    result = capacity(family, memory_budget=budget, processes=3, chunks=[1, 2], max_depth=14)
    assert len(result.rows) == len(capacity_layouts(family, 3, chunks=[1, 2]))
    best_params = 0
    for row in result.rows:
        at = _LayoutCosts(costs, row.layout, 2.0)
        largest = 0
        for depth in range(1, 15):
            table = at.table(depth)
            n = len(table.layers)
            if n >= row.layout.stages and fits_by_brute_force(table, n, row.layout.stages, budget):
                largest = depth
        assert (row.depth if row.fits else 0) == largest, row.layout.label()
        if row.fits:
            best_params = max(best_params, costs.parameters(largest))
            assert max(row.peaks) <= budget
            assert sum(row.balance) == largest + 2
    assert result.best.parameters == best_params
    # ranked: most parameters first, a tie to the cheaper layout
    keys = [(-r.parameters, cheaper_first(r.layout)) for r in result.rows if r.fits]
    assert keys == sorted(keys)
    assert "parameters" in result.table() and result.best.layout.label() in result.table()


def doubling(fits, low: int, cap: int) -> int:
    """The depth search before galloping from a guess (b9bfde3..eb5b52b): from ``low``,
    doubling steps, then bisection."""
    high, step = low, 1
    while True:
        probe = min(high + step, cap)
        if probe == high or not fits(probe):
            break
        high, step = probe, step * 2
    top = min(high + step, cap + 1)
    while top - high > 1:
        middle = (high + top) // 2
        if fits(middle):
            high = middle
        else:
            top = middle
    return high


def test_galloping_from_any_guess_finds_the_doubling_search_s_depth():
    calls = []

    def fits_up_to(last: int):
        def fits(depth: int) -> bool:
            calls.append(depth)
            return depth <= last

        return fits

    for low, cap in ((1, 1), (1, 40), (3, 37), (2, 10_000)):
        for last in {low, low + 1, (low + cap) // 2, cap - 1, cap, cap + 5}:
            if not low <= last:
                continue
            expected = doubling(fits_up_to(last), low, cap)
            assert expected == min(last, cap)
            for guess in {None, 0, low, low + 1, last - 3, last - 1, last, last + 1, last + 9,
                          cap, cap + 1, 2 * cap}:  # fmt: skip
                calls.clear()
                assert deepest(fits_up_to(last), low, cap, guess) == expected, (low, cap, last)
                assert all(low <= d <= cap for d in calls)
    # a guess a block off costs a few calls, where doubling from 1 costs ~2·log2(depth)
    calls.clear()
    assert deepest(fits_up_to(400), 1, 10_000, guess=401) == 400 and len(calls) <= 3


def test_the_search_s_depths_and_cuts_are_the_doubling_search_s():
    # every layout of a family, at budgets where it fits a few blocks, many, or none
    family = tiny_gpt()
    costs = FamilyCosts(family)
    for budget in (0.12 * MiB, 1.0 * MiB):  # some layouts fit nothing; all fit ~30 blocks
        result = capacity(family, memory_budget=budget, processes=2, chunks=[1, 2])
        for row in result.rows[::3]:
            at = _LayoutCosts(costs, row.layout, 2.0)

            def fits(depth: int, at=at, k=row.layout.stages, budget=budget) -> bool:
                table = at.table(depth)
                n = len(table.layers)
                return bool(cut_within(table, n, k, budget)) if n >= k else False

            low = smallest_depth(family, row.layout.stages)
            expected = doubling(fits, low, 10_000) if fits(low) else None
            assert (row.depth if row.fits else None) == expected, row.layout.label()
            table = at.table(row.depth)
            n = len(table.layers)
            assert tuple(lightest_cut(table, n, row.layout.stages)) == row.balance
            assert lightest_cut(_Remembered(table), n, row.layout.stages) == list(row.balance)


def test_sharded_memory_by_hand():
    prof = Profile.from_costs(
        [1.0] * 3, param_bytes=[4 * MiB, 1 * MiB, 2 * MiB], activation_bytes=MiB, saved_bytes=0
    )
    held = [Held(boundary=2, inner=1)]
    plain = StageMemoryTable(prof.layers, held, MemoryModel())(0, 0, 3)
    assert plain.total == pytest.approx(4 * 7 * MiB + 2 * MiB)  # P (1 + 1 + 2), 2 inputs
    replicas = StageMemoryTable(prof.layers, held, MemoryModel(replicas=2))(0, 0, 3)
    assert replicas.reduction == 7 * MiB and replicas.total == plain.total + 7 * MiB
    sharded = StageMemoryTable(prof.layers, held, MemoryModel(replicas=2, shard=True))(0, 1, 3)
    terms = sharded.terms()
    assert terms["parameters"] == 1.5 * MiB and terms["optimizer"] == 3 * MiB
    # shard="all": the shards of the gradients, and the largest layer's whole until reduced
    assert terms["gradients"] == 1.5 * MiB + 2 * MiB
    # its largest layer, and FSDP's flat buffer of it
    assert terms["gathered"] == 2 * 2 * MiB
    assert sharded.total == StageMemoryTable(
        prof.layers, held, MemoryModel(replicas=2, shard=True)
    ).total(0, 1, 3)
    whole = MemoryModel(replicas=2, shard=True, whole_gradients=True)  # shard="params"
    assert StageMemoryTable(prof.layers, held, whole)(0, 1, 3).gradients == 3 * MiB
    split = StageMemoryTable(
        prof.layers, held, MemoryModel(replicas=2, shard=True), splits_backward=True
    )(0, 1, 3)
    assert split.gathered == 3 * MiB + 2 * MiB  # W gathers the whole stage; a flat buffer
    assert split.gradients == 3 * MiB  # W's gradients are whole: reduced as "params"
    with pytest.raises(ValueError, match="replicas >= 2"):
        MemoryModel(shard=True)


def test_layout_labels_and_options():
    layout = Layout(
        stages=2, replicas=2, shard="all", chunks=8, schedule="1f1b", checkpoint="always"
    )
    assert layout.label() == "K=2 R=2 sharded M=8 1f1b always"
    with pytest.raises(ValueError, match="unknown optimizer"):
        capacity(tiny_gpt(), memory_budget=MiB, processes=1, optimizer="lion")
    with pytest.raises(ValueError, match="interleaved"):
        capacity_layouts(tiny_gpt(), 2, schedules=["interleaved-1f1b"])


def test_one_process_searches_gradient_accumulation_beside_gpipe():
    # Without remat, gpipe's schedule on one process holds every micro-batch's activations;
    # 1f1b's holds one (gradient accumulation). Both are candidates, and 1f1b fits deeper.
    family = tiny_gpt(batch=8)
    budget = 0.5 * MiB
    result = capacity(family, memory_budget=budget, processes=1, chunks=[8], checkpoints=["never"])
    rows = {r.layout.schedule_name: r for r in result.rows}
    assert sorted(rows) == ["1f1b", "gpipe"]  # every other schedule runs as one of the two
    accumulating = rows["1f1b"]
    assert accumulating.depth > rows["gpipe"].depth and result.best is accumulating
    same = fit_of(family, rows["gpipe"].layout, accumulating.depth, budget=budget)
    assert same.terms()["activations"] == pytest.approx(8 * accumulating.terms()["activations"])
